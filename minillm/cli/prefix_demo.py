"""minillm prefix-demo: requests sharing a long system prompt, with and without the prefix cache."""

from __future__ import annotations

from ..units import fmt_bytes
from .common import UsageError, check_out_file, ensure_model, model_options, wrote


def add_prefix_demo(sub) -> None:
    p = sub.add_parser("prefix-demo", help="N requests sharing a long system prompt, with and without the prefix cache")
    model_options(p)
    p.add_argument("--requests", type=int, default=4, help="number of requests (default 4)")
    p.add_argument("--block-size", type=int, default=16, help="prefix cache block size in tokens (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    p.add_argument("--plot", metavar="FILE.png", help="draw TTFT per request, without and with the cache (default: none)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")
    p.set_defaults(run=run_prefix_demo_cmd)


def run_prefix_demo_cmd(args) -> int:
    if args.plot:
        check_out_file("--plot", args.plot, ".png")
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from ..loading import load_model
    from ..prefix_demo import plot_prefix_demo, run_prefix_demo
    from ..tokenizer import load_tokenizer

    if min(args.requests, args.block_size, args.max_new_tokens) < 1:
        raise UsageError("--requests, --block-size and --max-new-tokens must be >= 1")
    folder = ensure_model(args.model, args.weights_dir)
    model = load_model(folder, device=args.device, dtype=args.dtype, quantize=args.quantize, fast=args.fast)
    result = run_prefix_demo(model, load_tokenizer(folder), args.requests, args.block_size, args.max_new_tokens,
                             progress=not args.quiet)
    table = Table("req", "prompt", "cached", "prefill", "TTFT ms\nno cache", "TTFT ms\ncache", "speedup",
                  "KV saved", "hit rate", "same\noutput", box=box.SIMPLE_HEAD, padding=0, show_edge=False,
                  title=f"Prefix cache: {result.shared_prefix_tokens} shared prompt tokens, block_size "
                        f"{result.block_size}")
    for r in result.rows:
        table.add_row(str(r.request), str(r.prompt_tokens), str(r.cached_tokens), str(r.prefill_tokens),
                      f"{r.ttft_no_cache_ms:.0f}", f"{r.ttft_cache_ms:.0f}", f"x{r.speedup:.1f}",
                      fmt_bytes(r.kv_bytes_saved), f"{100 * r.hit_rate:.1f}%", "yes" if r.same_output else "NO")
    console = Console()
    console.print(table)
    s = result.stats
    warm = (f"TTFT x{result.warm_speedup:.1f} faster" if result.warm_rows
            else "n/a (none: the first request fills the cache; use --requests 2 or more)")
    console.print(f"warm requests: {warm} | cache: {s.blocks} blocks, "
                  f"{fmt_bytes(s.bytes)}, hit rate {100 * s.hit_rate:.1f}% ({s.hit_tokens}/{s.query_tokens} "
                  f"tokens), {s.evictions} evictions")
    if args.plot:
        wrote(plot_prefix_demo(result, args.plot))
    return 0
