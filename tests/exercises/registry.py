"""The exercises: what each one asks for, where its reference lives, which lesson explains it.

Each exercise ``exNN`` has three files with the same stem:

    lessons/exercises/exNN_name.py     the student's stub (same signatures and docstrings
                                        as the reference, bodies raise NotImplementedError)
    tests/exercises/test_exNN_name.py  its checks: functions ``test_*(impl)``, marked exNN
    minillm/...                         the reference implementation, named in ``refs``

A check receives ``impl``: a namespace holding the exercise's ``refs`` names, taken from
minillm (``--impl reference``, the default), from the student's file (``--impl student``)
or, in ``test_mistakes_are_caught.py``, from minillm with one deliberate mistake swapped in.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
STUBS_DIR = ROOT / "lessons" / "exercises"


@dataclass(frozen=True)
class Exercise:
    """One exercise.

    Attributes:
        id: "ex01" ... (also its pytest marker).
        title: a few words.
        stem: file stem of the stub and of its checks ("ex01_causal_mask").
        lesson: the lesson section the hints point at.
        refs: name in the exercise file -> minillm module holding the reference.
        written: what the student writes: functions, or ``Class.method`` overriding the
            reference class's method (the stub's class subclasses the reference).
    """

    id: str
    title: str
    stem: str
    lesson: str
    refs: dict[str, str]
    written: tuple[str, ...]

    @property
    def number(self) -> int:
        return int(self.id[2:])

    @property
    def file(self) -> str:
        return f"{self.stem}.py"

    @property
    def test_module(self) -> str:
        return f"exercises.test_{self.stem}"


EXERCISES = {ex.id: ex for ex in [
    Exercise("ex01", "causal mask", "ex01_causal_mask", "lessons/02-prefill-and-decode.md#the-causal-mask",
             {"causal_mask": "minillm.model"}, ("causal_mask",)),
    Exercise("ex02", "attention (eager)", "ex02_attention", "lessons/01-what-is-inference.md#attention",
             {"eager_attention": "minillm.model"}, ("eager_attention",)),
    Exercise("ex03", "RoPE at given positions", "ex03_rope", "lessons/01-what-is-inference.md#positions-rope",
             {"RotaryEmbedding": "minillm.rope", "apply_rope": "minillm.rope"},
             ("RotaryEmbedding.forward", "apply_rope")),
    Exercise("ex04", "grouped-query attention", "ex04_gqa", "lessons/03-kv-cache.md#grouped-query-attention",
             {"eager_attention": "minillm.model"}, ("eager_attention",)),
    Exercise("ex05", "KV cache write, read", "ex05_kv_cache", "lessons/03-kv-cache.md#writing-and-reading",
             {"KVCache": "minillm.kv_cache"}, ("KVCache.write", "KVCache.keys", "KVCache.values")),
    Exercise("ex06", "prefill", "ex06_prefill", "lessons/02-prefill-and-decode.md#prefill",
             {"prefill": "minillm.phases"}, ("prefill",)),
    Exercise("ex07", "decode step", "ex07_decode_step", "lessons/02-prefill-and-decode.md#decode",
             {"decode_step": "minillm.phases"}, ("decode_step",)),
    Exercise("ex08", "sampling", "ex08_sampling", "lessons/07-sampling.md",
             {"filter_logits": "minillm.sampling", "sample": "minillm.sampling"}, ("filter_logits", "sample")),
    Exercise("ex09", "TTFT, TPOT, throughput", "ex09_metrics", "lessons/06-metrics.md#ttft-and-tpot",
             {"RequestMetrics": "minillm.metrics"}, ("RequestMetrics.from_timestamps",)),
    Exercise("ex10", "KV bytes, decode cost", "ex10_costs",
             "lessons/05-compute-vs-memory-bound.md#arithmetic-intensity",
             {"kv_bytes_per_token": "minillm.costs", "decode_cost": "minillm.costs"},
             ("kv_bytes_per_token", "decode_cost")),
    Exercise("ex11", "prefix-cache hits", "ex11_prefix_cache", "lessons/08-prompt-caching.md#block-hashes",
             {"block_hashes": "minillm.block_hash", "longest_cached_prefix": "minillm.prefix_cache"},
             ("block_hashes", "longest_cached_prefix")),
    Exercise("ex12", "prefill cost, roofline verdict", "ex12_roofline", "lessons/05-compute-vs-memory-bound.md#the-roofline",
             {"prefill_cost": "minillm.costs", "roofline": "minillm.hardware"}, ("prefill_cost", "roofline")),
    Exercise("ex13", "percentiles, SLOs, goodput", "ex13_serving_metrics", "lessons/06-metrics.md#percentiles",
             {"percentile": "minillm.metrics", "slo_attainment": "minillm.metrics", "goodput": "minillm.metrics"},
             ("percentile", "slo_attainment", "goodput")),
    Exercise("ex14", "the generate loop", "ex14_generate", "lessons/02-prefill-and-decode.md#the-two-phases-at-a-glance",
             {"generate": "minillm.generate"}, ("generate",)),
    Exercise("ex15", "block allocator", "ex15_block_allocator", "lessons/11-serving.md#paged-kv-cache",
             {"blocks_needed": "minillm.serving.block_allocator", "slot_mapping": "minillm.serving.block_allocator",
              "BlockAllocator": "minillm.serving.block_allocator"},
             ("blocks_needed", "slot_mapping", "BlockAllocator.allocate_slots", "BlockAllocator.free_block",
              "BlockAllocator.free")),
    Exercise("ex16", "scheduler step", "ex16_scheduler", "lessons/11-serving.md#continuous-batching",
             {"Scheduler": "minillm.serving.scheduler"}, ("Scheduler.schedule",)),
    Exercise("ex17", "speculative verification", "ex17_speculative",
             "lessons/09-optimisations.md#speculative-decoding-one-step-at-a-time",
             {"residual_distribution": "minillm.speculative", "accept_or_resample": "minillm.speculative"},
             ("residual_distribution", "accept_or_resample")),
    Exercise("ex18", "int4 group quantisation", "ex18_int4_quant", "lessons/09-optimisations.md#weight-only-quantisation",
             {"quantize_int4": "minillm.quantize", "dequantize_int4": "minillm.quantize"},
             ("quantize_int4", "dequantize_int4")),
    Exercise("ex19", "K/V transfer vs prefill", "ex19_disaggregation", "lessons/10-disaggregation.md#when-splitting-pays-off",
             {"kv_transfer_seconds": "minillm.costs", "transfer_vs_prefill": "minillm.whatif"},
             ("kv_transfer_seconds", "transfer_vs_prefill")),
    Exercise("ex20", "speculative speed-up", "ex20_speculative_speedup",
             "lessons/09-optimisations.md#how-many-tokens-a-pass-makes",
             {"expected_tokens_per_pass": "minillm.speculative", "speculative_speedup": "minillm.speculative"},
             ("expected_tokens_per_pass", "speculative_speedup")),
    Exercise("ex21", "TP shards, all-reduce bytes", "ex21_tensor_parallel",
             "lessons/12-tensor-parallelism.md#the-megatron-split-of-one-layer",
             {"column_shard": "minillm.distributed.tensor_parallel", "row_shard": "minillm.distributed.tensor_parallel",
              "heads_of_rank": "minillm.distributed.tensor_parallel", "all_reduce_bytes_per_layer": "minillm.costs"},
             ("column_shard", "row_shard", "heads_of_rank", "all_reduce_bytes_per_layer")),
]}


def reference(ex: Exercise) -> SimpleNamespace:
    """The exercise's names, taken from minillm."""
    return SimpleNamespace(**{name: getattr(importlib.import_module(mod), name) for name, mod in ex.refs.items()})


