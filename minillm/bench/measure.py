"""Running a benchmark: every engine on every case, interleaved, medians kept.

Method, so that a noisy machine affects every engine alike:

- every case (phase, length, batch) is run ``repeats`` times; within a repeat the
  engines take turns, in an order that rotates from repeat to repeat;
- a prefill case times prompt -> first token (TTFT) from an empty cache;
- a decode case fills the cache with the first length-1 prompt tokens once (untimed);
  each repeat cuts the cache back to that, feeds the last prompt token and times the
  gaps between the next ``decode_tokens`` tokens; TPOT is the median gap;
- a decode batch of B holds B copies of one prompt, so each engine prefills one row
  and copies its K/V to the others (a step costs the same whatever the rows hold, and
  the untimed set-up is B times shorter);
- each engine's number is the median over the repeats; the spread is kept too.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

import torch

from ..costs import decode_cost, prefill_cost, with_weights_bytes
from ..hardware import HardwareProfile, get_hardware, load_calibration, roofline
from ..model import Transformer
from .clock import Clock
from .engines import ENGINES, make_engines
from .memory import MEMORY_PROMPT_TOKENS, measure_peak_memory
from .results import BenchResult, Measurement
from .targets import beaten_floor_notes

REFERENCE = "transformers"  # the ratios column divides by this engine
NO_CACHE_POSITIONS = 2048  # no-cache decode: about this many positions per token-run, see _no_cache_tokens

# -- running ------------------------------------------------------------------------------


def run_bench(
    model: Transformer,
    prompt_lengths=(128, 512, 2048),
    context_lengths=(128, 1024),
    batch_sizes=(1, 8),
    repeats: int = 3,
    decode_tokens: int = 16,
    engines=ENGINES,
    compile_mode: str | None = None,
    hardware: HardwareProfile | None = None,
    hf_model=None,
    memory_tokens: int = 1024,
    model_name: str | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Measure prefill and decode of every engine, interleaved; see the module docstring.

    Args:
        model: a loaded minillm model (its ``source`` folder is what transformers loads).
        prompt_lengths: prefill cases, batch 1 (tokens).
        context_lengths: decode cases (tokens already in the cache), at every batch size.
        batch_sizes: decode batch sizes; no-cache decode is skipped where one token
            would re-run more than 2·NO_CACHE_POSITIONS positions.
        repeats: runs per case and engine (medians are reported).
        decode_tokens: tokens generated per decode run (>= 2); the no-cache engine makes fewer.
        engines: names from ENGINES and OPTIONAL_ENGINES ("llama.cpp" runs batch 1 only);
            ``compile_mode`` adds "minillm-compile".
        hardware: the peaks for the floors; default the calibration of the model's
            device and dtype (measured now if missing, a few seconds).
        hf_model: the transformers model (default: loaded from ``model.source``).
        memory_tokens: also measure the peak RSS of generating this many tokens in a
            fresh process (0: skip).
        seed: for the random prompt ids.
        progress: called with a short line before each step (the CLI prints them).

    Returns a :class:`BenchResult`. Raises ValueError for lengths < 2, repeats < 1 or
    decode_tokens < 2, or lengths beyond the model's context.
    """
    start = time.perf_counter()
    say = progress or (lambda line: None)
    validate_bench(model, prompt_lengths, context_lengths, batch_sizes, repeats, decode_tokens, memory_tokens)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    if hardware is None and load_calibration(device, dtype) is None:
        say(f"calibrating {device} in {str(dtype).removeprefix('torch.')} (first run; cached for the next)")
    hw = hardware or get_hardware(device, dtype)
    say("loading engines")
    n_ctx = max([*prompt_lengths, *(n + decode_tokens for n in context_lengths)]) + 1
    built, notes = make_engines(model, engines, hf_model, compile_mode, n_ctx=n_ctx)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size

    def prompt(batch, length):  # random ids: speed does not depend on what the tokens say
        return torch.randint(0, vocab, (batch, length), generator=gen).to(device)

    say("warming up")
    _warm_up(built, prompt(1, 16))

    measurements, tokens = [], {}  # tokens: id(measurement) -> the first repeat's greedy tokens
    for length in prompt_lengths:
        say(f"prefill {length} tokens")
        ids = prompt(1, length)
        runs = _interleave(built, repeats, lambda e: e.ttft(ids))
        for e in built:
            measurements.append(_prefill_measurement(model, hw, e.name, length, runs[e.name]))
            tokens[id(measurements[-1])] = runs[e.name][0].tokens
    for batch in batch_sizes:
        for length in context_lengths:
            say(f"decode at context {length}, batch {batch}")
            runs = _decode_case(built, prompt(1, length).repeat(batch, 1), repeats, decode_tokens, notes)
            for name, clocks in runs.items():
                measurements.append(_decode_measurement(model, hw, name, length, batch, clocks))
                tokens[id(measurements[-1])] = clocks[0].tokens
    _add_comparisons(measurements, tokens)
    notes += _no_cache_notes(built, context_lengths, decode_tokens)
    if getattr(model, "decode_choice", None) is not None:  # set by load_model (minillm/fast/choose.py)
        notes.append(f"minillm's decode path: {model.decode_choice}")
    notes += beaten_floor_notes(measurements, hw)

    memory = None
    if memory_tokens and getattr(model, "source", None) is None:
        notes.append("peak memory not measured: the model has no source folder to load in a fresh process")
    elif memory_tokens:
        say(f"peak memory of generating {memory_tokens} tokens (fresh process)")
        memory = measure_peak_memory(model, memory_tokens, MEMORY_PROMPT_TOKENS, threads=torch.get_num_threads())

    return BenchResult(
        model=model_name or str(getattr(model, "source", "model")),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        hardware=hw,
        weights_bytes=model.weights_bytes(),
        kv_bytes_per_token=model.config.kv_bytes_per_token(param.element_size()),
        repeats=repeats,
        measurements=measurements,
        memory=memory,
        notes=notes,
        versions=_versions(),
        wall_s=time.perf_counter() - start,
    )


