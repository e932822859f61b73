"""Peak resident memory of generating, measured in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from ..kv_cache import KVCache
from ..model import Transformer
from .results import MemoryReport

MEMORY_OVERHEAD_BYTES = 300 * 10**6  # the memory target: weights + KV cache + this
MEMORY_PROMPT_TOKENS = 16  # the prompt of the peak-memory run

def measure_peak_memory(model: Transformer, n_tokens: int = 1024, prompt_tokens: int = MEMORY_PROMPT_TOKENS,
                        threads: int | None = None) -> MemoryReport:
    """Peak RSS of generating n_tokens greedily with ``generate``, in a fresh Python process.

    A fresh process, so that nothing this one loaded (transformers, other engines)
    is counted; the child loads the model as ``model`` was (device, dtype, quantisation).
    Raises RuntimeError if the child fails.
    """
    param = next(model.parameters())
    args = dict(source=str(model.source), n_tokens=n_tokens, prompt_tokens=prompt_tokens,
                device=str(param.device), dtype=str(param.dtype).removeprefix("torch."), threads=threads,
                quantize=getattr(model, "quantization", None))
    code = f"from minillm.bench.memory import _peak_memory_child; _peak_memory_child(**{args!r})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"peak-memory child failed: {r.stderr.strip().splitlines()[-1:]}")
    return MemoryReport(**json.loads(r.stdout.strip().splitlines()[-1]))


def _peak_memory_child(source, n_tokens, prompt_tokens, device, dtype, threads=None, quantize=None) -> None:
    """Runs in the child process: load, reset the peak counter, generate, print a JSON MemoryReport."""
    from ..generate import generate
    from ..loading import load_model
    from ..sampling import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    import_rss = _rss_bytes("VmRSS")
    model = load_model(source, device=device, dtype=dtype, quantize=quantize)
    cache = KVCache.for_model(model, max_seq_len=prompt_tokens + n_tokens)
    load_peak = _rss_bytes("VmHWM")  # (not ru_maxrss: Linux carries that over from the parent across fork + exec)
    reset = _reset_peak_rss()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(0))
    for _ in generate(model, ids, SamplingParams(max_new_tokens=n_tokens), cache=cache, eos_token_ids=[]):
        pass
    if reset:
        generate_peak = _rss_bytes("VmHWM")
        process_peak = max(load_peak, generate_peak)
    else:  # no /proc (macOS): only the whole process's peak is known (ru_maxrss: bytes there)
        import resource

        generate_peak = process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    weights, kv = model.weights_bytes(), cache.bytes_capacity
    print(json.dumps(dict(
        n_tokens=n_tokens, prompt_tokens=prompt_tokens, weights_bytes=weights, kv_cache_bytes=kv,
        import_rss_bytes=import_rss, process_peak_bytes=process_peak, generate_peak_bytes=generate_peak,
        budget_bytes=weights + kv + MEMORY_OVERHEAD_BYTES,
        device_peak_bytes=torch.cuda.max_memory_allocated() if device.startswith("cuda") else None,
    )))


def _rss_bytes(field_name: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process from /proc/self/status, bytes (0 if unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _rss_bytes("VmHWM") > 0
    except OSError:
        return False
