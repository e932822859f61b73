"""minillm sweep: TTFT against prompt length and TPOT against context length, measured and plotted."""

from __future__ import annotations

from .common import UsageError, check_out_dir, ensure_model, model_options, wrote


def add_sweep(sub) -> None:
    from ..sweep import DEFAULT_CONTEXT_LENGTHS, DEFAULT_PROMPT_LENGTHS

    p = sub.add_parser("sweep", help="measure TTFT vs prompt length and TPOT vs context length; write PNGs")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the PNGs, sweep.json and sweep.csv")
    model_options(p)
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=list(DEFAULT_PROMPT_LENGTHS), metavar="N",
                   help="prefill cases (tokens)")
    p.add_argument("--context-lengths", type=int, nargs="+", default=list(DEFAULT_CONTEXT_LENGTHS), metavar="N",
                   help="decode cases: tokens in the KV cache")
    p.add_argument("--repeats", type=int, default=3, help="prefills per prompt length (median)")
    p.add_argument("--decode-steps", type=int, default=3, help="decode steps per context length (median)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")
    p.set_defaults(run=run_sweep)


def run_sweep(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..hardware import get_hardware
    from ..loading import load_model
    from ..views.plots import save_sweep_plots
    from ..sweep import sweep

    if min(args.repeats, args.decode_steps) < 1:
        raise UsageError("--repeats and --decode-steps must be >= 1")
    check_out_dir("--out", args.out)
    model = load_model(ensure_model(args.model, args.weights_dir), device=args.device, dtype=args.dtype, quantize=args.quantize, fast=args.fast)
    param = next(model.parameters())
    hw = get_hardware(param.device, param.dtype)
    result = sweep(model, args.prompt_lengths, args.context_lengths, args.repeats, args.decode_steps, hw,
                   name=str(args.model), progress=not args.quiet)
    paths = save_sweep_plots(result, args.out)
    table = Table("measurement", "tokens", "ms", "roofline floor ms", title=f"sweep of {args.model} on {hw.name}")
    for name, lengths, ms, floors in (("TTFT", result.prompt_lengths, result.ttft_ms, result.ttft_floor_ms),
                                      ("TPOT", result.context_lengths, result.tpot_ms, result.tpot_floor_ms)):
        for n, t, f in zip(lengths, ms, floors):
            table.add_row(name, str(n), f"{t:.1f}", f"{f:.1f}")
    console = Console()
    console.print(table)
    wrote(", ".join(str(p) for p in paths))
    return 0
