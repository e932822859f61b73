"""The serving benchmark: one workload, replayed in real time through each batching policy, measured.

    workload (arrival_s, prompt, max_tokens)  --replay-->  policy  -->  requests with timestamps
                                                                        -->  RunSummary (run_metrics)

Every policy gets the same requests with the same greedy :class:`SamplingParams`, and EOS
is ignored (vLLM's ``--ignore-eos``), so every request produces exactly its ``max_tokens``
and the policies do the same work. A request's clock starts at its arrival, whatever the
policy does with it then. The four policies, drawn for three requests (A, B arrive at
once, C a little later)::

    one-at-a-time        [A.........][B.......][C....]        C waits for A and B
    static               [A B ..........][C....]               C waits for the whole batch
    continuous           [A B ...C joins the next step...]     nobody waits for a slot
    continuous+chunked   the same, long prompts cut into budget-sized chunks

- "one-at-a-time": :func:`~minillm.generate.generate` per request, in arrival order.
- "static": request-level batching, as a padded [B, T] batch runs it (HF ``generate``
  on a batch). When idle, take the requests that have arrived (up to ``max_num_seqs``),
  run them as one batch on the :class:`LLMEngine` (whole prompts in one step: chunked
  prefill off, a token budget that fits the batch's prompts), and admit nobody until the
  batch's slowest member has finished. A row whose request has its ``max_tokens`` stays
  in the batch as padding and keeps decoding (tokens thrown away) until the batch ends,
  as a finished row of a padded batch still goes through every matmul; its request is
  answered at its own last token. Prompts are not padded (the tokens lie flat), so the
  prefill pays no padding: on that side this static batching is generous.
- "continuous": the engine, chunked prefill off, a budget of at least the longest prompt
  plus ``max_num_seqs`` (a whole prompt always fits next to a full batch of decodes).
- "continuous+chunked": the engine, chunked prefill on, budget ``max_num_batched_tokens``.
- "disaggregated" (only when asked; not in :data:`POLICIES`, the default set): lesson 10's split,
  a prefill worker and a decode worker in two processes, one core each
  (:class:`~minillm.distributed.disaggregated.DisaggregatedEngine`), each with continuous's
  budget and ``max_num_seqs`` and its own ``kv_cache_memory`` pool; the prompt's K/V crosses
  from one to the other over torch.distributed (gloo). Its run also carries the hand-offs
  measured (:class:`~minillm.distributed.disaggregated.TransferSummary`).

The engine policies get requests when their arrival time has passed, and sleep until
the next arrival when idle. Prefix caching is off in every run: this measures batching,
and one-at-a-time has no shared pool to hit. With KV tiers (``kv_offload_memory``,
``kv_offload_dir``) the engine policies run with it on, since the tiers hang off the prefix
cache; each run's disk tier is a folder of its own, ``<kv_offload_dir>/<policy>@<rate>``, so a run
never hits the blocks an earlier run wrote (the policies still do the same work), and the same
command run again on the same folder finds each run's own blocks there: the cost of the tiers on
a cold run, then the gain of a warm one.

KV memory (:class:`KVMemory`): at the step where the paged pool held the most blocks,
the bytes of those blocks against the K/V bytes the running requests really held then,
and against one ``max_seq_len`` :class:`~minillm.kv_cache.KVCache` per running request
(what a contiguous cache per request must reserve).

:func:`run_chunked_prefill_experiment` measures what chunked prefill is for: short
requests decoding when a long prompt arrives; their p99 inter-token latency with and
without chunking.
"""

from __future__ import annotations

import bisect
import math
import os
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..generate import generate
from ..sampling import SamplingParams
from ..serving.engine import LLMEngine
from ..serving.request import FINISHED, RUNNING, Request
from ..serving.run_metrics import RunSummary, request_metrics, span_s, summarize_run
from ..serving.step_trace import StepRecord
from .workload import WorkloadRequest, make_workload

POLICIES = ("one-at-a-time", "static", "continuous", "continuous+chunked")
DISAGGREGATED = "disaggregated"
ALL_POLICIES = POLICIES + (DISAGGREGATED,)  # POLICIES is the default set: this one starts two processes
OFFLINE = math.inf  # the rate of an offline run: every request at t = 0

