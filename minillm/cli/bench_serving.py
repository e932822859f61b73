"""minillm bench-serving: one workload through every batching policy (vLLM's ``vllm bench serve``, in small)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from ..formats.weights import DEFAULT_MODEL
from . import bench_serving_shared as shared
from .common import (UsageError, check_kv_offload, check_out_dir, check_out_file, default_token_budget, ensure_model,
                     keep_freed_memory_in_command, kv_offload_options, model_options, thread_governor, warn, wrote)

SERVING_DEFAULTS = dict(num_prompts=64, input_len="uniform:32-512", output_len="uniform:16-256",
                        long_prompt_len=1536)  # (the token budget: serve's default for the model, once it loads)
SERVING_QUICK = dict(num_prompts=8, input_len="uniform:16-64", output_len="uniform:8-32",
                     max_num_batched_tokens=64, long_prompt_len=256)
# SLOs for the default model, float32, on a 2-core CPU (BENCHMARKS-HISTORY.md, "Serving"): a
# 512-token prompt alone prefills in about 1 s there and a decode step of 32 rows takes about
# 0.1-0.2 s.
TTFT_SLO_MS, TPOT_SLO_MS = 5000.0, 500.0


def add_bench_serving(sub) -> None:
    from ..bench.serving import ALL_POLICIES, POLICIES
    from .bench_serving_http import add_http_options

    p = sub.add_parser("bench-serving", help="a workload through one-at-a-time, static and continuous batching: "
                                             "throughput, TTFT/TPOT/ITL, SLOs, goodput, KV memory; or sent to a "
                                             "server over HTTP (--base-url)")
    model_options(p)
    add_http_options(p)
    p.set_defaults(model=None)  # None: --model not given (in-process: the default model; over HTTP: the server's)
    p.add_argument("--num-prompts", type=int, help="requests in the workload (default 64; --quick 8)")
    p.add_argument("--request-rate", nargs="+", default=["inf"], metavar="RATE",
                   help="mean Poisson arrival rate(s), requests/s; inf = offline, all at t=0 (default: inf)")
    p.add_argument("--input-len", metavar="SPEC", help="prompt lengths: N, uniform:LO-HI, random:N,RATIO, "
                                                       "normal:MEAN,STD (default uniform:32-512; --quick uniform:16-64)")
    p.add_argument("--output-len", metavar="SPEC", help="output lengths (max_tokens), same forms "
                                                        "(default uniform:16-256; --quick uniform:8-32)")
    p.add_argument("--dataset", metavar="FILE.jsonl", help='real prompts instead: one {"prompt": ..., "max_tokens": ...}'
                                                          " a line (the first --num-prompts; default: random ids)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=ALL_POLICIES, metavar="POLICY",
                   help=f"which policies, in this order (default: {' '.join(POLICIES)}); also disaggregated: a "
                        "prefill and a decode worker process, one core each, the K/V sent between them (lesson 10)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="most requests in a batch, the static batch size too")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="continuous+chunked's token budget per step; continuous uses at least the longest prompt "
                        "+ max-num-seqs (default: serve's, 2048 for a bfloat16 model, 512 otherwise; --quick 64)")
    p.add_argument("--kv-cache-memory", default="512MiB", help="the paged pool: a size (512MiB, 2GiB) or a fraction "
                                                               "of free memory (0.3)")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV block")
    kv_offload_options(p, dir_note="; here each run (policy, rate) has a folder of its own under DIR, so "
                              "runs never hit each other's blocks and a second bench-serving on DIR measures warm "
                              "tiers (--kv-offload-disk-size bounds each run's folder). A tier turns the prefix cache on in the engine "
                              "policies' runs")
    p.add_argument("--ttft-slo-ms", type=float, default=TTFT_SLO_MS, help="TTFT SLO for attainment and goodput (ms)")
    p.add_argument("--tpot-slo-ms", type=float, default=TPOT_SLO_MS, help="TPOT SLO for attainment and goodput (ms)")
    p.add_argument("--long-prompt-len", type=int,
                   help="the chunked-prefill experiment: a prompt this long joins running decodes (0: skip; "
                        "default 1536; --quick 256)")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    p.add_argument("--threads", type=int, help="torch.set_num_threads, fixed for the whole run (default: one thread "
                                               "per core that other processes leave free, re-checked between steps, "
                                               "as generate and serve do: minillm/cpu_policy.py)")
    p.add_argument("--plots", metavar="DIR", help="write serving_rate_sweep.png, serving_timeline.png, "
                                                  "serving_itl.png there (default: none)")
    p.add_argument("--trace-out", metavar="FILE.json", help="Chrome trace of the continuous run (first rate), "
                                                           "for Perfetto (default: none)")
    p.add_argument("--json", metavar="FILE", help="write every number as JSON (default: not written)")
    p.add_argument("--quick", action="store_true", help="a smoke run (under a minute on 2 cores): 8 requests, "
                   "prompts 16-64, outputs 8-32, budget 64, long prompt 256 (options given explicitly still apply)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")
    p.set_defaults(run=run_bench_serving)


def run_bench_serving(args) -> int:
    from rich.console import Console

    from ..loading import load_model
    from ..bench.serving import ServingConfig, run_chunked_prefill_experiment, run_serving_bench

    for name, value in (SERVING_QUICK if args.quick else SERVING_DEFAULTS).items():
        if getattr(args, name) is None:  # an option given explicitly wins over the preset
            setattr(args, name, value)
    rates = _check_args(args)
    if args.base_url:
        from .bench_serving_http import run_over_http

        return run_over_http(args, rates)
    from .bench_serving_http import DEFAULT_TIMEOUT_S

    for name, given in (("--tokenizer", args.tokenizer is not None), ("--timeout", args.timeout != DEFAULT_TIMEOUT_S)):
        if given:
            warn(f"{name} has no effect without --base-url (it is for a run against a server)")
    args.model = args.model or DEFAULT_MODEL  # None only tells run_over_http that --model was not given
    keep_freed_memory_in_command()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    folder = ensure_model(args.model, args.weights_dir)
    model = load_model(folder, device=args.device, dtype=args.dtype, quantize=args.quantize, fast=args.fast)
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = max(default_token_budget(model), args.block_size)
    tokenizer = _tokenizer(folder, required=bool(args.dataset))
    workloads = shared.workloads(args, rates, model.config.vocab_size, tokenizer)
    _check_fits(args, model, next(iter(workloads.values())))
    config = ServingConfig(args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_memory, args.block_size,
                           args.ttft_slo_ms, args.tpot_slo_ms, args.kv_offload_memory, args.kv_offload_dir,
                           args.kv_offload_disk_size)
    token_ids = shared.safe_ids(tokenizer)
    governor = None if args.threads else thread_governor(model)  # fewer threads while other processes are busy
    with shared.progress_bar(args, len(rates) * len(args.policies) * len(next(iter(workloads.values())))) as advance:
        result = run_serving_bench(model, workloads, args.policies, config, progress=advance.request,
                                   before_step=None if governor is None else governor.adjust)
        if args.long_prompt_len:
            result.chunked_prefill = run_chunked_prefill_experiment(
                model, **_experiment_sizes(args), token_ids=token_ids, seed=args.seed, progress=advance.experiment)
    result.machine.update(model=str(args.model), quantize=args.quantize, fast=args.fast,
                          thread_governor=governor is not None)
    # piped: don't wrap; no highlighting: rich would colour parts of numbers such as x3.08
    out = Console(highlight=False) if sys.stdout.isatty() else Console(width=160, highlight=False)
    _print_result(out, result)
    _write_outputs(args, result)
    return 0


# -- options ------------------------------------------------------------------------------------


def _check_args(args) -> list[float]:
    """One-line usage errors before the model loads; returns the rates (math.inf: offline)."""
    from ..serving.paged_cache import parse_memory
    from ..bench.workload import parse_lengths

    for flag, value, least in (("--num-prompts", args.num_prompts, 1), ("--max-num-seqs", args.max_num_seqs, 1),
                               ("--block-size", args.block_size, 1), ("--long-prompt-len", args.long_prompt_len, 0),
                               ("--threads", args.threads, 1), ("--seed", args.seed, 0)):
        if value is not None and value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < args.block_size:
        raise UsageError(f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be at least one block "
                         f"(--block-size {args.block_size})")
    for flag, value in (("--ttft-slo-ms", args.ttft_slo_ms), ("--tpot-slo-ms", args.tpot_slo_ms)):
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(f"{flag} must be a number of milliseconds > 0, got {value}")
    for flag, spec in (("--input-len", args.input_len), ("--output-len", args.output_len)):
        try:
            parse_lengths(spec)
        except ValueError as e:
            raise UsageError(f"{flag}: {e}") from None
    try:
        parse_memory(args.kv_cache_memory, available_bytes=1)
    except ValueError as e:
        raise UsageError(f"--kv-cache-memory: {e}") from None
    check_kv_offload(args)
    twice = sorted({p for p in args.policies if args.policies.count(p) > 1})
    if twice:
        raise UsageError(f"--policies lists {', '.join(twice)} more than once; name each policy once")
    if args.dataset and not Path(args.dataset).is_file():
        raise UsageError(f"--dataset: no file {args.dataset}")
    if args.json:
        check_out_file("--json", args.json)
    if args.trace_out:
        check_out_file("--trace-out", args.trace_out, ".json")
    if args.plots:
        check_out_dir("--plots", args.plots)
    return _rates(args.request_rate)


def _rates(values: list[str]) -> list[float]:
    rates = []
    for text in values:
        try:
            rate = float(text)
        except ValueError:
            rate = math.nan
        if not rate > 0:
            raise UsageError(f"--request-rate: {text!r} is not a rate; give requests/s > 0, or inf (offline)")
        if rate in rates:
            raise UsageError(f"--request-rate lists {text} twice; give each rate once")
        rates.append(rate)
    return rates


def _tokenizer(folder, required: bool):
    from ..tokenizer import load_tokenizer

    try:
        return load_tokenizer(folder)
    except (OSError, ValueError) as e:
        if required:
            raise UsageError(f"--dataset needs the model's tokenizer: {e}") from None
        return None


def _check_fits(args, model, workload) -> None:
    """Usage errors for requests the model's context cannot hold."""
    context = model.config.max_seq_len
    longest = max(len(w.prompt_ids) + w.max_tokens for w in workload)
    if longest > context:
        raise UsageError(f"a request of {longest} tokens (prompt + max_tokens) exceeds the model's context "
                         f"({context}); lower --input-len/--output-len")
    if args.long_prompt_len + 4 > context:
        raise UsageError(f"--long-prompt-len {args.long_prompt_len} (+4 output tokens) exceeds the model's context "
                         f"({context}); lower it or give 0 to skip the experiment")


