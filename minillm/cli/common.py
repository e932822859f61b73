"""What every command shares: the one-line usage error, the parser, model and sampling options, the
thread governor and the busy-machine note, output checks."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .. import cpu_policy, malloc_policy
from ..device import DTYPES
from ..errors import OutputPathError, check_output_dir
from ..formats import weights
from ..generation_config import GenerationConfig


class UsageError(Exception):
    """Bad command-line usage: one line on stderr, exit code 2."""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with every option's default shown: "(default: X)" is appended unless the
    help already says what the default is (argparse's ArgumentDefaultsHelpFormatter would also
    print "default: None" for defaults decided later, and repeat the defaults already written)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (not action.option_strings or action.nargs == 0 or default in (None, argparse.SUPPRESS)
                or "default" in text.lower()):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        # No prefixes: `bench-serving --tp 3` would otherwise run as --tpot-slo-ms 3 without a word.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):  # argparse would print the whole usage block; one line is kinder
        raise UsageError(f"{message} (see '{self.prog} --help')")


def warn(message: str) -> None:
    """One line on stderr for a flag that is ignored or a result to take with care; never stdout."""
    print(f"minillm: warning: {message}", file=sys.stderr)


def wrote(path) -> None:
    """Announce an output file after writing it, on stderr: stdout stays the command's answer."""
    print(f"wrote {path}", file=sys.stderr)


def model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=weights.DEFAULT_MODEL,
                   help=f"model name, hub repo id, folder or .gguf file (default: {weights.DEFAULT_MODEL})")
    p.add_argument("--weights-dir", help="where models are stored (default: $MINILLM_WEIGHTS, ./weights, ~/.cache/minillm)")
    p.add_argument("--device", help="cpu, cuda or mps (default: cuda if available)")
    dtype_option(p, help="default float32 (bfloat16 on cuda)")
    quantize_option(p)
    fast_option(p)
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")


def dtype_option(p: argparse.ArgumentParser, **kwargs) -> None:
    """``--dtype`` of a command that loads a model: every dtype load_model takes (float64 is for checking
    that two paths agree to the last bit, not for speed)."""
    p.add_argument("--dtype", choices=list(DTYPES), **kwargs)


def thinking_option(p: argparse.ArgumentParser) -> None:
    """``--enable-thinking / --no-enable-thinking``: the chat template variable of reasoning models
    (Qwen3: off writes an empty <think></think>, so the model answers at once)."""
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction,
                   help="pass enable_thinking to the chat template (Qwen3: --no-enable-thinking skips the "
                        "reasoning; default: not passed, the template's own default)")


def chat_template_kwargs(args) -> dict:
    """The extra chat template variables the flags set: {} or {"enable_thinking": bool}."""
    return {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking}


def warn_if_template_ignores_thinking(args, tokenizer) -> None:
    """--enable-thinking on a template that never reads the variable (SmolLM2's) changes nothing: say so."""
    if (args.enable_thinking is not None and tokenizer.has_chat_template
            and "enable_thinking" not in str(tokenizer.chat_template)):
        warn("--enable-thinking/--no-enable-thinking has no effect: this model's chat template does not read "
             "enable_thinking (Qwen3's does)")


def quantize_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", choices=["int8", "int4"],
                   help="weight-only quantisation of the matrices at load (minillm/quantize.py); default: float")


def fast_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                   help="the speed layer (minillm/fast: stacked and C products, attention in C); --no-fast runs "
                        "the lesson's plain PyTorch, the same logits up to float rounding (in bfloat16 a near-tie can pick "
                        "another greedy token) (default: --fast)")


def model_argument(p: argparse.ArgumentParser, help: str) -> None:
    """``--model`` / ``-m`` as every command spells it, and the older positional MODEL, still accepted."""
    p.add_argument("model_positional", nargs="?", metavar="MODEL", help="same as --model (the older spelling)")
    p.add_argument("--model", "-m", help=f"{help} (default: {weights.DEFAULT_MODEL})")


def chosen_model(args) -> str:
    """The model named by --model or the positional MODEL (one of them), else the default."""
    if args.model_positional and args.model and args.model_positional != args.model:
        raise UsageError(f"two models given: {args.model_positional} and --model {args.model}; give one")
    return args.model or args.model_positional or weights.DEFAULT_MODEL


def ensure_model(name_or_path: str, weights_dir: str | None):
    """The model folder; a missing known model is downloaded first, with a notice (never for a local folder)."""
    if (weights.is_model_name(name_or_path) and not weights.is_local_folder(name_or_path, weights_dir)
            and not weights.is_downloaded(name_or_path, weights_dir)):
        print(f"minillm: {name_or_path} is not downloaded yet; fetching it into "
              f"{weights.weights_dir(weights_dir)} (once)", file=sys.stderr)
    return weights.resolve_model(name_or_path, weights_dir, download=True)


