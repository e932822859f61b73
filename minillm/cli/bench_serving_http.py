"""minillm bench-serving --base-url URL: the serving workload sent to a server, timed on the client.

The options, workload and tables are bench-serving's; only where the requests go differs
(:mod:`minillm.bench.http_client`). Against a server with ``/metrics`` the server's own
TTFT / ITL / e2e are printed next to the client's.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from . import bench_serving_shared as shared
from .common import UsageError, wrote

DEFAULT_TIMEOUT_S = 1800.0
IN_PROCESS_ONLY = ("plots", "trace_out", "threads", "device", "dtype")  # options that need the model here


def add_http_options(p) -> None:
    p.add_argument("--base-url", metavar="URL",
                   help="send the workload to this OpenAI-compatible server (minillm serve, vLLM) instead of "
                        "running the policies here: streaming /v1/completions with token-id prompts, latencies "
                        "taken on the client, the server's own from its /metrics. --model is then the name sent "
                        "(default: the server's first, GET /v1/models); the prompts' token ids are drawn from "
                        "--tokenizer's vocabulary, by default that model's local tokenizer (a minillm model name or "
                        "folder; download it first). The engine options (--policies, --max-num-seqs, "
                        "--max-num-batched-tokens, --kv-cache-memory, --block-size) are then the server's own")
    p.add_argument("--tokenizer", metavar="MODEL", help="with --base-url: the minillm model name or folder whose "
                                                        "tokenizer gives the prompts' ids (default: the served model)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), metavar="KEY",
                   help="with --base-url: the server's API key (default: $OPENAI_API_KEY, as the openai client)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="with --base-url: each rate's run is cut after this many seconds (unfinished requests "
                        "count as failed)")


def run_over_http(args, rates: list[float]) -> int:
    """Every rate's workload sent to ``args.base_url``; prints the tables, writes --json."""
    from rich.console import Console

    from ..bench.http_client import run_http_bench, served_model
    from ..bench.workload import describe

    _check_http_args(args)
    base_url = args.base_url.rstrip("/").removesuffix("/v1")  # the openai client's base_url works too
    try:
        model = args.model or served_model(base_url, api_key=args.api_key)
    except ValueError as e:
        raise UsageError(f"--base-url: {e}") from None
    tokenizer = _local_tokenizer(args, model)
    workloads = shared.workloads(args, rates, tokenizer.vocab_size, tokenizer)
    shape = describe(next(iter(workloads.values())))
    args.long_prompt_len = 0  # the chunked-prefill experiment runs in-process only
    loadavg_before = list(os.getloadavg())
    runs = []
    with shared.progress_bar(args, sum(len(w) for w in workloads.values())) as advance:
        for rate, workload in workloads.items():
            def progress(n_done: int, n_requests: int) -> None:
                advance.request("http", rate, n_done, n_requests)

            try:
                runs.append((rate, run_http_bench(base_url, workload, model, args.ttft_slo_ms, args.tpot_slo_ms,
                                                  args.timeout, progress, api_key=args.api_key)))
            except ValueError as e:  # the warm-up request failed: every request would
                raise UsageError(f"--base-url: {e}") from None
    out = Console(highlight=False) if sys.stdout.isatty() else Console(width=160, highlight=False)
    _print_http(out, args, runs, shape["n_requests"])
    out.print(f"[dim]client here ({os.cpu_count()} CPUs), server {base_url}, model {model}; load average "
              f"(1/5/15 min) {_load(loadavg_before)} before, {_load(os.getloadavg())} after the runs[/dim]")
    if args.json:
        _write_json(args, runs, shape, model, loadavg_before)
    return 0


def _check_http_args(args) -> None:
    if not args.base_url.startswith(("http://", "https://")):
        raise UsageError(f"--base-url {args.base_url!r}: give a URL like http://127.0.0.1:8000")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise UsageError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    given = [f"--{name.replace('_', '-')}" for name in IN_PROCESS_ONLY if getattr(args, name, None)]
    if given:
        raise UsageError(f"{', '.join(given)} need the model in this process; drop them with --base-url")


def _local_tokenizer(args, model: str):
    """The tokenizer of --tokenizer, else of the served model's name when it is a local minillm model."""
    from ..errors import MiniLLMError
    from ..tokenizer import load_tokenizer
    from ..formats.weights import resolve_model

    name = args.tokenizer or model
    try:
        return load_tokenizer(resolve_model(name, args.weights_dir, download=False))
    except (MiniLLMError, OSError, ValueError) as e:
        fix = "check --tokenizer" if args.tokenizer else ("give --tokenizer MODEL (a minillm model name or folder "
                                                           "with the server's vocabulary)")
        raise UsageError(f"no local tokenizer for {name!r} to draw the prompts' token ids ({e}); {fix}") from None