def _experiment_sizes(args) -> dict:
    if args.quick:
        return dict(n_short=4, short_prompt_len=16, short_output_len=24, long_prompt_len=args.long_prompt_len,
                    chunk_budget=args.max_num_batched_tokens, join_after=4)
    return dict(n_short=8, short_prompt_len=32, short_output_len=64, long_prompt_len=args.long_prompt_len,
                chunk_budget=args.max_num_batched_tokens, join_after=8)


# -- output -------------------------------------------------------------------------------------


def _print_result(out, result) -> None:
    from ..units import fmt_bytes, fmt_num

    cfg = result.config
    shared.print_summaries(out, [(run.rate_req_s, run.policy, run.summary) for run in result.runs],
                     result.workload["n_requests"], cfg.ttft_slo_ms, cfg.tpot_slo_ms)
    _print_ratios(out, result)
    kv = [r for r in result.runs if r.kv_memory is not None]
    if kv:
        out.print("KV memory at the pool's peak (paged blocks vs the K/V the requests held then vs one "
                  "max_seq_len KVCache per running request; target paged <= 1.25x held):")
    for run in kv:
        m = run.kv_memory
        out.print(f"- {run.policy} @ {shared.rate_text(run.rate_req_s)}: paged {fmt_bytes(m.paged_bytes)} "
                  f"({m.num_blocks_used} blocks) vs held {fmt_bytes(m.held_bytes)} ({m.held_tokens} tokens): "
                  f"x{m.paged_over_held:.3f}; {m.num_running} x KVCache({m.max_seq_len}) = "
                  f"{fmt_bytes(m.max_seq_len_bytes)}; pool {fmt_bytes(m.pool_bytes)}")
    if (c := result.chunked_prefill) is not None:
        out.print(f"Chunked prefill: {c.n_short} requests decoding, then a {c.long_prompt_len}-token prompt arrives: "
                  f"p99 ITL {fmt_num(c.p99_itl_ms['no chunking'])} ms without chunking (budget "
                  f"{c.budgets['no chunking']}), {fmt_num(c.p99_itl_ms['chunked'])} ms chunked (budget "
                  f"{c.budgets['chunked']}): x{c.p99_ratio:.2f} (target > 1); max ITL "
                  f"{fmt_num(c.max_itl_ms['no chunking'])} vs {fmt_num(c.max_itl_ms['chunked'])} ms; the long "
                  f"prompt's TTFT {fmt_num(c.long_ttft_ms['no chunking'])} vs {fmt_num(c.long_ttft_ms['chunked'])} "
                  f"ms ({c.long_prefill_steps['no chunking']} vs {c.long_prefill_steps['chunked']} steps)")
    for run in (r for r in result.runs if r.transfer is not None):
        _print_transfer(out, run)
    m = result.machine
    # quantised matrices keep their scales in the float dtype: name the weights' format, not only the dtype
    weights = f"{m['quantize']} weights, {m['dtype']} activations" if m.get("quantize") else m["dtype"]
    plain = ", --no-fast (plain PyTorch)" if m.get("fast") is False else ""
    threads = f"{m['torch_threads']} thread{'s' if m['torch_threads'] != 1 else ''}"
    if m.get("thread_governor"):
        threads += " (the thread governor: fewer while other processes keep cores busy)"
    out.print(f"[dim]{m.get('model', '')} on {m['device']}, {weights}{plain}, {threads}; load average "
              f"(1/5/15 min) {_load(m['loadavg_before'])} before, {_load(m['loadavg_after'])} after the runs[/dim]")