Progress = Callable[[str, float, int, int], None]  # (policy, rate_req_s, n_finished, n_requests)


@dataclass(frozen=True)
class ServingConfig:
    """The knobs every engine policy shares (vLLM's names) and the SLOs a run is judged on.

    Attributes:
        max_num_seqs: most requests in a batch (also the static batch size).
        max_num_batched_tokens: continuous+chunked's token budget per step; "continuous"
            uses max(this, longest prompt + max_num_seqs); "static" its batch's prompts.
        kv_cache_memory: the paged pool's budget ("512MiB", bytes, or a fraction of free memory).
        block_size: positions per block.
        ttft_slo_ms, tpot_slo_ms: the SLOs of attainment and goodput (None: not checked).
        kv_offload_memory, kv_offload_dir: the KV tiers under the pool (LLMEngine's), off by default; the
            engine policies' engines get them (the disk tier in a folder per run: see the module
            docstring), one-at-a-time and the disaggregated workers do not.
        kv_offload_disk_size: the bound of each run's disk tier (LLMEngine's), None: unbounded.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    kv_cache_memory: str | int | float = "512MiB"
    block_size: int = 16
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    kv_offload_memory: str | int | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk_size: str | int | None = None


@dataclass(frozen=True)
class KVMemory:
    """The KV cache at the step where the paged pool held the most blocks (bytes).

    Attributes:
        step: that step's index.
        num_blocks_used, paged_bytes: the blocks requests held, and num_blocks_used · bytes_per_block.
        held_tokens, held_bytes: positions whose K/V the running requests held, and their bytes
            (held_tokens · bytes per token): what a perfectly packed cache would store.
        num_running: requests running after that step.
        max_seq_len, max_seq_len_bytes: the model's context, and num_running · one KVCache of it
            (2 · n_layers · n_kv_heads · max_seq_len · head_dim · dtype bytes each).
        pool_bytes: the whole pool, allocated up front.
    """

    step: int
    num_blocks_used: int
    paged_bytes: int
    held_tokens: int
    held_bytes: int
    num_running: int
    max_seq_len: int
    max_seq_len_bytes: int
    pool_bytes: int

    @property
    def paged_over_held(self) -> float:
        """paged_bytes / held_bytes: 1.0 is no waste; the partial last block of each request is the rest."""
        return self.paged_bytes / self.held_bytes if self.held_bytes else math.inf


@dataclass
class PolicyRun:
    """One policy on one workload.

    Attributes:
        policy: one of :data:`POLICIES`.
        rate_req_s: the workload's request rate (math.inf: offline).
        summary: :func:`~minillm.serving.run_metrics.summarize_run` of its requests.
        requests: the finished :class:`Request` objects (ids "0", "1", ... in workload order).
        steps: one :class:`StepRecord` per step (one-at-a-time: per generate step, no blocks).
        kv_memory: the paged pool at its peak; None for one-at-a-time and disaggregated.
        transfer: disaggregated only: its K/V hand-offs (a ``TransferSummary``), else None.
    """

    policy: str
    rate_req_s: float
    summary: RunSummary
    requests: list[Request]
    steps: list[StepRecord]
    kv_memory: KVMemory | None = None
    transfer: object = None

    def output_ids(self) -> dict[str, list[int]]:
        return {r.request_id: list(r.output_ids) for r in self.requests}

    def to_dict(self) -> dict:
        """Numbers only (no steps): policy, rate, summary, kv_memory, and per-request metrics."""
        per_request = []
        for r in self.requests:
            m = request_metrics(r)
            per_request.append({"request_id": r.request_id, "prompt_tokens": r.num_prompt_tokens,
                                "output_tokens": len(r.output_ids), "finish_reason": r.finish_reason,
                                "ttft_ms": m.ttft_ms, "tpot_ms": m.tpot_ms, "e2e_ms": m.e2e_ms,
                                "queue_ms": m.queue_ms, "num_preemptions": r.num_preemptions})
        return {"policy": self.policy, "rate_req_s": _json_rate(self.rate_req_s), "summary": self.summary.to_dict(),
                "kv_memory": None if self.kv_memory is None else
                {**asdict(self.kv_memory), "paged_over_held": self.kv_memory.paged_over_held},
                "num_steps": len(self.steps), "requests": per_request,
                "transfer": None if self.transfer is None else self.transfer.to_dict()}


# -- the policies -----------------------------------------------------------------------


def run_policy(model, workload: Sequence[WorkloadRequest], policy: str, config: ServingConfig = ServingConfig(),
               rate_req_s: float = OFFLINE, progress: Progress | None = None,
               before_step: Callable[[], object] | None = None) -> PolicyRun:
    """Replay ``workload`` in real time through ``policy``; every request to its full ``max_tokens``.

    ``rate_req_s`` only labels the run (the arrivals are in the workload). ``progress`` is
    called as (policy, rate_req_s, n_finished, n_requests) after each request finishes;
    ``before_step`` before each forward pass in this process (the command's thread governor,
    minillm/cpu_policy.py; the disaggregated workers pin their own single thread).
    Raises ValueError for an unknown policy, an empty workload, or a request the engine refuses.
    """
    if policy not in ALL_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; use one of {', '.join(ALL_POLICIES)}")
    if not workload:
        raise ValueError("empty workload; make one with workload.make_workload(...)")
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_s)
    done = _progress_counter(progress, policy, rate_req_s, len(workload))
    engine = transfer = None
    if policy == "one-at-a-time":
        requests, steps = _one_at_a_time(model, workload, order, done, before_step)
    elif policy == DISAGGREGATED:
        (requests, transfer), steps = _disaggregated(model, workload, order, config, done), []
    else:
        engine = _engine_for(model, workload, policy, config, rate_req_s)
        requests = _replay_on_engine(engine, workload, order, policy == "static", config.max_num_seqs, done,
                                     before_step)
        steps = engine.steps
    summary = summarize_run(requests, span_s(requests), config.ttft_slo_ms, config.tpot_slo_ms)
    kv = kv_memory_at_peak(engine) if engine is not None else None
    return PolicyRun(policy, rate_req_s, summary, requests, steps, kv, transfer)


def greedy_params(request: WorkloadRequest) -> SamplingParams:
    """The params of every policy: greedy, exactly ``max_tokens`` tokens (EOS is ignored separately)."""
    return greedy_params_of(request.max_tokens)


def greedy_params_of(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_tokens)


def _one_at_a_time(model, workload, order, done, before_step=None) -> tuple[list[Request], list[StepRecord]]:
    """generate() per request in arrival order; returns the requests (workload order) and a step per token."""
    t0 = time.perf_counter()
    arrivals = sorted(t0 + w.arrival_s for w in workload)
    requests = [Request(str(i), list(w.prompt_ids), greedy_params(w), t0 + w.arrival_s) for i, w in enumerate(workload)]
    steps: list[StepRecord] = []
    for n_started, i in enumerate(order, start=1):
        req = requests[i]
        _sleep_until(req.arrival_s)
        req.status, req.first_scheduled_s = RUNNING, time.perf_counter()
        start = req.first_scheduled_s
        for step in generate(model, req.prompt_ids, req.params, eos_token_ids=[]):
            if before_step is not None:  # between two of generate's passes: the next one runs after this
                before_step()
            req.output_ids.append(step.token_id)
            req.token_times_s.append(step.time_s)
            rows = ((req.request_id, step.prefill_tokens, 0) if step.phase == "prefill" else (req.request_id, 0, 1),)
            waiting = bisect.bisect_right(arrivals, step.time_s) - n_started
            steps.append(StepRecord(len(steps), start, step.time_s, rows, 0, 0, 0,
                                    finished=(req.request_id,) if step.finish_reason else (),
                                    num_waiting=max(waiting, 0), num_running=0 if step.finish_reason else 1,
                                    num_kv_tokens=step.cache_length))
            start = step.time_s
            if step.finish_reason:
                req.finish_reason = "length" if step.finish_reason == "cache_full" else step.finish_reason
        req.status, req.finish_s = FINISHED, time.perf_counter()
        done()
    return requests, steps


def _disaggregated(model, workload, order, config: ServingConfig, done):
    """The workload through a prefill and a decode worker (continuous's budget, no chunking), fed at
    the arrival times; returns (the requests in workload order, the TransferSummary). The workers
    start, load the model and warm up before the clock starts."""
    from ..distributed.disaggregated import DisaggregatedConfig, DisaggregatedEngine

    longest = max(len(w.prompt_ids) for w in workload)
    budget = max(config.max_num_batched_tokens, longest + config.max_num_seqs)
    settings = DisaggregatedConfig(config.max_num_seqs, budget, enable_chunked_prefill=False,
                                   kv_cache_memory=config.kv_cache_memory, block_size=config.block_size,
                                   eos_token_ids=())
    with DisaggregatedEngine(model, settings) as engine:
        pending, t0 = deque(order), time.perf_counter()
        while pending or engine.has_unfinished_requests():
            while pending and t0 + workload[pending[0]].arrival_s <= time.perf_counter():
                i = pending.popleft()
                engine.add_request(list(workload[i].prompt_ids), greedy_params(workload[i]), request_id=str(i),
                                   arrival_s=t0 + workload[i].arrival_s)
            wait_s = t0 + workload[pending[0]].arrival_s - time.perf_counter() if pending else 0.5
            for request_id in engine.poll(min(max(wait_s, 0.0), 0.5)):
                if engine.requests[request_id].finished:
                    done()
        return [engine.requests[str(i)] for i in range(len(workload))], engine.transfer_summary()


def _engine_for(model, workload, policy: str, config: ServingConfig, rate_req_s: float = OFFLINE) -> LLMEngine:
    """A fresh engine with the policy's chunking and token budget, and the KV tiers asked for (see the
    module docstring)."""
    longest = max(len(w.prompt_ids) for w in workload)
    if policy == "continuous+chunked":
        budget, chunked = config.max_num_batched_tokens, True
    elif policy == "continuous":
        budget, chunked = max(config.max_num_batched_tokens, longest + config.max_num_seqs), False
    else:  # static: set again for each batch, to the batch's prompts
        budget, chunked = max(longest, config.block_size), False
    tiers = config.kv_offload_memory is not None or config.kv_offload_dir is not None
    folder = None if config.kv_offload_dir is None else Path(config.kv_offload_dir) / f"{policy}@{rate_req_s:g}"
    return LLMEngine(model, kv_cache_memory=config.kv_cache_memory, block_size=config.block_size,
                     max_num_seqs=config.max_num_seqs, max_num_batched_tokens=budget,
                     enable_chunked_prefill=chunked, enable_prefix_caching=tiers, eos_token_ids=[],
                     kv_offload_memory=config.kv_offload_memory, kv_offload_dir=folder,
                     kv_offload_disk_size=config.kv_offload_disk_size)


def _replay_on_engine(engine: LLMEngine, workload, order, static: bool, max_num_seqs: int, done,
                      before_step=None) -> list[Request]:
    """Add each request when its arrival has passed (static: only between batches); step; sleep when idle."""
    pending = deque(order)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter()
        if not (static and engine.has_unfinished_requests()):
            batch = []
            while pending and t0 + workload[pending[0]].arrival_s <= now and not (static and len(batch) >= max_num_seqs):
                batch.append(pending.popleft())
            if static and batch:
                _add_static_batch(engine, [workload[i] for i in batch], [str(i) for i in batch], t0, done)
            for i in batch if not static else ():
                w = workload[i]
                engine.add_request(list(w.prompt_ids), greedy_params(w), request_id=str(i), arrival_s=t0 + w.arrival_s)
        if not engine.has_unfinished_requests():
            _sleep_until(t0 + workload[pending[0]].arrival_s)
            continue
        if before_step is not None:
            before_step()
        for out in engine.step():
            if out.finished and not static:
                done()
    requests = [engine.requests[str(i)] for i in range(len(workload))]
    if static:
        for request, w in zip(requests, workload):
            _drop_padding(request, w.max_tokens)
    return requests


def _add_static_batch(engine: LLMEngine, batch: list[WorkloadRequest], ids: list[str], t0: float, done) -> None:
    """One static batch: whole prompts in one step, every row decoding as long as the longest."""
    engine.scheduler.max_num_batched_tokens = max(sum(len(w.prompt_ids) for w in batch), engine.cache.block_size)
    longest = SamplingParams(temperature=0.0, max_new_tokens=max(w.max_tokens for w in batch))
    for w, request_id in zip(batch, ids):
        engine.add_request(list(w.prompt_ids), longest, request_id=request_id, arrival_s=t0 + w.arrival_s)
        done()  # the bar counts a static request when its batch starts: it has nothing else to show


def _drop_padding(request: Request, max_tokens: int) -> None:
    """A static row back to its own request: its first ``max_tokens`` tokens, finished at the last one."""
    del request.output_ids[max_tokens:], request.token_times_s[max_tokens:], request.output_logprobs[max_tokens:]
    request.params = greedy_params_of(max_tokens)
    request.finish_s, request.finish_reason = request.token_times_s[-1], "length"


def _sleep_until(t_s: float) -> None:
    delay = t_s - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _progress_counter(progress: Progress | None, policy: str, rate: float, total: int) -> Callable[[], None]:
    count = [0]

    def done() -> None:
        count[0] += 1
        if progress is not None:
            progress(policy, rate, count[0], total)

    return done


def kv_memory_at_peak(engine: LLMEngine) -> KVMemory | None:
    """:class:`KVMemory` at the engine's step with the most blocks used (None before any step)."""
    if not engine.steps:
        return None
    peak = max(engine.steps, key=lambda s: s.num_blocks_used)  # the first of equal peaks
    cache, context = engine.cache, engine.model.config.max_seq_len
    per_token = cache.bytes_per_block // cache.block_size  # 2 · n_layers · n_kv_heads · head_dim · dtype bytes
    return KVMemory(peak.step, peak.num_blocks_used, peak.num_blocks_used * cache.bytes_per_block,
                    peak.num_kv_tokens, peak.num_kv_tokens * per_token, peak.num_running, context,
                    peak.num_running * context * per_token, cache.bytes_capacity)


