"""minillm generate: the answer streamed to stdout; with --trace, every phase of the request."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

from ..units import fmt_bytes
from .common import (UsageError, busy_note_now, chat_template_kwargs, check_out_dir, check_out_file, ensure_model,
                     model_options, sampling_options, sampling_params, thinking_option, thread_governor, warn,
                     warn_if_template_ignores_thinking, wrote)
from .structured import add_structured_options, check_structured_args, constrain
from .tensor_parallel import run_tensor_parallel, tensor_parallel_option, tensor_parallel_size


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streamed token by token")
    p.add_argument("prompt", nargs="*", help="the prompt; '-' or omitted reads stdin; several prompts "
                                              "run one after another (sharing a --prefix-cache)")
    model_options(p)
    sampling_options(p)
    add_structured_options(p)
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the model's chat template (default when it has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as raw text")
    p.add_argument("--system", help="system message (chat mode); --system \"\" sends an empty one "
                                     "(default: none, so the template may add its own, e.g. SmolLM2's persona)")
    thinking_option(p)
    p.add_argument("--trace", nargs="?", const="steps", action=_TraceLevel, metavar="{steps,layers}",
                   help="show every phase: prompt tokens, prefill, each step, summary, roofline verdicts "
                        "(layers: also per-layer shapes and times; default: off, steps when given alone)")
    p.add_argument("--trace-out", metavar="FILE.jsonl|FILE.json",
                   help="write the trace: .jsonl one JSON event a line (schema: pydoc minillm.trace), .json a "
                        "Chrome trace to open in ui.perfetto.dev or chrome://tracing (default: not written)")
    p.add_argument("--plots", metavar="DIR", help="write timeline, roofline and KV cache PNGs into DIR "
                                                  "(traces the request; default: none)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction,
                   help="one untimed prefill + decode pass before the first request, so its TTFT leaves out "
                        "one-time setup costs (default: on with --trace/--trace-out/--plots, off otherwise: "
                        "the summary then says 'cold')")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt on stdout: text, finish_reason, usage, metrics "
                        "(instead of the streamed answer)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="reuse the K/V of prompt prefixes seen before in this run (automatic prefix caching)")
    p.add_argument("--block-size", type=int, help="prefix cache block size in tokens (default: 16)")
    _speculative_options(p)
    tensor_parallel_option(p, "reads the prompt and prints")
    p.add_argument("--student-dir", metavar="DIR",
                   help="the classroom's assembled engine: run the lesson's plain PyTorch model with the exercises "
                        "of DIR (mask, attention, RoPE, KV cache, prefill, decode, sampling, generate loop) swapped "
                        "in where written, and compare tokens and logits with minillm's own; exit 0 when equal, 1 "
                        f"when not (default prompt: {DEFAULT_STUDENT_PROMPT!r}, --max-new-tokens "
                        f"{STUDENT_MAX_NEW_TOKENS})")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="with --student-dir: stop (exit 1) when importing one of DIR's files or running one piece "
                        "takes over SECONDS, and your engine's run over SECONDS more than minillm's (an endless "
                        "loop); default: minillm check's, 60")
    p.set_defaults(run=run_generate)


DEFAULT_STUDENT_PROMPT = "What is the capital of France?"  # --student-dir's, and minillm check's engine run
STUDENT_MAX_NEW_TOKENS = 16


def _speculative_options(p) -> None:
    """SpeculativeConfig's knobs (vLLM's speculative_config names, as flags)."""
    g = p.add_argument_group("speculative decoding (minillm/speculative.py)")
    g.add_argument("--speculative", choices=["ngram", "draft_model"],
                   help="a draft proposes tokens, the model verifies several per pass: ngram (prompt lookup, "
                        "no second model) or draft_model (--draft-model); same greedy output (default: off)")
    g.add_argument("--num-speculative-tokens", type=int, help="tokens proposed per verification pass (default: 5)")
    g.add_argument("--draft-model", metavar="MODEL", help="the draft for --speculative draft_model: a smaller "
                                                          "model with the same tokenizer (default: none)")
    g.add_argument("--prompt-lookup-min", type=int, help="shortest n-gram match that proposes drafts (ngram; default: 2)")
    g.add_argument("--prompt-lookup-max", type=int, help="longest n-gram tried first (ngram; default: 3)")


class _TraceLevel(argparse.Action):
    """--trace [steps|layers]; a word after it that is no level is a prompt: `generate --trace "Hello"` traces
    "Hello" (it was "invalid choice")."""

    def __call__(self, parser, namespace, value, option_string=None):
        if value not in ("steps", "layers"):
            if getattr(namespace, "prompt", None):  # the prompts given before --trace are already read
                namespace.prompt.append(value)
            else:
                namespace.prompts_after_trace = [*getattr(namespace, "prompts_after_trace", []), value]
            value = "steps"
        setattr(namespace, self.dest, value)


def run_generate(args) -> int:
    args.prompt = [*getattr(args, "prompts_after_trace", []), *args.prompt]
    sampling_params(args)  # bad values are usage errors before the model loads
    if args.student_dir is not None:
        return run_student_engine(args)
    _check_generate_args(args)
    check_structured_args(args)
    n = tensor_parallel_size(args, _NOT_WITH_TENSOR_PARALLEL)
    if n > 1 and int(os.environ.get("RANK", 0)) == 0:  # rank 0's prompts read (and checked) before any rank starts
        args.prompts = _read_prompts(args)
    return run_tensor_parallel(args, n, _run_generate) if n > 1 else _run_generate(args)


def _run_generate(args, group=None) -> int:
    """The prompts, one after another, on this process's model; with a tensor-parallel ``group``, rank 0
    runs them and the other ranks follow (minillm/distributed/follow.py), printing nothing."""
    from ..loading import load_model
    from ..prefix_cache import PrefixCache
    from ..tokenizer import load_tokenizer

    leader = group is None or group.rank == 0
    prompts = (getattr(args, "prompts", None) or _read_prompts(args)) if leader else []
    folder = ensure_model(args.model, args.weights_dir)
    model = load_model(folder, device=group.device if group else args.device, dtype=args.dtype,
                       quantize=args.quantize, fast=args.fast and group is None)
    tokenizer = load_tokenizer(folder)
    args.tp_group = group
    if group is not None:
        from ..distributed.follow import follow
        from ..distributed.tensor_parallel import shard_model

        shard_model(model, group)
        if not leader:
            follow(model, group, tokenizer)
            return 0
    warn_if_template_ignores_thinking(args, tokenizer)
    if args.chat and not tokenizer.has_chat_template:
        raise UsageError(f"--chat needs a chat template and {args.model} has none; drop --chat")
    if args.system is not None and args.chat is None and not tokenizer.has_chat_template:
        raise UsageError(f"--system needs a chat template and {args.model} has none; put the text in the prompt")
    params = sampling_params(args, model.generation_config)
    params = constrain(params, args, model, tokenizer, _eos_ids(model, tokenizer))  # --json-schema, --logit-bias ...
    prefix_cache = PrefixCache(model, block_size=args.block_size) if args.prefix_cache else None
    args.speculative_config = _speculative_config(args)
    args.governor = thread_governor(model) if group is None else None  # a rank: one thread on its own core
    traced = bool(args.trace or args.trace_out or args.plots)
    warmup = traced if args.warmup is None else args.warmup
    if not warmup and getattr(getattr(model, "compiled_decode", None), "compiles", False):
        why = "forced by MINILLM_DECODE_PATH" if model.decode_choice.source == "forced" else \
            "kept by minillm calibrate --decode-path"
        warnings.warn(f"decode path {model.decode_path} ({why}): this process compiles its first decode step, "
                      "a minute or more (~10 s with torch's compile cache warm), and that step's time and TPOT "
                      "count it (--warmup compiles it first); MINILLM_DECODE_PATH=replay runs eager",
                      RuntimeWarning)
    for i, prompt in enumerate(prompts):  # one request after another; with --prefix-cache they share cached prefixes
        cold = not warmup and i == 0  # later requests run in a process the first one warmed
        if traced:
            run_generate_traced(args, model, tokenizer, prompt, params, prefix_cache, warmup, cold)
        else:
            _generate_one(args, model, tokenizer, prompt, params, prefix_cache, warmup and i == 0, cold)
    if group is not None:
        from ..distributed.follow import lead

        lead(group, None)  # the followers stop
    return 0


# what a tensor-parallel run cannot do yet (each flag's reason: minillm/cli/tensor_parallel.py)
_NOT_WITH_TENSOR_PARALLEL = ["quantize", "speculative", "prefix_cache", "json_schema", "regex", "choice"]


# flags the assembled engine cannot honour: the exercises' loop has no trace, prefix cache, stop
# strings, penalties or speculation, and its logits are compared in float32
_NOT_WITH_STUDENT_DIR = ["trace", "trace_out", "plots", "json", "prefix_cache", "block_size", "warmup", "speculative",
                         "num_speculative_tokens", "draft_model", "prompt_lookup_min", "prompt_lookup_max", "quantize",
                         "stop", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "json_schema",
                         "regex", "choice", "logit_bias", "tensor_parallel_size"]


def run_student_engine(args) -> int:
    """``minillm generate --student-dir DIR``: the assembled engine against minillm's (minillm/classroom/assembly.py)."""
    from pathlib import Path

    given = [name for name in _NOT_WITH_STUDENT_DIR if getattr(args, name, None) not in (None, False)]
    if given:  # each argument's flag is its name with dashes
        flag = "--" + given[0].replace("_", "-")
        raise UsageError(f"{flag} does not go with --student-dir (the exercises' engine has none); drop it")
    if args.dtype not in (None, "float32"):
        raise UsageError("--student-dir compares float32 logits: drop --dtype")
    if len(args.prompt) > 1:
        raise UsageError("--student-dir takes one prompt")
    if not Path(args.student_dir).is_dir():
        raise UsageError(f"--student-dir {args.student_dir} is not a folder")
    if args.system is not None and args.chat is False:
        raise UsageError("--system needs chat mode: drop --no-chat, or put the text in the prompt")
    if args.temperature and args.seed is None:
        raise UsageError("--student-dir with --temperature > 0 needs --seed: both engines must draw the same numbers")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be a number of seconds > 0, got {args.timeout:g}")
    prompt = _read_prompt(args.prompt[0]) if args.prompt else DEFAULT_STUDENT_PROMPT
    if args.max_new_tokens is None:  # two runs of the lesson's slow engine: the answer, not an essay
        args.max_new_tokens = STUDENT_MAX_NEW_TOKENS
    return assembled_engine(Path(args.student_dir), prompt, args)


