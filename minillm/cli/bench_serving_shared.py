"""What both modes of ``minillm bench-serving`` share (in-process, and over HTTP with --base-url):
the workloads at each rate, the progress bar, the throughput and latency tables."""

from __future__ import annotations

import math


def safe_ids(tokenizer):
    from ..bench.workload import safe_token_ids

    return safe_token_ids(tokenizer) if tokenizer is not None else None


def workloads(args, rates: list[float], vocab_size: int, tokenizer) -> dict:
    """rate -> the workload at that rate: the same prompts and lengths, only the arrivals differ."""
    from ..bench.workload import load_jsonl, make_workload

    out = {}
    for rate in rates:
        rate_or_none = None if math.isinf(rate) else rate
        if args.dataset:
            w = load_jsonl(args.dataset, tokenizer, rate_or_none, args.seed)[: args.num_prompts]
        else:
            w = make_workload(args.num_prompts, args.input_len, args.output_len, rate_or_none, args.seed,
                              vocab_size=vocab_size, token_ids=safe_ids(tokenizer))
        out[rate] = w
    return out


class Advance:
    """The progress bar's two callbacks: one per finished request, one per experiment run."""

    def __init__(self, bar, task):
        self.bar, self.task, self.done = bar, task, 0

    def request(self, policy: str, rate: float, n_finished: int, n_requests: int) -> None:
        self.done += 1
        self.bar.update(self.task, completed=self.done,
                        description=f"{policy} @ {rate_text(rate)}: {n_finished}/{n_requests} requests")

    def experiment(self, name: str) -> None:
        self.done += 1
        self.bar.update(self.task, completed=self.done, description=f"chunked-prefill experiment: {name}")


class progress_bar:
    """A rich bar on stderr over every request of every run (drawn only on a terminal), then erased."""

    def __init__(self, args, n_requests: int):
        from rich.console import Console
        from rich.progress import Progress

        console = Console(stderr=True)
        self.progress = Progress(console=console, disable=args.quiet or not console.is_terminal, transient=True)
        self.total = n_requests + (2 if args.long_prompt_len else 0)

    def __enter__(self) -> Advance:
        self.progress.__enter__()
        return Advance(self.progress, self.progress.add_task("warm-up", total=self.total))

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)


def rate_text(rate) -> str:
    return "inf" if rate in ("inf", math.inf) else f"{rate:g} req/s"


def ms(value) -> str:
    from ..units import fmt_num

    return "-" if value is None else fmt_num(value)


def print_summaries(out, rows, n_requests: int, ttft_slo_ms: float, tpot_slo_ms: float,
                    last_column: tuple[str, str] = ("preempt", "n_preemptions")) -> None:
    """The throughput and latency tables, a row per (rate, policy, RunSummary); ``last_column``:
    the throughput table's last header and the RunSummary count it shows."""
    from rich import box
    from rich.table import Table

    from ..units import fmt_num

    # Two tables of 8 columns rather than one of 13, so that an 80-column terminal shows every number.
    throughput = Table("rate", "policy", "req/s", "out tok/s", "total tok/s", "SLO met", "goodput", last_column[0],
                       box=box.SIMPLE_HEAD, title=f"Serving {n_requests} requests: throughput "
                       f"(SLO: TTFT <= {ttft_slo_ms:g} ms and TPOT <= {tpot_slo_ms:g} ms; goodput in req/s)")
    latency = Table("rate", "policy", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99",
                    box=box.SIMPLE_HEAD, title="Latency (ms)")
    for rate_req_s, policy, s in rows:
        rate = rate_text(rate_req_s)
        throughput.add_row(rate, policy, fmt_num(s.request_throughput_req_s), fmt_num(s.output_throughput_tok_s),
                           fmt_num(s.total_token_throughput_tok_s),
                           "-" if s.slo_attainment is None else f"{100 * s.slo_attainment:.0f}%",
                           "-" if s.goodput_req_s is None else fmt_num(s.goodput_req_s),
                           str(getattr(s, last_column[1])))
        latency.add_row(rate, policy, ms(s.p50_ttft_ms), ms(s.p99_ttft_ms), ms(s.p50_tpot_ms),
                        ms(s.p99_tpot_ms), ms(s.p99_itl_ms))
    out.print(throughput)
    out.print(latency)