def _print_http(out, args, runs, n_requests: int) -> None:
    shared.print_summaries(out, [(rate, "http", r.summary) for rate, r in runs], n_requests, args.ttft_slo_ms,
                     args.tpot_slo_ms, last_column=("failed", "n_aborted"))
    for rate, r in runs:
        out.print(f"@ {_rate(rate)}:")
        for note in _notes(r):
            out.print(f"- {note}")
        if r.server is not None and r.server.latencies:
            out.print(_client_vs_server(r, rate))
            out.print("gap = client - server mean: HTTP, JSON, detokenization and queueing outside the engine. "
                      "The server's means are exact; its p50/p90/p99 are estimated from its /metrics buckets "
                      "(Prometheus histogram_quantile), only as fine as the buckets, so they get no gap.")


def _notes(r) -> list[str]:
    """Failures, lateness, token counts, what the server counted against what the client saw."""
    s = r.summary
    notes = [f"{r.n_failed} of {s.n_requests} requests failed" + (
        ": " + ", ".join(f"{msg} (x{n})" for msg, n in r.errors.items()) if r.errors else "")]
    if s.p99_queue_ms is not None:
        notes.append(f"requests sent p99 {shared.ms(s.p99_queue_ms)} ms after their arrival time (the client's own delay, "
                     "inside TTFT)")
    if r.n_count_mismatch:
        notes.append(f"{_requests(r.n_count_mismatch)} streamed a different token count than the usage says "
                     "(text held back; the usage's count is used)")
    if r.n_short:
        notes.append(f"{_requests(r.n_short)} ended before max_tokens (does the server ignore ignore_eos?)")
    if s.total_cached_tokens:
        notes.append(f"the server's prefix cache served {s.total_cached_tokens} of {s.total_input_tokens} prompt "
                     "tokens (prompts sent before, e.g. at an earlier rate; the in-process policies run without "
                     "prefix caching)")
    if r.n_without_usage:
        notes.append(f"{r.n_without_usage} requests had no usage (tokens counted from chunks)")
    counters = r.server.counters if r.server is not None else {}
    if "generation_tokens_total" in counters:
        notes.append(f"server counted {counters['generation_tokens_total']:.0f} output tokens, "
                     f"the client {s.total_output_tokens}")
    if r.server_note:
        notes.append(r.server_note)
    return notes


def _client_vs_server(r, rate):
    """TTFT / ITL / e2e on each side, a row per statistic: the client's exact, the server's means exact
    and its percentiles estimated from its histogram buckets."""
    from rich import box
    from rich.table import Table

    table = Table("latency", "stat", "client", "server", "gap", box=box.SIMPLE_HEAD,
                  title=f"Client vs server (ms) @ {_rate(rate)}")
    for key, name in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "e2e")):
        server = r.server.stats_ms(key)
        for stat in ("mean", "p50", "p90", "p99"):
            client, theirs = getattr(r.summary, f"{stat}_{key}_ms"), server.get(stat)
            # a gap only of means: the server's percentiles are bucket estimates (see the note below)
            gap = None if client is None or theirs is None or stat != "mean" else client - theirs
            table.add_row(name if stat == "mean" else "", stat, shared.ms(client), shared.ms(theirs), shared.ms(gap))
    return table


def _rate(rate: float) -> str:
    return "inf (offline)" if math.isinf(rate) else f"{rate:g} req/s"


def _load(values) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def _write_json(args, runs, workload: dict, model: str, loadavg_before) -> None:
    import json

    doc = {"base_url": args.base_url, "model": model, "workload": workload,
           "config": {"ttft_slo_ms": args.ttft_slo_ms, "tpot_slo_ms": args.tpot_slo_ms, "timeout_s": args.timeout,
                      "seed": args.seed},
           "machine": {"client_cpu_count": os.cpu_count(), "loadavg_before": loadavg_before,
                       "loadavg_after": list(os.getloadavg())},
           "runs": [{"policy": "http", "rate_req_s": "inf" if math.isinf(rate) else rate, **r.to_dict()}
                    for rate, r in runs]}  # policy, rate_req_s, summary: as the in-process runs
    Path(args.json).write_text(json.dumps(doc, indent=1))
    wrote(args.json)


def _requests(n: int) -> str:
    return f"{n} request" if n == 1 else f"{n} requests"