def _print_transfer(out, run) -> None:
    """The disaggregated run's K/V hand-offs, measured, against lesson 10's kv_transfer_seconds."""
    from ..units import fmt_bytes, fmt_num

    t = run.transfer
    if not t.num_hand_offs:
        return
    hand_off = t.to_dict()["p50_hand_off_ms"]
    out.print(f"Disaggregated @ {shared.rate_text(run.rate_req_s)}: K/V of {t.num_hand_offs} prompts sent, "
              f"{fmt_bytes(t.num_bytes)} = {t.prompt_tokens:,} tokens x {t.kv_bytes_per_token:,} bytes; measured "
              f"{fmt_num(t.measured_s_per_token * 1e6)} us/token ({fmt_num(t.measured_bytes_s / 1e9)} GB/s); "
              f"kv_transfer_seconds at the link's {fmt_num(t.link_bytes_s / 1e9)} GB/s (gloo over 127.0.0.1, "
              f"measured at start): {fmt_num(t.predicted_s_per_token * 1e6)} us/token; first token -> K/V in the "
              f"decode pool p50 {fmt_num(hand_off)} ms")


def _print_ratios(out, result) -> None:
    from ..bench.serving import policy_ratios

    ratios, ran = policy_ratios(result.runs), {run.policy for run in result.runs}
    if not ratios or not ran & {"one-at-a-time", "static"}:
        return  # nothing to compare with
    out.print("Ratios (targets: offline output tok/s >= 3x one-at-a-time and >= 1.3x static; "
              "goodput under load >= 2x one-at-a-time):")
    for r in ratios:
        parts = [f"{name} {_x(r[key])}" for name, key in (
            ("output tok/s vs one-at-a-time", "output_tok_s_vs_one_at_a_time"),
            ("vs static", "output_tok_s_vs_static"), ("goodput vs one-at-a-time", "goodput_vs_one_at_a_time"))
            if r[key] is not None or (key == "goodput_vs_one_at_a_time" and "one-at-a-time" in ran)]
        out.print(f"- {r['policy']} @ {shared.rate_text(r['rate_req_s'])}: " + ", ".join(parts))