def validate_bench(model, prompt_lengths, context_lengths, batch_sizes, repeats, decode_tokens,
                   memory_tokens: int = 0) -> None:
    """The checks :func:`run_bench` makes before any work; raises ValueError naming the bad value."""
    limit = model.config.max_seq_len
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if decode_tokens < 2:
        raise ValueError(f"decode_tokens must be >= 2 (TPOT needs two tokens), got {decode_tokens}")
    for length in prompt_lengths:
        if not 2 <= length <= limit - 1:
            raise ValueError(f"prompt length {length} must be in [2, {limit - 1}] (the model's context)")
    for length in context_lengths:
        if not 2 <= length <= limit - decode_tokens:
            raise ValueError(f"context length {length} + {decode_tokens} decode tokens must fit in [2, {limit}]")
    if any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if not 0 <= memory_tokens <= limit - MEMORY_PROMPT_TOKENS:
        raise ValueError(f"memory tokens must be in [0, {limit - MEMORY_PROMPT_TOKENS}] "
                         f"({MEMORY_PROMPT_TOKENS} prompt tokens + them fit the model's context), got {memory_tokens}")


def _warm_up(engines, ids: torch.Tensor) -> None:
    """One small untimed run per engine: first-call costs (allocator, kernels, compilation)."""
    for e in engines:
        e.ttft(ids)
        e.decode(ids, e.prepare_decode(ids, 4), 4)


def _interleave(engines, repeats: int, run) -> dict[str, list[Clock]]:
    """``run(engine)`` for every engine, ``repeats`` times, the order rotated each repeat."""
    clocks = {e.name: [] for e in engines}
    for r in range(repeats):
        k = r % max(len(engines), 1)
        for e in engines[k:] + engines[:k]:
            clocks[e.name].append(run(e))
    return clocks