def check_out_file(flag: str, path: str, suffix: str | None = None) -> None:
    """A usage error now for an output file that could not be written after the work.

    Nothing is created: an existing file is replaced later, by the writer.
    """
    target = Path(path).expanduser().absolute()
    if suffix and target.suffix.lower() != suffix:
        raise UsageError(f"{flag}: {path} must end in {suffix}")
    if target.is_dir():
        raise UsageError(f"{flag}: {target} is a folder; give a file name")
    if not target.parent.is_dir():
        raise UsageError(f"{flag}: folder {target.parent} does not exist; create it or pick another path")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: cannot write in {target.parent} (permission denied); pick a folder you can write to")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{flag}: {target} is read-only; pick another file name")


def check_out_dir(flag: str, path: str) -> None:
    """A usage error now when the output folder ``path`` is empty or could not be written at the end."""
    if not str(path).strip():  # "" is the current folder to Path: never what `--flag=` meant
        raise UsageError(f"{flag} is empty; give a folder path")
    try:
        check_output_dir(path)
    except OutputPathError as e:
        raise UsageError(f"{flag}: {e}") from None


def kv_offload_options(p: argparse.ArgumentParser, dir_note: str = "") -> None:
    """The KV tiers under the paged pool (LLMEngine's ``kv_offload_memory``, ``kv_offload_dir``), both off by
    default; :func:`check_kv_offload` checks them before the model loads. ``dir_note``: what the command
    does with the folder, added to its help."""
    g = p.add_argument_group("KV blocks beyond the pool: prompt caching that survives eviction and restarts")
    g.add_argument("--kv-offload-memory", metavar="SIZE",
                   help="a host-memory tier for the KV blocks the pool evicts, SIZE bytes with a unit (512MiB, 2GiB) "
                        "or a fraction of free memory (0.3): a later prompt with the same prefix copies them back "
                        "instead of prefilling it again (vLLM's --kv-offloading-size; default: off)")
    g.add_argument("--kv-offload-dir", metavar="DIR",
                   help="a disk tier in the folder DIR (created if missing): every full KV block computed is "
                        "written there as a file named by its block hash, for later prompts with the same prefix, "
                        f"across restarts and by every process on the same DIR{dir_note} (default: off)")
    g.add_argument("--kv-offload-disk-size", metavar="SIZE",
                   help="bound the disk tier: past SIZE bytes (20GiB, or a fraction of the disk's free space: 0.5), "
                        "the least recently used block files are removed (LRU), pinned cache points kept until "
                        "their lifetime ends; needs --kv-offload-dir (LMCache's max_local_disk_size; default: "
                        "unbounded)")


def check_kv_offload(args) -> None:
    """Usage errors now, before the model loads, for a --kv-offload-memory or --kv-offload-disk-size that is
    not a size, a --kv-offload-disk-size without --kv-offload-dir, or a --kv-offload-dir that cannot be a
    folder (a file is in the way)."""
    from ..serving.paged_cache import parse_memory  # torch: only once a command runs

    for flag, value, what, free in (("--kv-offload-memory", args.kv_offload_memory, "the host tier's size", "free memory"),
                                    ("--kv-offload-disk-size", args.kv_offload_disk_size, "the disk tier's size",
                                     "free disk space")):
        try:
            if value is not None:
                parse_memory(value, 1, what, free)
        except ValueError as e:
            raise UsageError(f"{flag}: {e}") from None
    if args.kv_offload_disk_size is not None and args.kv_offload_dir is None:
        raise UsageError("--kv-offload-disk-size bounds the disk tier: give --kv-offload-dir DIR too")
    if args.kv_offload_dir is not None:
        check_out_dir("--kv-offload-dir", args.kv_offload_dir)


def write_text(path, text: str):
    Path(path).write_text(text)
    return path


