"""What a benchmark run measured: one :class:`Measurement` per engine and case, the
memory report, the targets checked, and :class:`BenchResult` that holds them all."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..hardware import HardwareProfile


@dataclass
class Measurement:
    """One engine on one case, medians over the repeats.

    Attributes:
        engine: "minillm-sdpa", "transformers", ...
        phase: "prefill" (time_ms is TTFT) or "decode" (time_ms is TPOT).
        length: prompt tokens (prefill) or tokens in the cache when decoding starts (decode).
        batch_size: sequences per forward pass.
        time_ms: median over repeats of TTFT (prefill) or of each repeat's median gap (decode), ms.
        times_ms: the per-repeat values, ms.
        tokens_per_s: batch_size·length / TTFT (prefill), batch_size / TPOT (decode).
        decode_tokens: tokens generated per repeat (1 for prefill).
        floor_ms: the roofline floor of the same work (compute for prefill, memory for decode), ms.
        floor_fraction: floor_ms / time_ms (1 = at the hardware's limit).
        bound: the roofline verdict ("compute-bound", "memory-bound", "overhead-bound").
        vs_reference: tokens_per_s / transformers' tokens_per_s in the same case (None without it).
        same_tokens: the greedy tokens equal minillm-sdpa's in the same case (None when not compared).
    """

    engine: str
    phase: str
    length: int
    batch_size: int
    time_ms: float
    times_ms: list[float]
    tokens_per_s: float
    decode_tokens: int
    floor_ms: float
    floor_fraction: float
    bound: str
    vs_reference: float | None = None
    same_tokens: bool | None = None


@dataclass
class MemoryReport:
    """Peak resident memory of ``minillm generate``-ing n_tokens, measured in a fresh process.

    Attributes:
        n_tokens, prompt_tokens: the request.
        weights_bytes: the model's parameters.
        kv_cache_bytes: the KV cache allocated for prompt + n_tokens positions.
        import_rss_bytes: RSS after ``import torch, minillm`` (the runtime itself).
        process_peak_bytes: peak RSS over the whole process (loading included).
        generate_peak_bytes: peak RSS from the end of loading to the last token
            (Linux: peak counter reset through /proc/self/clear_refs; else = process peak).
        budget_bytes: weights + KV cache + 300 MB, the target for generate_peak_bytes.
        device_peak_bytes: on CUDA, ``torch.cuda.max_memory_allocated`` (RSS does not see GPU memory).
    """

    n_tokens: int
    prompt_tokens: int
    weights_bytes: int
    kv_cache_bytes: int
    import_rss_bytes: int
    process_peak_bytes: int
    generate_peak_bytes: int
    budget_bytes: int
    device_peak_bytes: int | None = None

    @property
    def within_budget(self) -> bool:
        return self.generate_peak_bytes <= self.budget_bytes


@dataclass
class TargetCheck:
    """One target of the benchmark issue, checked against the measured numbers."""

    name: str
    measured: float | None
    target: float
    met: bool | None  # None: not measured in this run
    detail: str


@dataclass
class BenchResult:
    """Everything one ``run_bench`` measured, plus what it was measured on."""

    model: str
    device: str
    dtype: str
    threads: int
    hardware: HardwareProfile
    weights_bytes: int
    kv_bytes_per_token: int
    repeats: int
    measurements: list[Measurement]
    memory: MemoryReport | None = None
    notes: list[str] = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    wall_s: float = 0.0

    def find(self, engine: str, phase: str, length: int, batch_size: int = 1) -> Measurement | None:
        """The measurement of one engine on one case, or None."""
        for m in self.measurements:
            if (m.engine, m.phase, m.length, m.batch_size) == (engine, phase, length, batch_size):
                return m
        return None

    def engines(self) -> list[str]:
        return list(dict.fromkeys(m.engine for m in self.measurements))

    def to_dict(self) -> dict:
        """The numbers as JSON-ready dicts; :func:`~minillm.bench.render.to_json` adds the targets checked."""
        d = asdict(self)
        if self.memory is not None:
            d["memory"]["within_budget"] = self.memory.within_budget
        return d
