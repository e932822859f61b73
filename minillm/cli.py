"""The ``minillm`` command line: argument parsing and rendering only; the work is in the library.

    minillm generate "What is the capital of France?"     stream an answer
    minillm download NAME                                  fetch a model into the weights dir
    minillm convert FILE.gguf OUT_DIR                      GGUF -> Hugging Face folder
    minillm info [MODEL]                                   config, parameters, bytes

Exit codes: 0 ok, 1 runtime error (one line), 2 usage error (one line), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import weights
from .errors import MiniLLMError


class UsageError(Exception):
    """Bad command-line usage: one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the whole usage block; one line is kinder
        raise UsageError(f"{message} (see '{self.prog} --help')")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``minillm`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return args.run(args) or 0
    except UsageError as e:
        print(f"minillm: error: {e}", file=sys.stderr)
        return 2
    except (MiniLLMError, ValueError, OSError) as e:
        if debug:
            raise
        print(f"minillm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minillm", description="An educational LLM inference engine in pure PyTorch.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_download(sub)
    _add_convert(sub)
    _add_info(sub)
    return parser


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=weights.DEFAULT_MODEL,
                   help=f"model name, hub repo id, folder or .gguf file (default: {weights.DEFAULT_MODEL})")
    p.add_argument("--weights-dir", help="where models are stored (default: $MINILLM_WEIGHTS, ./weights, ~/.cache/minillm)")
    p.add_argument("--device", help="cpu, cuda or mps (default: cuda if available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default float32 (bfloat16 on cuda)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")


# -- generate ----------------------------------------------------------------------------


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streamed token by token")
    p.add_argument("prompt", nargs="?", help="the prompt; '-' or omitted reads stdin")
    _model_options(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int)
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt in the model's chat template (default when it has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as raw text")
    p.add_argument("--system", help="system message (chat mode)")
    p.set_defaults(run=run_generate)


def run_generate(args) -> int:
    from .generate import generate
    from .loading import load_model
    from .sampling import SamplingParams
    from .tokenizer import StreamDecoder, load_tokenizer

    params = _sampling_params(args)
    prompt = _read_prompt(args.prompt)
    folder = _ensure_model(args.model, args.weights_dir)
    model = load_model(folder, device=args.device, dtype=args.dtype)
    tokenizer = load_tokenizer(folder)

    start = time.perf_counter()
    prompt_ids = _encode_prompt(tokenizer, prompt, args.chat, args.system)
    eos = tokenizer.eos_token_ids | set(model.config.eos_token_ids)
    stream = StreamDecoder(tokenizer)
    steps = []
    for step in generate(model, prompt_ids, params, eos_token_ids=eos):
        steps.append(step)
        print(stream.push(step.token_id), end="", flush=True)
    print(stream.flush())
    print(_summary(len(prompt_ids), steps, start), file=sys.stderr)
    return 0


def _sampling_params(args):
    from .sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, max_new_tokens=args.max_new_tokens)
    except ValueError as e:
        raise UsageError(str(e).replace("_", "-", 1)) from None


def _read_prompt(prompt: str | None) -> str:
    if prompt in (None, "-"):
        if prompt is None and sys.stdin.isatty():
            raise UsageError("give a prompt, or pipe one in on stdin (see 'minillm generate --help')")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    return prompt


def _ensure_model(name_or_path: str, weights_dir: str | None):
    """The model folder; a missing known model is downloaded first, with a notice."""
    if weights.is_model_name(name_or_path) and not weights.is_downloaded(name_or_path, weights_dir):
        print(f"minillm: {name_or_path} is not downloaded yet; fetching it into "
              f"{weights.weights_dir(weights_dir)} (once)", file=sys.stderr)
    return weights.resolve_model(name_or_path, weights_dir, download=True)


def _encode_prompt(tokenizer, prompt: str, chat: bool | None, system: str | None) -> list[int]:
    if chat is None:
        chat = tokenizer.has_chat_template
    if not chat:
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def _summary(n_prompt: int, steps, start: float) -> str:
    ttft_ms = (steps[0].time_s - start) * 1e3
    e2e_s = steps[-1].time_s - start
    tpot = f"{(steps[-1].time_s - steps[0].time_s) * 1e3 / (len(steps) - 1):.1f} ms" if len(steps) > 1 else "n/a"
    return (f"[prompt {n_prompt} tok | generated {len(steps)} tok | TTFT {ttft_ms:.1f} ms | TPOT {tpot} | "
            f"{len(steps) / e2e_s:.1f} tok/s | stop: {steps[-1].finish_reason}]")


# -- download, convert, info ----------------------------------------------------------------


def _add_download(sub) -> None:
    p = sub.add_parser("download", help="fetch a model into the weights directory")
    p.add_argument("name", nargs="?", default=weights.DEFAULT_MODEL,
                   help=f"{weights.DEFAULT_MODEL} or a Hugging Face repo id such as gpt2")
    p.add_argument("--weights-dir")
    p.add_argument("--debug", action="store_true")
    p.set_defaults(run=lambda args: print(weights.download(args.name, args.weights_dir)))


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face model folder")
    p.add_argument("gguf_file")
    p.add_argument("out_dir")
    p.add_argument("--debug", action="store_true")

    def run(args):
        from .gguf_convert import convert_gguf

        print(convert_gguf(args.gguf_file, args.out_dir))

    p.set_defaults(run=run)


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="show a model's config, parameter count and memory")
    p.add_argument("model", nargs="?", default=weights.DEFAULT_MODEL)
    p.add_argument("--weights-dir")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--debug", action="store_true")
    p.set_defaults(run=run_info)


def run_info(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .loading import load_model

    model = load_model(_ensure_model(args.model, args.weights_dir), device="cpu", dtype=args.dtype)
    c = model.config
    dtype_bytes = next(model.parameters()).element_size()
    table = Table(title=f"{args.model} ({args.dtype})", show_header=False)
    rows = [
        ("model_type", c.model_type), ("layers", c.n_layers), ("d_model", c.d_model),
        ("heads / KV heads", f"{c.n_heads} / {c.n_kv_heads} (GQA x{c.n_rep})" if c.n_rep > 1 else c.n_heads),
        ("head_dim", c.head_dim), ("d_mlp", c.d_mlp), ("vocab", c.vocab_size), ("context", c.max_seq_len),
        ("positions", f"RoPE theta={c.rope_theta:g}" if c.uses_rope else "learned"),
        ("tied embeddings", c.tie_word_embeddings),
        ("parameters", f"{model.num_parameters():,}"),
        ("weights bytes", f"{model.weights_bytes():,} ({model.weights_bytes() / 2**20:.1f} MiB)"),
        ("KV bytes per token", f"{c.kv_bytes_per_token(dtype_bytes):,} (2 x {c.n_layers} x {c.n_kv_heads} x "
                               f"{c.head_dim} x {dtype_bytes})"),
    ]
    for key, value in rows:
        table.add_row(key, str(value))
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
