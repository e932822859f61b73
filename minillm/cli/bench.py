"""minillm bench: prefill and decode speed of minillm, transformers and no cache, against the floors."""

from __future__ import annotations

import sys

from .common import UsageError, check_out_file, ensure_model, model_options, write_text, wrote


def add_bench(sub) -> None:
    from ..bench import ENGINES, OPTIONAL_ENGINES

    p = sub.add_parser("bench", help="prefill and decode speed: minillm vs transformers, no cache, the floors")
    model_options(p)
    p.add_argument("--prompt-lengths", type=int, nargs="+", metavar="N",
                   help="prefill cases, batch 1 (default 128 512 2048)")
    p.add_argument("--context-lengths", type=int, nargs="+", metavar="N",
                   help="decode cases: tokens in the cache (default 128 1024)")
    p.add_argument("--batch-sizes", type=int, nargs="+", metavar="B", help="decode (default 1 8)")
    p.add_argument("--repeats", type=int, help="runs per case and engine, medians reported (default 3)")
    p.add_argument("--decode-tokens", type=int, help="tokens per decode run (default 16)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES + OPTIONAL_ENGINES),
                   metavar="ENGINE", help=f"which engines to run, each once (default: {' '.join(ENGINES)}; "
                                          "also minillm-compile, and llama.cpp with llama-cpp-python installed: "
                                          "the same weights as an F32 GGUF, batch 1)")
    p.add_argument("--compile", nargs="?", const="auto", metavar="MODE",
                   help="add minillm-compile: torch.compile of decode_step (mode default on cpu, "
                        "reduce-overhead = CUDA graphs on cuda)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--memory-tokens", type=int,
                   help="peak RSS of generating this many tokens, in a fresh process (0: skip; default 1024)")
    p.add_argument("--json", metavar="FILE", help="write every number as JSON (default: not written)")
    p.add_argument("--plot", metavar="FILE.png", help="tok/s against length per engine, floors drawn (default: none)")
    p.add_argument("--markdown", metavar="FILE.md", help="write the tables as markdown (default: not written)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: prompts 32 128, context 64, batch 1, 1 repeat, 8 tokens, memory 64 tokens "
                        "(options given explicitly still apply)")
    p.set_defaults(run=run_bench_cmd)


BENCH_DEFAULTS = dict(prompt_lengths=[128, 512, 2048], context_lengths=[128, 1024], batch_sizes=[1, 8],
                      repeats=3, decode_tokens=16, memory_tokens=1024)
BENCH_QUICK = dict(prompt_lengths=[32, 128], context_lengths=[64], batch_sizes=[1],
                   repeats=1, decode_tokens=8, memory_tokens=64)


def run_bench_cmd(args) -> int:
    import torch
    from rich.console import Console

    from ..bench import rich_table, run_bench, targets_rich_table, to_json, to_markdown, validate_bench
    from ..loading import load_model

    for name, value in (BENCH_QUICK if args.quick else BENCH_DEFAULTS).items():
        if getattr(args, name) is None:  # an option given explicitly wins over the preset
            setattr(args, name, value)
    _check_bench_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(ensure_model(args.model, args.weights_dir), device=args.device, dtype=args.dtype, quantize=args.quantize, fast=args.fast)
    try:  # lengths against the model's context: before any work
        validate_bench(model, args.prompt_lengths, args.context_lengths, args.batch_sizes, args.repeats,
                       args.decode_tokens, args.memory_tokens)
    except ValueError as e:
        raise UsageError(str(e)) from None
    compile_mode = None
    if args.compile:
        on_cuda = next(model.parameters()).device.type == "cuda"
        compile_mode = ("reduce-overhead" if on_cuda else "default") if args.compile == "auto" else args.compile
    console = Console(stderr=True)
    result = run_bench(model, args.prompt_lengths, args.context_lengths, args.batch_sizes, args.repeats,
                       args.decode_tokens, args.engines, compile_mode, memory_tokens=args.memory_tokens,
                       model_name=str(args.model), progress=lambda line: console.print(f"bench: {line}", style="dim", markup=False))
    out = Console() if sys.stdout.isatty() else Console(width=180)  # piped: don't wrap the 11 columns
    out.print(rich_table(result))
    if targets := targets_rich_table(result):
        out.print(targets)
    print_notes(out, result.notes + ([_memory_note(result.memory)] if result.memory else []))
    for flag, write in (("json", lambda path: to_json(result, path)),
                        ("markdown", lambda path: write_text(path, to_markdown(result)))):
        if getattr(args, flag):
            wrote(write(getattr(args, flag)))
    if args.plot:
        from ..bench import plot

        wrote(plot(result, args.plot))
    return 0


COMPILE_MODES = ("auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _check_bench_args(args) -> None:
    """One-line usage errors for the bench's options, before the model loads."""
    for flag, value, least in (("--repeats", args.repeats, 1), ("--batch-sizes", min(args.batch_sizes), 1),
                               ("--decode-tokens", args.decode_tokens, 2), ("--memory-tokens", args.memory_tokens, 0)):
        if value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.compile and args.compile not in COMPILE_MODES:
        raise UsageError(f"--compile: unknown mode {args.compile!r}; use one of {', '.join(COMPILE_MODES[1:])}")
    twice = sorted({e for e in args.engines if args.engines.count(e) > 1})
    if twice:
        raise UsageError(f"--engines lists {', '.join(twice)} more than once; name each engine once")
    for flag in ("json", "markdown", "plot"):
        if getattr(args, flag):
            check_out_file(f"--{flag}", getattr(args, flag), ".png" if flag == "plot" else None)


def _memory_note(memory) -> str:
    from ..bench import memory_line

    return memory_line(memory)


def print_notes(out: Console, notes: list[str]) -> None:
    """The notes as a list, printed as written: with rich's markup on, an extra's name in brackets
    ("minillm[llamacpp]") was taken for a style tag and vanished."""
    for note in notes:
        out.print(f"- {note}", markup=False)
