"""The benchmark issue's targets, checked against a run's measured numbers."""

from __future__ import annotations

from ..hardware import HardwareProfile
from .results import BenchResult, Measurement, TargetCheck

BEATEN_FLOOR = 1.05  # a measurement this far past its floor means the calibrated peaks are wrong

def check_targets(result: BenchResult, engine: str = "minillm-sdpa") -> list[TargetCheck]:
    """The issue's targets (batch 1) against this run's numbers; unmeasured ones have met=None."""
    checks = []
    decodes = [m for m in result.measurements if m.engine == engine and m.phase == "decode" and m.batch_size == 1]
    for m in decodes:
        checks.append(_check(f"decode ctx {m.length}: x transformers", m.vs_reference, 1.5, "tok/s ratio, same run"))
        checks.append(_floor_check(f"decode ctx {m.length}: fraction of floor", m,
                                   f"floor {m.floor_ms:.1f} ms (bytes / GB/s), measured {m.time_ms:.1f} ms"))
    pre = result.find(engine, "prefill", 512)
    if pre is not None:
        checks.append(_check("prefill 512: x transformers", pre.vs_reference, 1.0, "tok/s ratio, same run"))
        checks.append(_floor_check("prefill 512: fraction of floor", pre,
                                   f"floor {pre.floor_ms:.0f} ms (FLOPs / FLOP/s), measured {pre.time_ms:.0f} ms"))
    if result.memory is not None:
        mem = result.memory
        checks.append(TargetCheck("memory: peak RSS generating (MB)", mem.generate_peak_bytes / 1e6,
                                  mem.budget_bytes / 1e6, mem.within_budget,
                                  "budget = weights + KV cache + 300 MB"))
    slow = cache_slowdowns(result)
    if len(slow) >= 2:
        lengths = sorted(slow)
        grows = all(slow[a] < slow[b] for a, b in zip(lengths, lengths[1:]))
        detail = ", ".join(f"ctx {n}: {slow[n]:.1f}x" for n in lengths)
        checks.append(TargetCheck("no-cache slowdown grows with context", slow[lengths[-1]], slow[lengths[0]],
                                  grows, detail))
    for m in decodes:  # issue 16: batch-1 float32 decode >= 0.9x llama.cpp's F32 on the same weights
        peer = result.find("llama.cpp", "decode", m.length, 1)
        if peer is not None:
            checks.append(_check(f"decode ctx {m.length}: x llama.cpp", m.tokens_per_s / peer.tokens_per_s, 0.9,
                                 f"tok/s ratio, same run: {m.time_ms:.1f} vs {peer.time_ms:.1f} ms/step"))
    # The decode target again for the compiled step (3x on a CUDA GPU, 1.5x elsewhere).
    on_cuda = result.device.startswith("cuda")
    for m in result.measurements:
        if m.engine == "minillm-compile" and m.phase == "decode" and m.batch_size == 1:
            checks.append(_check(f"{'cuda ' if on_cuda else ''}decode ctx {m.length} (--compile): x transformers",
                                 m.vs_reference, 3.0 if on_cuda else 1.5, "tok/s ratio, same run"))
    return checks


def _check(name: str, value: float | None, target: float, detail: str) -> TargetCheck:
    return TargetCheck(name, value, target, None if value is None else value >= target, detail)


def _floor_check(name: str, m: Measurement, detail: str) -> TargetCheck:
    """The >= 60%-of-floor target; not judged when the floor itself was beaten (a bad calibration)."""
    if m.floor_fraction > BEATEN_FLOOR:
        return TargetCheck(name, m.floor_fraction, 0.6, None, detail + "; faster than the floor: recalibrate")
    return _check(name, m.floor_fraction, 0.6, detail)


def cache_slowdowns(result: BenchResult) -> dict[int, float]:
    """No-cache TPOT / minillm-sdpa TPOT per context length (batch 1): what the KV cache saves."""
    out = {}
    for m in result.measurements:
        if m.engine == "no-cache" and m.phase == "decode" and m.batch_size == 1:
            cached = result.find("minillm-sdpa", "decode", m.length, 1)
            if cached is not None:
                out[m.length] = m.time_ms / cached.time_ms
    return out



def beaten_floor_notes(measurements: list[Measurement], hw: HardwareProfile) -> list[str]:
    beaten = [m for m in measurements if m.floor_fraction > BEATEN_FLOOR]
    if not beaten:
        return []
    worst = max(beaten, key=lambda m: m.floor_fraction)
    return [f"{len(beaten)} measurements ran faster than their floor ({worst.engine} {worst.phase} {worst.length}: "
            f"{100 * worst.floor_fraction:.0f}%): the calibration ({hw.peak_flops / 1e9:,.1f} GFLOP/s, "
            f"{hw.mem_bandwidth / 1e9:,.1f} GB/s) understates this device and dtype, so the floor targets are "
            "not judged; run `minillm calibrate` again"]