# -- a sweep over policies and rates -------------------------------------------------------


@dataclass
class ServingBenchResult:
    """Every run of a benchmark, and where it ran.

    Attributes:
        runs: one :class:`PolicyRun` per (rate, policy), rates in the order given.
        config: the :class:`ServingConfig` of every run.
        workload: :func:`~minillm.bench.workload.describe` of the offline or first workload.
        machine: device, dtype, torch threads, load averages before and after (``os.getloadavg``).
        chunked_prefill: the result of :func:`run_chunked_prefill_experiment`, when run.
    """

    runs: list[PolicyRun]
    config: ServingConfig
    workload: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)
    chunked_prefill: "ChunkedPrefillResult | None" = None

    def rows(self) -> list[dict]:
        """One dict per run: ``policy``, ``rate_req_s`` and the ``RunSummary.to_dict()`` keys
        (what :func:`minillm.views.serving_plots.plot_rate_sweep` takes)."""
        return [{"policy": r.policy, "rate_req_s": r.rate_req_s, **r.summary.to_dict()} for r in self.runs]

    def run(self, policy: str, rate_req_s: float) -> PolicyRun | None:
        return next((r for r in self.runs if r.policy == policy and r.rate_req_s == rate_req_s), None)

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "workload": self.workload, "machine": self.machine,
                "runs": [r.to_dict() for r in self.runs], "ratios": policy_ratios(self.runs),
                "chunked_prefill": None if self.chunked_prefill is None else self.chunked_prefill.to_dict()}