def _decode_case(engines, ids: torch.Tensor, repeats: int, decode_tokens: int, notes: list) -> dict[str, list[Clock]]:
    """One decode case, ids [B, L]: each engine fills its cache once (untimed), then the
    engines take turns decoding from it. Returns the clocks per engine name."""
    batch, length = ids.shape
    active, plan = [], {}
    for e in engines:
        if batch > getattr(e, "max_batch_size", batch):
            notes.append(f"{e.name} decode skipped at batch {batch}: it runs batch {e.max_batch_size} here")
            continue
        n_new = _no_cache_tokens(batch, length, decode_tokens) if e.name == "no-cache" else decode_tokens
        if n_new is None:
            notes.append(f"no-cache decode skipped at batch {batch}, context {length}: each token "
                         f"would re-run {batch * length} positions")
            continue
        plan[e.name] = (e.prepare_decode(ids, n_new), n_new)
        if getattr(e, "compiled", False):
            e.decode(ids, plan[e.name][0], 2)  # this cache shape's compilation, untimed
        active.append(e)
    return _interleave(active, repeats, lambda e: e.decode(ids, *plan[e.name]))


def _no_cache_notes(engines, context_lengths, decode_tokens: int) -> list[str]:
    if "no-cache" not in [e.name for e in engines]:
        return []
    notes = []
    for length in context_lengths:
        short = _no_cache_tokens(1, length, decode_tokens)
        if short is not None and short < decode_tokens:
            notes.append(f"no-cache decode at context {length} made {short} tokens per run (not {decode_tokens}) "
                         f"to keep the run short; each costs a forward pass over ~{length} positions")
    return notes



def _no_cache_tokens(batch: int, length: int, decode_tokens: int) -> int | None:
    """How many tokens the no-cache engine makes per decode run: ~NO_CACHE_POSITIONS
    positions' worth, at least 2; None (skip) when one token alone re-runs more than twice that."""
    positions = batch * length
    if positions > 2 * NO_CACHE_POSITIONS:
        return None
    return max(2, min(decode_tokens, NO_CACHE_POSITIONS // positions))


def _prefill_measurement(model, hw, engine: str, length: int, clocks: list[Clock]) -> Measurement:
    times = [c.ttft_s for c in clocks]
    t = statistics.median(times)
    cost = with_weights_bytes(prefill_cost(model.config, length, next(model.parameters()).element_size()),
                              model.weights_bytes())  # a quantised model's bytes
    verdict = roofline(cost, t, hw)
    return Measurement(engine, "prefill", length, 1, t * 1e3, [x * 1e3 for x in times], length / t, 1,
                       verdict.floor_s * 1e3, verdict.roofline_fraction, verdict.bound)


def _decode_measurement(model, hw, engine: str, length: int, batch: int, clocks: list[Clock]) -> Measurement:
    times = [statistics.median(c.gaps_s) for c in clocks]
    t = statistics.median(times)
    n_new = len(clocks[0].times)
    # The timed steps attend to length+1 .. length+n_new-1 keys: cost at the middle one.
    cost = with_weights_bytes(decode_cost(model.config, length + n_new // 2, next(model.parameters()).element_size(),
                                          batch), model.weights_bytes())
    verdict = roofline(cost, t, hw)
    return Measurement(engine, "decode", length, batch, t * 1e3, [x * 1e3 for x in times], batch / t, n_new,
                       verdict.floor_s * 1e3, verdict.roofline_fraction, verdict.bound)


def _add_comparisons(measurements: list[Measurement], tokens: dict[int, list]) -> None:
    """Fill vs_reference (tok/s over transformers') and same_tokens (vs minillm-sdpa's greedy
    tokens; ``tokens`` maps id(measurement) to its [n][B] tokens)."""
    by_case = {}
    for m in measurements:
        by_case.setdefault((m.phase, m.length, m.batch_size), {})[m.engine] = m
    for case in by_case.values():
        ref, sdpa = case.get(REFERENCE), case.get("minillm-sdpa")
        for m in case.values():
            if ref is not None:
                m.vs_reference = m.tokens_per_s / ref.tokens_per_s
            if sdpa is not None and m is not sdpa:
                mine, theirs = tokens[id(m)], tokens[id(sdpa)]
                n = min(len(mine), len(theirs))  # the no-cache engine may make fewer
                m.same_tokens = mine[:n] == theirs[:n]


def _versions() -> dict:
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out
