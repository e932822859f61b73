"""What the hardware can do, and the roofline verdict on what a phase actually took.

The roofline model (Williams, Waterman & Patterson 2009, "Roofline: an insightful
visual performance model for multicore architectures", CACM 52(4)): a kernel that
does F FLOPs and moves B bytes cannot finish faster than

    floor = max(F / peak_flops,  B / mem_bandwidth)
                 compute floor   memory floor

Which term is larger depends on the arithmetic intensity F/B against the machine's
ridge point peak_flops / mem_bandwidth (FLOP/byte): above the ridge compute-bound,
below it memory-bound. Decode (≈ 2 FLOP per weight byte in bf16, 0.5 in fp32) sits far
below any ridge; a long prefill far above.

    attainable FLOP/s
        |            ______________ peak_flops          compute-bound
        |           /
        |          /  slope = mem_bandwidth             memory-bound
        |         /
        |________/_______________ intensity (FLOP/byte)
                 ridge point

Peaks come from :data:`PROFILES` (vendor datasheets) or :func:`calibrate` (measured here).
Datasheet peaks are optimistic: boost clocks, ideal shapes, no other work. Real matmuls
reach roughly 70-80% of the FLOP/s and streaming copies 80-90% of the bandwidth, so a
roofline fraction of 0.7 against a datasheet already means "at the roof"; against a
calibrated profile (best-of measurements on this machine) the fraction is closer to 1.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from .costs import PhaseCost
from .device import resolve_device
from .paths import weights_dir
from .units import fmt_ms, fmt_num

OVERHEAD_FACTOR = 5.0  # measured time above this many floors: the hardware is not what limits it


@dataclass(frozen=True)
class HardwareProfile:
    """Peak compute and memory bandwidth of one device.

    Attributes:
        name: short name ("h100", "cpu (AMD EPYC)", ...).
        peak_flops: dense matmul peak, FLOP/s.
        mem_bandwidth: main-memory bandwidth, bytes/s.
        memory_bytes: memory capacity in bytes, or None when unknown.
        description: one line: what it is and where the numbers come from.
    """

    name: str
    peak_flops: float  # FLOP/s
    mem_bandwidth: float  # bytes/s
    memory_bytes: float | None = None
    description: str = ""

    @property
    def ridge_point(self) -> float:
        """peak_flops / mem_bandwidth, FLOP/byte: intensities above it are compute-bound."""
        return self.peak_flops / self.mem_bandwidth

    def __str__(self) -> str:
        return (f"{self.name}: {self.peak_flops / 1e12:.3g} TFLOP/s, {self.mem_bandwidth / 1e9:.4g} GB/s, "
                f"ridge {self.ridge_point:.1f} FLOP/byte")


# Datasheet peaks: dense (no 2:4 sparsity) bf16/fp16 tensor-core FLOP/s with fp32
# accumulate, and memory bandwidth. Datasheet peaks are optimistic: tuned matmuls
# reach ~70-80% of the FLOP/s and a copy ~80-90% of the bandwidth, so measured
# roofline fractions of 0.7 already mean "at the roof".
PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity
    # (989.4 dense), HBM3 3.35 TB/s, 80 GB.
    "h100": HardwareProfile("h100", 989.4e12, 3.35e12, 80e9, "NVIDIA H100 SXM5 80GB, datasheet bf16 dense"),
    # NVIDIA H200 datasheet (SXM): same Hopper compute as H100, HBM3e 4.8 TB/s, 141 GB.
    "h200": HardwareProfile("h200", 989.4e12, 4.8e12, 141e9, "NVIDIA H200 SXM 141GB, datasheet bf16 dense"),
    # NVIDIA A100 datasheet (80GB SXM4): BF16 312 TFLOPS dense, HBM2e 2,039 GB/s.
    "a100": HardwareProfile("a100", 312e12, 2.039e12, 80e9, "NVIDIA A100 SXM4 80GB, datasheet bf16 dense"),
    # NVIDIA L4 datasheet: BF16 242 TFLOPS with sparsity (121 dense), GDDR6 300 GB/s, 24 GB.
    "l4": HardwareProfile("l4", 121e12, 300e9, 24e9, "NVIDIA L4 24GB, datasheet bf16 dense"),
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: FP16/BF16 tensor with
    # FP32 accumulate 165.2 TFLOPS dense, GDDR6X 1,008 GB/s, 24 GB.
    "rtx4090": HardwareProfile("rtx4090", 165.2e12, 1.008e12, 24e9,
                               "NVIDIA GeForce RTX 4090, Ada whitepaper fp16/bf16 (fp32 accumulate)"),
    # Apple M2 Max press release (Jan 2023): 38-core GPU up to 13.6 TFLOPS (fp32; fp16 runs at
    # the same rate), 400 GB/s unified memory, up to 96 GB.
    "m2-max": HardwareProfile("m2-max", 13.6e12, 400e9, 96e9, "Apple M2 Max 38-core GPU, Apple press release"),
    # Not a datasheet: an order-of-magnitude 8-core laptop CPU. AVX2: 8 cores x 32 fp32
    # FLOP/cycle (2 FMA units x 8 lanes x 2) x ~3 GHz ≈ 0.77 TFLOP/s peak, ~0.5 reached; dual-channel
    # DDR5-5600 is 89.6 GB/s theoretical, ~60 GB/s reached. Run `minillm calibrate` for yours.
    "laptop-cpu": HardwareProfile("laptop-cpu", 0.5e12, 60e9, 16e9,
                                  "typical 8-core laptop CPU, fp32 (an estimate; calibrate yours)"),
}


# -- the roofline verdict -------------------------------------------------------------


@dataclass(frozen=True)
class Roofline:
    """A measured phase against the hardware's roofline.

    Attributes:
        time_s: the measured time (s).
        arithmetic_intensity: cost FLOPs / bytes (FLOP/byte).
        compute_floor_s: flops / peak_flops (s).
        memory_floor_s: bytes / mem_bandwidth (s).
        floor_s: max of both floors: no implementation can be faster (s).
        attained_flops: flops / time_s (FLOP/s).
        attained_bandwidth: bytes / time_s (bytes/s).
        roofline_fraction: floor_s / time_s; 1 means at the roof.
        bound: "compute-bound", "memory-bound" or "overhead-bound".
        explanation: one sentence saying why, with the numbers.
    """

    time_s: float
    arithmetic_intensity: float
    compute_floor_s: float
    memory_floor_s: float
    floor_s: float
    attained_flops: float
    attained_bandwidth: float
    roofline_fraction: float
    bound: str
    explanation: str


def roofline(cost: PhaseCost, time_s: float, hw: HardwareProfile) -> Roofline:
    """Place a phase that did ``cost`` in ``time_s`` seconds on ``hw``'s roofline.

    The verdict: the larger floor names the bound (compute or memory; compute when the
    two are equal, at the ridge point), unless the measured time exceeds
    OVERHEAD_FACTOR × floor_s: then neither arithmetic nor
    memory traffic explains the time and the phase is "overhead-bound" (Python,
    dispatch, kernel launches, small unfused ops, synchronisation).

    Raises ValueError for time_s <= 0.
    """
    if time_s <= 0:
        raise ValueError(f"time_s must be > 0, got {time_s}")
    compute_s = cost.flops / hw.peak_flops
    memory_s = cost.bytes / hw.mem_bandwidth
    floor_s = max(compute_s, memory_s)
    hw_bound = "compute-bound" if compute_s >= memory_s else "memory-bound"
    ratio = time_s / floor_s if floor_s else float("inf")
    bound = "overhead-bound" if ratio > OVERHEAD_FACTOR else hw_bound
    return Roofline(
        time_s=time_s,
        arithmetic_intensity=cost.arithmetic_intensity,
        compute_floor_s=compute_s,
        memory_floor_s=memory_s,
        floor_s=floor_s,
        attained_flops=cost.flops / time_s,
        attained_bandwidth=cost.bytes / time_s,
        roofline_fraction=floor_s / time_s,
        bound=bound,
        explanation=_explain(bound, hw_bound, cost, hw, time_s, compute_s, memory_s, ratio),
    )


def _explain(bound, hw_bound, cost, hw, time_s, compute_s, memory_s, ratio) -> str:
    ms = lambda s: fmt_ms(s * 1e3)  # noqa: E731  (never "1.84e+03 ms")
    side = "above" if hw_bound == "compute-bound" else "below"
    floors = (f"compute floor {ms(compute_s)}, memory floor {ms(memory_s)}; intensity "
              f"{fmt_num(cost.arithmetic_intensity)} FLOP/byte is {side} the ridge {fmt_num(hw.ridge_point)}")
    if bound == "overhead-bound":
        return (f"measured {ms(time_s)} is {ratio:.1f}x the {ms(max(compute_s, memory_s))} floor ({floors}): "
                "neither arithmetic nor memory traffic explains it; the time goes to overhead "
                "(Python, dispatch, kernel launches, small unfused ops)")
    limit = "arithmetic" if hw_bound == "compute-bound" else "moving bytes (weights and KV cache)"
    note = (" (faster than the floor: the peaks are underestimated or data came from cache)"
            if ratio < 1 else "")
    return f"{floors}: {limit} limits this phase; measured {ms(time_s)} is {ratio:.2f}x the floor{note}"


# -- calibration ----------------------------------------------------------------------


def calibrate(device="cpu", dtype=torch.float32, quick: bool = False) -> HardwareProfile:
    """Measure this device's peak matmul FLOP/s and memory bandwidth, and cache the result.

    - FLOP/s: a square n×n @ n×n matmul, 2·n³ FLOPs, best of several repetitions
      (n = 2048 on CPU, 8192 on GPUs; half with ``quick``).
    - bandwidth: ``dst.copy_(src)`` of a large buffer, counted as 2 × its size
      (read + write), best of several: the STREAM "copy" convention (McCalpin 1995).
      512 MiB (128 MiB with ``quick``), well above any CPU's last-level cache.

    CUDA work is synchronised before each clock read. Takes a few seconds
    (under a second with ``quick``). The result is stored in
    ``<weights_dir>/calibration.json`` under "<device>/<dtype>".

    Raises ValueError for an unknown device or dtype, and for the meta device (its tensors hold no data, so
    its timings would be of nothing).
    """
    dev = _device(device)
    if dev.type == "meta":
        raise ValueError("calibrate times real work, and the meta device does none; use cpu, cuda or mps")
    dtype = _dtype(dtype)
    on_gpu = dev.type != "cpu"
    n = (8192 if on_gpu else 2048) // (2 if quick else 1)
    n_bytes = (128 if quick else 512) * 2**20
    reps = 3 if quick else 5
    peak_flops = _measure_matmul(dev, dtype, n, reps)
    bandwidth = _measure_copy(dev, n_bytes, reps)
    profile = HardwareProfile(
        name=f"{dev} ({device_name(dev)})",
        peak_flops=peak_flops,
        mem_bandwidth=bandwidth,
        memory_bytes=_memory_bytes(dev),
        description=f"measured: {n}x{n} {_dtype_name(dtype)} matmul, {n_bytes >> 20} MiB copy, best of {reps}",
    )
    _save(dev, dtype, profile)
    return profile


def load_calibration(device="cpu", dtype=torch.float32) -> HardwareProfile | None:
    """The cached calibration of device + dtype, or None (never measured, or measured
    on different hardware sharing the same weights dir)."""
    entry = load_measurement(_key(_device(device), _dtype(dtype)), device)
    profile = None if entry is None else entry.get("profile")
    # A hand-edited or half-written entry is not trusted: it reads as never measured, so it is measured again.
    if not isinstance(profile, dict) or not all(_positive_number(profile.get(f)) for f in ("peak_flops", "mem_bandwidth")):
        return None
    try:
        return HardwareProfile(**profile)
    except TypeError:  # a field missing or unknown
        return None


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def get_hardware(device="cpu", dtype=torch.float32, calibrate_if_missing: bool = True) -> HardwareProfile:
    """The cached calibration of device + dtype, measured now if missing.

    Raises LookupError when missing and ``calibrate_if_missing`` is false.
    """
    profile = load_calibration(device, dtype)
    if profile is not None:
        return profile
    if not calibrate_if_missing:
        raise LookupError(f"no calibration for {device}/{_dtype_name(_dtype(dtype))}; run `minillm calibrate`")
    return calibrate(device, dtype)


def calibration_path() -> Path:
    """``<weights_dir>/calibration.json``: measured peaks, keyed by "<device>/<dtype>"."""
    return weights_dir() / "calibration.json"


def _measure_matmul(dev: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    """Best FLOP/s of an n×n @ n×n matmul (2·n³ FLOPs)."""
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    best = _best_time(lambda: torch.matmul(a, b, out=out), dev, reps)
    return 2.0 * n**3 / best


def _measure_copy(dev: torch.device, n_bytes: int, reps: int) -> float:
    """Best bytes/s of copying n_bytes (read n_bytes + write n_bytes)."""
    src = torch.ones(n_bytes // 4, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = _best_time(lambda: dst.copy_(src), dev, reps)
    return 2.0 * n_bytes / best


def _best_time(fn, dev: torch.device, reps: int) -> float:
    """Shortest wall time (s) of ``fn`` over reps runs, after one warm-up."""
    fn()
    _sync(dev)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - start)
    return best


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def _device(device) -> torch.device:
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _key(dev: torch.device, dtype: torch.dtype) -> str:
    return f"{dev}/{_dtype_name(dtype)}"


def device_name(dev: torch.device) -> str:
    """The hardware's model name, so a cache shared across machines is not misread."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "mps":
        return "Apple GPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes(dev: torch.device) -> float | None:
    if dev.type == "cuda":
        return float(torch.cuda.get_device_properties(dev).total_memory)
    return None


def _read_cache() -> dict:
    path = calibration_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    # Only an object of entries is a cache; anything else (a list, a number) is measured again and replaced.
    return cache if isinstance(cache, dict) else {}


def _save(dev: torch.device, dtype: torch.dtype, profile: HardwareProfile) -> None:
    save_measurement(_key(dev, dtype), dev, {"profile": asdict(profile)})


def load_measurement(key: str, device="cpu") -> dict | None:
    """The entry stored under ``key`` in calibration.json, or None (never measured, or measured
    on other hardware sharing the same weights dir). :mod:`minillm.fast.choose` keeps its measured choice here too."""
    entry = _read_cache().get(key)
    if not isinstance(entry, dict) or entry.get("device_name") != device_name(_device(device)):
        return None
    return entry


def save_measurement(key: str, device, fields: dict) -> None:
    """Store ``fields`` under ``key`` in calibration.json, stamped with the hardware, torch and the time."""
    dev = _device(device)
    path = calibration_path()
    cache = _read_cache()
    cache[key] = {
        "device_name": device_name(dev),
        "torch": torch.__version__,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **fields,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cache, indent=2))
    tmp.replace(path)