def load_module(path: Path, name: str):
    """Import a Python file by path (a student's exercise file) as a fresh module."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def student(ex: Exercise, folder: Path) -> SimpleNamespace:
    """The exercise's names, taken from ``folder/<stem>.py``.

    Raises FileNotFoundError (no such file), AttributeError (a name is missing) or
    whatever importing the file raises.
    """
    path = Path(folder) / ex.file
    if not path.is_file():
        raise FileNotFoundError(f"no {ex.file} in {folder}")
    module = load_module(path, f"student_{ex.stem}")  # re-imported for every check: always the latest code
    missing = [name for name in ex.refs if not hasattr(module, name)]
    if missing:
        raise AttributeError(f"{path} defines no {', '.join(missing)} (keep the names of the stub)")
    return SimpleNamespace(**{name: getattr(module, name) for name in ex.refs})


@dataclass(frozen=True)
class StandIn:
    """A function ``fn`` standing in for ``replaces`` of ``exercise`` (a mistake, or a right answer written
    another way); ``mistakes.swap_in`` puts it in place."""

    exercise: str
    replaces: str
    fn: Callable

    @property
    def name(self) -> str:
        return self.fn.__name__


def stand_in(into: list, kind: type, exercise: str, replaces: str, **more):
    """A decorator appending ``kind(exercise, replaces, fn, **more)`` to ``into``; it returns fn unchanged."""
    def register(fn):
        into.append(kind(exercise, replaces, fn, **more))
        return fn

    return register