def run_serving_bench(model, workloads: dict[float, Sequence[WorkloadRequest]], policies: Sequence[str] = POLICIES,
                      config: ServingConfig = ServingConfig(), progress: Progress | None = None,
                      before_step: Callable[[], object] | None = None) -> ServingBenchResult:
    """Every policy on the workload of every rate (rate -> workload; math.inf: offline), after one warm-up.

    ``progress`` and ``before_step`` as in :func:`run_policy`.

    Raises ValueError for an unknown policy or an empty workload (before any run).
    """
    from .workload import describe

    for policy in policies:
        if policy not in ALL_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; use one of {', '.join(ALL_POLICIES)}")
    if not workloads or any(not w for w in workloads.values()):
        raise ValueError("no workload to run; give at least one rate with at least one request")
    machine = machine_state(model)
    warm_up(model)
    runs = [run_policy(model, w, p, config, rate, progress, before_step) for rate, w in workloads.items()
            for p in policies]
    machine["loadavg_after"] = list(os.getloadavg())
    return ServingBenchResult(runs, config, describe(next(iter(workloads.values()))), machine)


def warm_up(model) -> None:
    """One short generate() and one engine step, untimed: PyTorch's first calls are slow."""
    prompt = [1] * 8
    for _ in generate(model, prompt, SamplingParams(max_new_tokens=2), eos_token_ids=[]):
        pass
    LLMEngine(model, kv_cache_memory="8MiB", max_num_batched_tokens=64, eos_token_ids=[]).generate(
        [prompt, prompt[:3]], SamplingParams(max_new_tokens=2))