def _x(value) -> str:
    if value is None:
        return "n/a (no request met the SLOs in either)"
    return "inf (one-at-a-time: 0)" if math.isinf(value) else f"x{value:.2f}"


def _load(values) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def _write_outputs(args, result) -> None:
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1))
        wrote(args.json)
    shown = _shown_run(result)
    if args.trace_out and shown is not None:
        from ..serving.step_trace import write_chrome_trace

        wrote(write_chrome_trace(args.trace_out, shown.steps, shown.requests,
                                 {"policy": shown.policy, "rate_req_s": shared.rate_text(shown.rate_req_s)}))
    if args.plots and shown is not None:
        for path in _save_plots(args.plots, result, shown):
            wrote(path)


def _shown_run(result):
    """The run the timeline and the trace show: continuous at the first rate, else the first engine run."""
    with_steps = [r for r in result.runs if r.steps]  # a disaggregated run's steps stay in its workers
    engine_runs = [r for r in with_steps if r.policy != "one-at-a-time"] or with_steps
    return next((r for r in engine_runs if r.policy == "continuous"), engine_runs[0] if engine_runs else None)


def _save_plots(folder, result, shown) -> list[Path]:
    from ..views.serving_plots import plot_itl, plot_rate_sweep, plot_timeline
    from ..serving.run_metrics import request_metrics

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg, paths = result.config, []
    figures = {"serving_rate_sweep.png": plot_rate_sweep(result.rows(), cfg.ttft_slo_ms, cfg.tpot_slo_ms),
               "serving_timeline.png": plot_timeline(shown.requests, shown.steps,
                                                     f"{shown.policy} @ {shared.rate_text(shown.rate_req_s)}")}
    if result.chunked_prefill is not None:
        c = result.chunked_prefill
        figures["serving_itl.png"] = plot_itl(
            {f"no chunking (budget {c.budgets['no chunking']})": c.itl_ms["no chunking"],
             f"chunked (budget {c.budgets['chunked']})": c.itl_ms["chunked"]},
            f"{c.n_short} decoding requests; a {c.long_prompt_len}-token prompt joins")
    else:
        first = result.runs[0].rate_req_s
        figures["serving_itl.png"] = plot_itl(
            {r.policy: [g for q in r.requests for g in request_metrics(q).itl_ms]
             for r in result.runs if r.rate_req_s == first}, f"ITL @ {shared.rate_text(first)}")
    for name, fig in figures.items():
        fig.savefig(folder / name, dpi=80)
        paths.append(folder / name)
    if len({r.rate_req_s for r in result.runs}) == 1:
        warn("one request rate: the rate-sweep plot has one point per policy; give several --request-rate values")
    return paths
