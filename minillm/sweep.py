"""Latency sweeps: TTFT against prompt length, TPOT against context length.

    TTFT(prompt length P)   one prefill of P tokens + picking the first token
                            grows ~linearly in P: prefill is compute-bound
    TPOT(context length C)  one decode step whose new token attends to C positions
                            ~flat, then rising: every step reads all weights, plus
                            the KV cache, which grows with C

Decode time does not depend on what the cache holds, only on how much of it there
is, so the TPOT sweep does not prefill C real tokens first: it marks C - 1 positions
of a fresh (zero-filled) cache as filled and times decode steps on top. That keeps a
sweep to long contexts quick on a CPU.

Prompts are random token ids (the content does not change the cost either).
Each point is the median of several runs, after one warm-up pass.
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from .costs import decode_cost, prefill_cost, with_weights_bytes
from .kv_cache import KVCache
from .phases import decode_step, prefill
from .trace import synchronize

DEFAULT_PROMPT_LENGTHS = (16, 64, 128, 256)
DEFAULT_CONTEXT_LENGTHS = (128, 1024, 2048, 4096)


@dataclass
class SweepResult:
    """Measured latencies (ms) and, given a hardware profile, their roofline floors (ms).

    Attributes:
        prompt_lengths, ttft_ms: TTFT per prompt length (median of ``repeats``).
        context_lengths, tpot_ms: decode step time per context length (median of ``decode_steps``).
        ttft_floor_ms, tpot_floor_ms: max(FLOPs / peak, bytes / bandwidth) per point, or [] without hardware.
        model, device, dtype, hardware: what was measured.
    """

    model: str
    device: str
    dtype: str
    prompt_lengths: list[int]
    ttft_ms: list[float]
    context_lengths: list[int]
    tpot_ms: list[float]
    ttft_floor_ms: list[float] = field(default_factory=list)
    tpot_floor_ms: list[float] = field(default_factory=list)
    hardware: str | None = None

    def to_json(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    def to_csv(self, path) -> Path:
        """Rows: measurement ("ttft" | "tpot"), tokens (prompt or context length), ms, floor_ms."""
        path = Path(path)
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["measurement", "tokens", "ms", "floor_ms"])
            for name, lengths, ms, floors in (("ttft", self.prompt_lengths, self.ttft_ms, self.ttft_floor_ms),
                                              ("tpot", self.context_lengths, self.tpot_ms, self.tpot_floor_ms)):
                for i, (n, t) in enumerate(zip(lengths, ms)):
                    w.writerow([name, n, f"{t:.4f}", f"{floors[i]:.4f}" if floors else ""])
        return path


def warm_up(model, n_tokens: int) -> float:
    """One prefill of ``n_tokens`` random ids and one decode step into a scratch cache; returns ms.

    The first passes of a process pay one-time costs that are not inference: the first
    touch of the weights' memory (a checkpoint read through mmap is paged in lazily),
    kernel selection, allocator growth. Serving engines warm up before taking requests;
    measure after this.
    """
    start = time.perf_counter()
    n_tokens = max(1, min(n_tokens, model.config.max_seq_len - 1))
    cache = KVCache.for_model(model, max_seq_len=n_tokens + 1)
    ids = torch.randint(0, model.config.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(0))
    token = prefill(model, ids, cache).argmax(dim=-1)
    decode_step(model, token, cache).argmax(dim=-1).item()
    return (time.perf_counter() - start) * 1e3


def measure_ttft_ms(model, n_tokens: int, repeats: int = 3, seed: int = 0) -> float:
    """Median ms of prefilling ``n_tokens`` random ids into a fresh cache and taking the argmax."""
    ids = torch.randint(0, model.config.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(seed))
    times = []
    for _ in range(repeats):
        cache = KVCache.for_model(model, max_seq_len=n_tokens)
        device = cache.k.device
        synchronize(device)
        start = time.perf_counter()
        prefill(model, ids, cache).argmax(dim=-1).item()  # .item(): the token is really known
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_tpot_ms(model, context_len: int, decode_steps: int = 3) -> float:
    """Median ms of a decode step attending to ~``context_len`` positions (see the module docstring)."""
    cache = KVCache.for_model(model, max_seq_len=context_len + decode_steps)
    cache.advance(context_len - 1)  # filled with zeros: the cost is the same as with real K/V
    token = torch.zeros(1, dtype=torch.long)
    times = []
    for _ in range(decode_steps):
        synchronize(cache.k.device)
        start = time.perf_counter()
        token = decode_step(model, token, cache).argmax(dim=-1)
        token.item()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def sweep(
    model,
    prompt_lengths=DEFAULT_PROMPT_LENGTHS,
    context_lengths=DEFAULT_CONTEXT_LENGTHS,
    repeats: int = 3,
    decode_steps: int = 3,
    hw=None,
    name: str = "",
    progress: bool = False,
) -> SweepResult:
    """Measure TTFT per prompt length and TPOT per context length (ms).

    ``hw`` (a :class:`~minillm.hardware.HardwareProfile`) adds the roofline floor of each point.
    ``progress``: a progress bar over the points on stderr while measuring (drawn only
    when stderr is a terminal, and erased at the end).
    Raises ValueError for a length < 1 or beyond the model's context.
    """
    limit = model.config.max_seq_len
    for n in [*prompt_lengths, *context_lengths]:
        if not 1 <= n <= limit - decode_steps:
            raise ValueError(f"sweep lengths must be in [1, {limit - decode_steps}] (the model's context), got {n}")
    ttft, tpot = [], []
    console = Console(stderr=True)  # off on a pipe: rich would still end its bar with a blank line there
    with Progress(console=console, disable=not (progress and console.is_terminal), transient=True) as bar:
        task = bar.add_task("warm-up", total=1 + len(prompt_lengths) + len(context_lengths))
        warm_up(model, max(prompt_lengths))
        for n in prompt_lengths:
            bar.update(task, advance=1, description=f"TTFT, prompt of {n} tokens")
            ttft.append(measure_ttft_ms(model, n, repeats))
        for c in context_lengths:
            bar.update(task, advance=1, description=f"TPOT, context of {c} tokens")
            tpot.append(measure_tpot_ms(model, c, decode_steps))
    param = next(model.parameters())
    result = SweepResult(name, str(param.device), str(param.dtype).removeprefix("torch."),
                         list(prompt_lengths), ttft, list(context_lengths), tpot)
    if hw is not None:
        b = param.element_size()
        floor = lambda cost: max(cost.flops / hw.peak_flops, cost.bytes / hw.mem_bandwidth) * 1e3  # noqa: E731
        w = model.weights_bytes()  # a quantised model's int8/int4 bytes
        result.ttft_floor_ms = [floor(with_weights_bytes(prefill_cost(model.config, n, b), w)) for n in prompt_lengths]
        result.tpot_floor_ms = [floor(with_weights_bytes(decode_cost(model.config, c, b), w)) for c in context_lengths]
        result.hardware = hw.name
    return result