def sampling_options(p: argparse.ArgumentParser) -> None:
    """The SamplingParams knobs as flags (vLLM's names), in one group; :func:`sampling_params` reads them.
    Unset ones take the checkpoint's generation_config.json default, else minillm's (see 'minillm info')."""
    g = p.add_argument_group("sampling and stopping (default: the model's generation_config.json, else the value shown)")
    g.add_argument("--max-new-tokens", type=int, help="most tokens to generate (256)")
    g.add_argument("--temperature", type=float, help="0 = greedy (0)")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, help="keep the smallest set reaching this probability mass (1 = off)")
    g.add_argument("--min-p", type=float, help="keep tokens with at least this fraction of the top probability (0 = off)")
    g.add_argument("--repetition-penalty", type=float,
                   help="> 1 discourages tokens of the prompt and output: logit / p if positive, * p if not (1 = off)")
    g.add_argument("--presence-penalty", type=float, help="subtracted from the logit of each output token so far (0)")
    g.add_argument("--frequency-penalty", type=float, help="subtracted once per occurrence in the output so far (0)")
    g.add_argument("--seed", type=int, help="seed of the sampler's random generator: the same seed, the same answer "
                                           "(none: a fresh random draw each run)")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="end the answer before this text (never printed); repeat for several")


_SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed", "stop")
_SAMPLE_ONLY_FLAGS = ("top_k", "top_p", "min_p", "seed")  # no effect on greedy decoding


def sampling_params(args, generation_config: GenerationConfig | None = None):
    """The SamplingParams of the flags :func:`sampling_options` added that the user set, over
    ``generation_config``'s defaults (the checkpoint's; None: minillm's). Called once without it before the
    model loads, so a bad value is a usage error (UsageError naming the flag: "--top-p must be ...") at once.
    Warns (stderr, one line) about sampling flags that greedy decoding ignores, as transformers does."""
    user_set = {name: getattr(args, name, None) for name in _SAMPLING_FLAGS}  # a command may have only some flags
    user_set = {name: value for name, value in user_set.items() if value is not None}
    try:
        params = (generation_config or GenerationConfig()).sampling_params(**user_set)
    except ValueError as e:  # "top_p must be ..." -> "--top-p must be ...": name the flag the user typed
        name, rest = str(e).split(" ", 1)
        raise UsageError(f"--{name.replace('_', '-')} {rest}") from None
    ignored = [f"--{name.replace('_', '-')}" for name in _SAMPLE_ONLY_FLAGS if name in user_set]
    if generation_config is not None and params.greedy and ignored:
        print(f"minillm: warning: {', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect: "
              f"temperature {params.temperature:g} is greedy decoding; set --temperature > 0 to sample",
              file=sys.stderr)
    return params


def thread_governor(model) -> cpu_policy.ThreadGovernor | None:
    """The command's thread governor for a model on the CPU (minillm/cpu_policy.py: fewer threads while
    other processes keep cores busy); None on a GPU, outside the minillm command, or where the user set the
    count. Its owner calls ``adjust()`` between steps, from the thread that runs the model."""
    return cpu_policy.command_governor() if next(model.parameters()).device.type == "cpu" else None


def busy_note_now(group=None) -> str | None:
    """The note "machine busy: load X on N cores" when the 1-minute load average, read now at the end of
    a run, exceeded the cores this process may use: other processes took CPU time from it
    (:func:`minillm.cpu_policy.busy_note`); None otherwise. With a tensor-parallel ``group``: the cores of
    all its ranks together (``group.cores``), not rank 0's one."""
    cores = group.cores if group is not None and group.cores else cpu_policy.usable_cores()
    return cpu_policy.busy_note(cpu_policy.load_average(), cores)


def keep_freed_memory_in_command() -> None:
    """The serving commands' allocator settings (minillm/malloc_policy.py: freed memory kept, the kernel caches
    bounded, the KV pools in 2 MiB pages), in the ``minillm`` command's own process only: a program (or a test)
    that calls :func:`minillm.cli.main` keeps its allocator."""
    if not cpu_policy.started_as_command():
        return
    malloc_policy.bound_kernel_caches()
    malloc_policy.use_huge_pages_for_pools()
    if (why := malloc_policy.keep_freed_memory()) and "refused" in why:
        warn(f"{why}: each step's large tensors will fault their pages in again (slower, not wrong)")


def default_token_budget(model) -> int:
    """Tokens an engine step takes when --max-num-batched-tokens is not given (serve, bench-serving): 2048 for a
    bfloat16 model (vLLM's CPU server default, vllm/engine/arg_utils.py), 512 otherwise. Measured (SmolLM2-135M,
    the issue-32 workload, 2 threads, 2026-12-05): bfloat16 at 2048 against 512 gave 302-325 against 288-296 output
    tok/s, a better TTFT p50 and TPOT p50 (its big chunks' products and attention run on the matrix units); 1,024
    and 4,096 a worse TTFT p50; float32 the same tok/s and a 15 % worse TTFT p50."""
    import torch

    return 2048 if model.embed.weight.dtype == torch.bfloat16 else 512
