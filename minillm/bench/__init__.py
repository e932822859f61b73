"""Benchmarks: minillm next to transformers, llama.cpp, a no-KV-cache baseline and the hardware's floors.

All engines greedy, on the same weights, in the same process; one module per concept:

    clock.py      Clock: when each token arrived (what every engine's calls return)
    engines.py    the engines, each behind ttft / prepare_decode / decode
    llama_cpp.py  the optional llama.cpp engine (llama-cpp-python on an F32 GGUF of the same weights)
    measure.py    run_bench: every engine on every case, interleaved, medians kept
    results.py    Measurement, MemoryReport, TargetCheck, BenchResult
    targets.py    the benchmark issue's targets checked against the numbers
    memory.py     peak RSS of generating, in a fresh process
    render.py     the rich table, markdown for BENCHMARKS.md, JSON, the plot

The serving benchmark (``minillm bench-serving``), on the batching engine of :mod:`minillm.serving`:

    serving.py         one workload through one-at-a-time, static and continuous batching, measured
    workload.py        seeded Poisson arrivals, prompt and output lengths
    http_client.py     the same workload sent to a server over HTTP, timed on the client
    metrics_scrape.py  a server's own latencies from two /metrics scrapes (before/after a run)
    peers.py           the peers (vLLM's CPU build, llama-server, transformers) started as servers for it
    transformers_cb_server.py  transformers' continuous batching behind /v1/completions (token ids, ignore_eos)

The floors come from the cost model (:mod:`minillm.costs`) and the calibrated peaks
(:func:`minillm.hardware.get_hardware`), via :func:`minillm.hardware.roofline`:

    prefill floor = FLOPs / peak FLOP/s                            (compute-bound)
    decode floor  = (weights + KV read + KV written) bytes / GB/s   (memory-bound)

``floor_fraction`` = floor / measured time: 1.0 would be at the roof.
"""

from .clock import Clock
from .engines import ENGINES, OPTIONAL_ENGINES, MiniLLMEngine, NoCacheEngine, TransformersEngine, load_transformers, make_engines
from .measure import REFERENCE, run_bench, validate_bench
from .memory import measure_peak_memory
from .render import COLUMNS, machine_line, memory_line, plot, rich_table, table_rows, targets_rich_table, to_json, to_markdown
from .results import BenchResult, Measurement, MemoryReport, TargetCheck
from .targets import BEATEN_FLOOR, beaten_floor_notes, cache_slowdowns, check_targets

_beaten_floor_notes = beaten_floor_notes  # the name tests and notebooks used before the split

__all__ = [
    "ENGINES", "OPTIONAL_ENGINES", "REFERENCE", "BEATEN_FLOOR", "COLUMNS",
    "Clock", "MiniLLMEngine", "NoCacheEngine", "TransformersEngine", "load_transformers", "make_engines",
    "run_bench", "validate_bench", "measure_peak_memory",
    "machine_line", "memory_line", "plot", "rich_table", "table_rows", "targets_rich_table", "to_json", "to_markdown",
    "BenchResult", "Measurement", "MemoryReport", "TargetCheck",
    "beaten_floor_notes", "cache_slowdowns", "check_targets",
]