def machine_state(model) -> dict:
    import torch

    param = next(model.parameters())
    return {"device": str(param.device), "dtype": str(param.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "loadavg_before": list(os.getloadavg())}


def policy_ratios(runs: Sequence[PolicyRun]) -> list[dict]:
    """Per rate and continuous policy: output tok/s over one-at-a-time's and static's, goodput over
    one-at-a-time's (None where a run is missing; inf when the divisor is 0)."""
    out = []
    for rate in dict.fromkeys(r.rate_req_s for r in runs):
        by = {r.policy: r.summary for r in runs if r.rate_req_s == rate}
        for policy in ("continuous", "continuous+chunked"):
            if policy not in by:
                continue
            s = by[policy]
            out.append({
                "rate_req_s": _json_rate(rate), "policy": policy,
                "output_tok_s_vs_one_at_a_time": _ratio(s, by.get("one-at-a-time"), "output_throughput_tok_s"),
                "output_tok_s_vs_static": _ratio(s, by.get("static"), "output_throughput_tok_s"),
                "goodput_vs_one_at_a_time": _ratio(s, by.get("one-at-a-time"), "goodput_req_s"),
            })
    return out


def _ratio(a: RunSummary, b: RunSummary | None, key: str) -> float | None:
    x, y = getattr(a, key), None if b is None else getattr(b, key)
    if x is None or y is None:
        return None
    return x / y if y else (math.inf if x else None)


def _json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


# -- chunked prefill against a long prompt ----------------------------------------------------


@dataclass
class ChunkedPrefillResult:
    """Short requests decoding when a long prompt arrives, with and without chunked prefill.

    Attributes:
        n_short, short_prompt_len, short_output_len, long_prompt_len, chunk_budget: the set-up.
        itl_ms: "no chunking" / "chunked" -> every inter-token gap of the short requests (ms),
            in the order the gaps ended.
        p99_itl_ms, max_itl_ms: of those gaps.
        long_ttft_ms: the long request's TTFT in each (chunking spreads its prefill over steps).
        long_prefill_steps: steps its prefill took in each.
        budgets: max_num_batched_tokens of each.
    """

    n_short: int
    short_prompt_len: int
    short_output_len: int
    long_prompt_len: int
    chunk_budget: int
    itl_ms: dict[str, list[float]]
    p99_itl_ms: dict[str, float]
    max_itl_ms: dict[str, float]
    long_ttft_ms: dict[str, float]
    long_prefill_steps: dict[str, int]
    budgets: dict[str, int]

    @property
    def p99_ratio(self) -> float:
        """p99 ITL without chunking / with it: > 1 when chunking cut the spikes."""
        return self.p99_itl_ms["no chunking"] / self.p99_itl_ms["chunked"]

    def to_dict(self) -> dict:
        return {**asdict(self), "p99_ratio": self.p99_ratio}


def run_chunked_prefill_experiment(model, n_short: int = 8, short_prompt_len: int = 32, short_output_len: int = 64,
                                   long_prompt_len: int = 1536, chunk_budget: int = 512, join_after: int = 8,
                                   seed: int = 0, token_ids: Sequence[int] | None = None,
                                   progress: Callable[[str], None] | None = None) -> ChunkedPrefillResult:
    """Run ``n_short`` requests until each has ``join_after`` tokens, then add one long prompt; twice.

    "no chunking": chunked prefill off, budget long_prompt_len + n_short, so the whole prompt runs in
    one step next to the decodes and every short request waits for it. "chunked": budget
    ``chunk_budget``, the prompt cut into chunks that share steps with the decodes. The short
    requests' ITLs are compared (p99; each gets short_output_len - 1 gaps).

    Raises ValueError for lengths the model cannot hold, or join_after >= short_output_len.
    """
    if not 1 <= join_after < short_output_len:
        raise ValueError(f"join_after ({join_after}) must be in [1, short_output_len ({short_output_len}))")
    vocab = model.config.vocab_size
    shorts = make_workload(n_short, str(short_prompt_len), str(short_output_len), seed=seed, vocab_size=vocab,
                           token_ids=token_ids)
    [long] = make_workload(1, str(long_prompt_len), "4", seed=seed + 1, vocab_size=vocab, token_ids=token_ids)
    budgets = {"no chunking": long_prompt_len + n_short, "chunked": chunk_budget}
    runs = {}
    for name, budget in budgets.items():
        if progress is not None:
            progress(name)
        engine = LLMEngine(model, kv_cache_memory=_pool_bytes(model, n_short * (short_prompt_len + short_output_len)
                                                              + long_prompt_len + 64),
                           max_num_seqs=n_short + 1, max_num_batched_tokens=budget,
                           enable_chunked_prefill=name == "chunked", enable_prefix_caching=False, eos_token_ids=[])
        runs[name] = _long_prompt_joins(engine, shorts, long, join_after)
    itl = {name: _gaps_in_time_order(run[0]) for name, run in runs.items()}
    return ChunkedPrefillResult(
        n_short, short_prompt_len, short_output_len, long_prompt_len, chunk_budget, itl,
        {k: _p99(v) for k, v in itl.items()}, {k: max(v) for k, v in itl.items()},
        {k: request_metrics(run[1]).ttft_ms for k, run in runs.items()},
        {k: run[2] for k, run in runs.items()}, budgets)


def _long_prompt_joins(engine: LLMEngine, shorts, long, join_after: int) -> tuple[list[Request], Request, int]:
    """Shorts first; the long prompt once every short request has join_after tokens; run to the end.
    Returns (the short requests, the long one, the steps its prefill took)."""
    for i, w in enumerate(shorts):
        engine.add_request(list(w.prompt_ids), greedy_params(w), request_id=f"short{i}")
    short_reqs = [engine.requests[f"short{i}"] for i in range(len(shorts))]
    while min(len(r.output_ids) for r in short_reqs) < join_after:
        engine.step()
    engine.add_request(list(long.prompt_ids), greedy_params(long), request_id="long")
    while engine.has_unfinished_requests():
        engine.step()
    prefill_steps = sum(1 for s in engine.steps for rid, p, _ in s.scheduled if rid == "long" and p)
    return short_reqs, engine.requests["long"], prefill_steps


def _gaps_in_time_order(requests) -> list[float]:
    """Every inter-token gap (ms) of the requests, ordered by when the gap ended."""
    gaps = [(b, (b - a) * 1e3) for r in requests for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    return [gap for _, gap in sorted(gaps)]


def _pool_bytes(model, tokens: int) -> int:
    """Bytes of a pool that holds ``tokens`` positions (and a few blocks more)."""
    from ..serving.paged_cache import bytes_per_block

    per_block = bytes_per_block(model.config, 16, next(model.parameters()).element_size())
    return per_block * (tokens // 16 + 8)


def _p99(values: list[float]) -> float:
    from ..metrics import percentile

    return percentile(values, 99)