def assembled_engine(student_dir, prompt: str, args) -> int:
    """Load the model as the lessons run it, assemble the student's pieces, print the report; 0 when equal."""
    import dataclasses

    from ..classroom.assembly import PieceTimeout, assemble, report_lines
    from ..classroom.grading import DEFAULT_TIMEOUT_S
    from ..loading import load_model
    from ..tokenizer import load_tokenizer

    print(f"prompt: {prompt!r}", flush=True)
    print(f"running minillm's engine, then yours (pieces from {student_dir}) ...", flush=True)
    folder = ensure_model(args.model, args.weights_dir)
    model = load_model(folder, device=args.device, dtype="float32", attn_impl="eager", fast=False)
    tokenizer = load_tokenizer(folder)
    params = sampling_params(args, model.generation_config)
    if not params.greedy and params.seed is None:  # a checkpoint that samples by default: both engines, the same draws
        params = dataclasses.replace(params, seed=0)
    prompt_ids = _encode_prompt(tokenizer, prompt, args)
    timeout = getattr(args, "timeout", None) or DEFAULT_TIMEOUT_S
    try:
        report = assemble(model, prompt_ids, params, _eos_ids(model, tokenizer), student_dir, timeout_s=timeout)
    except PieceTimeout as e:
        print(f"minillm: {e}", file=sys.stderr, flush=True)
        return 1
    for line in report_lines(report, tokenizer.decode, str(student_dir)):
        print(line, flush=True)
    return 0 if report.equal else 1


def _check_generate_args(args) -> None:
    """Contradicting or ignored flags and unwritable outputs: said now, before the model loads."""
    if args.system is not None and args.chat is False:  # dropping it would change the answer unseen
        raise UsageError("--system needs chat mode: drop --no-chat, or put the text in the prompt")
    if args.enable_thinking is not None and args.chat is False:
        raise UsageError("--enable-thinking/--no-enable-thinking is a chat template variable: drop --no-chat")
    if getattr(args, "timeout", None) is not None:
        warn("--timeout is for --student-dir; it has no effect here")
    if args.block_size is not None and not args.prefix_cache:
        warn("--block-size has no effect without --prefix-cache")
    args.block_size = 16 if args.block_size is None else args.block_size
    if args.block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {args.block_size}")
    if args.trace_out:
        check_out_file("--trace-out", args.trace_out)
        if _trace_format(args.trace_out) is None:
            raise UsageError(f"--trace-out: {args.trace_out} must end in .jsonl (one JSON event a line) "
                             "or .json (a Chrome trace for ui.perfetto.dev)")
    if args.plots:
        check_out_dir("--plots", args.plots)
    _check_speculative_args(args)


def _check_speculative_args(args) -> None:
    from ..speculative import SpeculativeConfig

    lookup = (args.prompt_lookup_min, args.prompt_lookup_max)
    if args.speculative is None:
        if args.num_speculative_tokens is not None or args.draft_model is not None or lookup != (None, None):
            raise UsageError("--num-speculative-tokens, --draft-model and --prompt-lookup-min/max need "
                             "--speculative ngram|draft_model")
        return
    if args.speculative != "ngram" and lookup != (None, None):
        raise UsageError("--prompt-lookup-min/max are for --speculative ngram")
    try:  # bad sizes are said now, before the model loads
        SpeculativeConfig("ngram", **_lookup_flags(args))
    except ValueError as e:  # "prompt_lookup_min (4) must be <= ..." -> the flags' names
        raise UsageError(str(e).replace("prompt_lookup_", "--prompt-lookup-")) from None
    if (args.speculative == "draft_model") != (args.draft_model is not None):
        raise UsageError("--speculative draft_model needs --draft-model MODEL, and only it takes one")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        raise UsageError(f"--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
    if args.prefix_cache or args.plots:
        raise UsageError("--speculative does not go with --prefix-cache or --plots yet; drop one")


def _speculative_config(args):
    """The SpeculativeConfig the flags ask for (the draft model loaded), or None."""
    from ..loading import load_model
    from ..speculative import SpeculativeConfig

    if args.speculative is None:
        return None
    draft = None
    if args.draft_model is not None:
        draft = load_model(ensure_model(args.draft_model, args.weights_dir), device=args.device, dtype=args.dtype,
                           quantize=args.quantize, fast=args.fast)  # --quantize applies to every model the command loads
    k = 5 if args.num_speculative_tokens is None else args.num_speculative_tokens
    return SpeculativeConfig(args.speculative, k, draft_model=draft, **_lookup_flags(args))


def _lookup_flags(args) -> dict:
    return {name: getattr(args, name) for name in ("prompt_lookup_min", "prompt_lookup_max")
            if getattr(args, name) is not None}


def _trace_format(path: str) -> str | None:
    """What --trace-out writes, by the file's suffix: "jsonl", "chrome" (.json), or None."""
    return {".jsonl": "jsonl", ".json": "chrome"}.get(Path(path).suffix.lower())


def _generate_one(args, model, tokenizer, prompt: str, params, prefix_cache, warmup: bool, cold: bool) -> None:
    """One request: the answer streamed to stdout (or its JSON record), the summary line to stderr."""
    from ..generate import generate

    _adjust_threads(args, force=True)
    if warmup:
        _warm_up(args, model, len(_encode_prompt(tokenizer, prompt, args)))
    start = time.perf_counter()  # TTFT includes tokenizing, as a server's counts from the request's arrival
    prompt_ids = _encode_prompt(tokenizer, prompt, args)
    prompt_ids, params = _lead_request(args, model, tokenizer, prompt_ids, params)
    steps = []
    for step in generate(model, prompt_ids, params, eos_token_ids=_eos_ids(model, tokenizer),
                         prefix_cache=prefix_cache, tokenizer=tokenizer, speculative=args.speculative_config):
        steps.append(step)
        _adjust_threads(args)
        if not args.json:
            print(step.text, end="", flush=True)  # stop strings held back and never printed
    _finish_request(args, prompt, prompt_ids, steps, start, cold)
    if args.speculative_config is not None:
        print(_speculative_summary(args.speculative_config, steps), file=sys.stderr)


def _warm_up(args, model, n_tokens: int) -> float:
    """The untimed warm-up pass (minillm/sweep.py), run by every rank of a tensor-parallel group; ms."""
    from ..sweep import warm_up

    if getattr(args, "tp_group", None) is not None:
        from ..distributed.follow import lead

        lead(args.tp_group, "warmup", n_tokens)
    return warm_up(model, n_tokens)


def _lead_request(args, model, tokenizer, prompt_ids, params):
    """Tensor parallel: the request sent to the other ranks, with the sampling seed they all use; else unchanged."""
    if getattr(args, "tp_group", None) is None:
        return prompt_ids, params
    from ..distributed.follow import lead

    prompt_ids, params, _ = lead(args.tp_group, "generate", prompt_ids, params, _eos_ids(model, tokenizer))
    return prompt_ids, params


def _recording_collectives(args, trace):
    """Tensor parallel: the group's collectives recorded into ``trace``; else a block that does nothing."""
    from contextlib import nullcontext

    group = getattr(args, "tp_group", None)
    return nullcontext() if group is None else group.recording(trace)


def _speculative_summary(config, steps) -> str:
    """One line: how much of the draft the model kept (vLLM's spec-decode metrics, per request)."""
    from ..speculative import SpeculativeStats

    st = SpeculativeStats.from_steps(steps)
    passes = sum(1 for s in steps if s.proposed is not None)
    return (f"[speculative {config.method} k={config.num_speculative_tokens} | accepted {st.num_accepted_tokens}"
            f"/{st.num_draft_tokens} drafted ({100 * st.acceptance_rate:.1f}%) | mean acceptance length "
            f"{st.mean_acceptance_length:.2f} | {len(steps)} tok in {1 + passes} passes of the model]")


def _finish_request(args, prompt: str, prompt_ids, steps, start_s: float, cold: bool) -> None:
    """After the last token: the answer's newline or its JSON line on stdout, the summary on stderr."""
    from ..metrics import RequestMetrics

    metrics = RequestMetrics.from_timestamps(start_s, [s.time_s for s in steps], len(prompt_ids))
    if args.json:
        print(json.dumps(_json_record(prompt, steps, metrics, cold, args.speculative_config is not None)), flush=True)
    else:
        print(flush=True)
    print(_summary(metrics, steps, cold, busy_note_now(getattr(args, "tp_group", None))), file=sys.stderr)


def _adjust_threads(args, force: bool = False) -> None:
    """Between steps: the governor's decision, when one is due (a clock read otherwise)."""
    if getattr(args, "governor", None) is not None:
        args.governor.adjust(force)


def _eos_ids(model, tokenizer) -> set[int]:
    """The tokenizer's EOS and the checkpoint's (generation_config.json's, else config.json's)."""
    return tokenizer.eos_token_ids | set(model.generation_config.eos_token_ids)


def _read_prompts(args) -> list[str]:
    """The prompt arguments, or stdin's text as the one prompt (:func:`_read_prompt`)."""
    return [_read_prompt(p) for p in args.prompt] or [_read_prompt(None)]


def _read_prompt(prompt: str | None) -> str:
    """The prompt argument, or stdin's text for '-' or none, less the one newline that ends a
    piped line (`echo "..." | minillm generate`, as `$(...)` in a shell drops it)."""
    if prompt in (None, "-"):
        if prompt is None and sys.stdin.isatty():
            raise UsageError("give a prompt, or pipe one in on stdin (see 'minillm generate --help')")
        prompt = sys.stdin.read()
        prompt = prompt.removesuffix("\r\n") if prompt.endswith("\r\n") else prompt.removesuffix("\n")
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    return prompt


def _encode_prompt(tokenizer, prompt: str, args) -> list[int]:
    """The prompt's ids: raw, or (--chat, the default with a template) wrapped in the chat template
    with --system and --enable-thinking."""
    chat = tokenizer.has_chat_template if args.chat is None else args.chat
    if not chat:
        return tokenizer.encode(prompt)
    # system "" is a message too: leaving it out lets templates insert their default persona
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    text = tokenizer.apply_chat_template(system + [{"role": "user", "content": prompt}],
                                         **chat_template_kwargs(args))
    return tokenizer.encode(text, add_special_tokens=False)


def _summary(m, steps, cold: bool, busy: str | None = None) -> str:
    """One line: tokens, TTFT ("cold": no warm-up pass ran before it), TPOT, and two rates named by
    what they measure: decode = 1 / TPOT (as llama.cpp and Ollama print it), output = tokens / e2e;
    ``busy``, the note that the machine was busy (:func:`busy_note_now`), ends it when there is one."""
    cached = f" ({steps[0].cached_tokens} cached)" if steps[0].cached_tokens else ""
    tpot = f"{m.tpot_ms:.1f} ms | decode {1e3 / m.tpot_ms:.1f} tok/s" if m.tpot_ms else "n/a | decode n/a"
    return (f"[prompt {m.n_prompt_tokens} tok{cached} | generated {m.n_output_tokens} tok | "
            f"TTFT {m.ttft_ms:.1f} ms{' (cold)' if cold else ''} | TPOT {tpot} | "
            f"output {m.output_throughput_tok_s:.1f} tok/s | stop: {steps[-1].finish_reason}"
            + (f" | {busy}]" if busy else "]"))


def _json_record(prompt: str, steps, m, cold: bool, speculative: bool = False) -> dict:
    """One request as JSON: usage named as OpenAI's API and vLLM name it, times in ms, rates in tok/s;
    with ``speculative``, also the request's "speculative" counts (vLLM's spec-decode metrics)."""
    record = {
        "prompt": prompt,
        "text": "".join(s.text or "" for s in steps),
        "finish_reason": steps[-1].finish_reason,
        "usage": {"prompt_tokens": m.n_prompt_tokens, "completion_tokens": m.n_output_tokens,
                  "cached_tokens": steps[0].cached_tokens},
        "metrics": {"ttft_ms": m.ttft_ms, "tpot_ms": m.tpot_ms, "e2e_ms": m.e2e_ms,
                    "decode_tok_s": 1e3 / m.tpot_ms if m.tpot_ms else None,
                    "output_tok_s": m.output_throughput_tok_s, "prefill_tok_s": m.prefill_throughput_tok_s,
                    "itl_p50_ms": m.itl_p50_ms, "itl_p99_ms": m.itl_p99_ms, "cold": cold},
    }
    if speculative:
        from ..speculative import SpeculativeStats

        record["speculative"] = SpeculativeStats.from_steps(steps).to_dict()
    return record


def run_generate_traced(args, model, tokenizer, prompt: str, params, prefix_cache=None, warmup: bool = True,
                        cold: bool = False) -> int:
    """generate() with a Trace: the answer streamed to stdout; the prompt's tokens and the trace
    rendered on stderr (so `--trace > answer.txt` keeps just the answer)."""
    from rich.console import Console

    from ..generate import generate
    from ..hardware import get_hardware
    from ..views.terminal import print_trace, prompt_panel
    from ..trace import Trace

    param = next(model.parameters())
    hw = get_hardware(param.device, param.dtype)  # measured once per machine, then cached
    console = Console(stderr=True)
    _adjust_threads(args, force=True)
    warmup_ms = _warm_up(args, model, len(_encode_prompt(tokenizer, prompt, args))) if warmup else None
    trace = Trace(args.trace or "steps", tokenizer=tokenizer, hardware=hw)
    if warmup_ms is not None:
        trace.record("warmup", time_ms=warmup_ms)
    with trace.span("tokenize", text=prompt) as event:
        prompt_ids = _encode_prompt(tokenizer, prompt, args)
    event.update(n_tokens=len(prompt_ids), token_ids=prompt_ids, token_strings=tokenizer.token_strings(prompt_ids))
    if args.trace and prefix_cache is None:  # with a prefix cache: shown after, with the cached tokens marked
        console.print(prompt_panel(trace, plain=console.color_system is None))
    prompt_ids, params = _lead_request(args, model, tokenizer, prompt_ids, params)
    steps = []
    with _recording_collectives(args, trace):  # tensor parallel: an event per all-reduce
        for step in generate(model, prompt_ids, params, eos_token_ids=_eos_ids(model, tokenizer), trace=trace,
                             prefix_cache=prefix_cache, tokenizer=tokenizer, speculative=args.speculative_config):
            steps.append(step)
            _adjust_threads(args)
            if not args.json:
                print(step.text, end="", flush=True)
    if args.trace:
        from ..metrics import RequestMetrics

        metrics = RequestMetrics.from_timestamps(trace.start_s, [s.time_s for s in steps], len(prompt_ids))
        record = _json_record(prompt, steps, metrics, cold, args.speculative_config is not None)
        print(json.dumps(record) if args.json else "", flush=True)
        if prefix_cache is not None:
            console.print(_cached_prompt_panel(trace, prefix_cache))
        print_trace(trace, console, prompt=False)  # its summary panel stands for the summary line
        if args.speculative_config is not None:  # no per-token events under speculation: the lines instead
            print(_summary(metrics, steps, cold, busy_note_now(getattr(args, "tp_group", None))), file=sys.stderr)
            print(_speculative_summary(args.speculative_config, steps), file=sys.stderr)
    else:
        _finish_request(args, prompt, prompt_ids, steps, trace.start_s, cold)
        if args.speculative_config is not None:
            print(_speculative_summary(args.speculative_config, steps), file=sys.stderr)
    if args.trace_out:
        from ..views.chrome_trace import write_trace

        chrome = _trace_format(args.trace_out) == "chrome"
        wrote(write_trace(trace, args.trace_out) if chrome else trace.to_jsonl(args.trace_out))
    if args.plots:
        from ..views.plots import save_trace_plots

        for path in save_trace_plots(trace, args.plots):
            wrote(path)
    return 0


def _cached_prompt_panel(trace, prefix_cache):
    """The prompt with the prefix cache's hit marked, and what the cache did for this request.

    Cached tokens are on green (blocks alternate shades, "|" between blocks); "▶" is where
    the prefill starts. Below: the lookup, hit, insert and evict events, hashes shortened.
    """
    from rich.panel import Panel
    from rich.text import Text

    from ..views.terminal import visible

    B = prefix_cache.block_size
    pieces = trace.first("tokenize")["token_strings"]
    lookup = trace.first("prefix_lookup") or {}
    cached = lookup.get("cached_tokens", 0)
    text = Text()
    for i, piece in enumerate(pieces):
        if i == cached:
            text.append(" ▶ " if i else "▶ ", style="bold")
        elif i and i % B == 0 and i < cached:
            text.append("|", style="bold green")
        text.append(visible(piece), style=("on dark_green", "on green4")[i // B % 2] if i < cached else None)
    text.append("\n")
    for e in trace.events:
        if e["kind"].startswith("prefix_"):
            fields = ", ".join(f"{k}={_brief(v)}" for k, v in e.items() if k not in ("kind", "t_ms"))
            text.append(f"\n{e['kind']:<14}", style="bold")
            text.append(fields)
    title = (f"Prompt: {len(pieces)} tokens, {cached} from the prefix cache ({cached // B} blocks of {B}), "
             f"{len(pieces) - cached} prefilled")
    st = prefix_cache.stats
    subtitle = (f"prefix cache: {st.blocks} blocks, {fmt_bytes(st.bytes)}, hit rate {100 * st.hit_rate:.1f}% "
                f"over {st.requests} requests, {st.evictions} evictions")
    return Panel(text, title=title, title_align="left", subtitle=subtitle)


def _brief(value) -> str:
    """A list of many block hashes as 'first .. last (n)'."""
    if isinstance(value, list) and len(value) > 4:
        return f"[{value[0]} {value[1]} .. {value[-1]}] ({len(value)})"
    return str(value)
