"""Which decode path runs fastest on this machine: measured at first use, cached beside the calibration.

Why measure instead of choosing once: a batch-1 decode step multiplies one row vector by
every weight matrix, so its floor is reading the weights; but SmolLM2-135M's step also runs
~1,400 small PyTorch ops, each paying dispatch, and which kernels and layouts win differs
from CPU to CPU (issue 16):

- on the developers' 2-core AMD EPYC, linear()'s split product and the column-major
  "long rows" layout took a step from 43 to 36 ms;
- on an Intel Xeon (AVX-512, AMX) all four combinations took 41-45 ms, plain row-major
  ``F.linear`` as fast as any, while llama.cpp's F32 build of the same weights decoded in
  24-28 ms: there the gap is the dispatch of small ops, which ``torch.compile`` of the whole
  step (fused kernels, minillm/compile.py) attacks.

The candidates (every one gives the plain path's logits up to float rounding):

    name               pack_weights layout   linear()'s products        decode step
    long-rows+split    long_rows=True        split                      eager
    long-rows          long_rows=True        F.linear                   eager
    row-major+split    long_rows=False       split                      eager
    row-major          long_rows=False       F.linear                   eager: the plain path
    matvec             long_rows=False       the C kernel               eager
    compile            long_rows=False       F.linear                   torch.compile of the whole step
    compile+matvec     long_rows=False       the C kernel (an op)       over the static KV cache

(linear()'s products: :func:`minillm.model.linear`; on the "matvec" paths decode's attention runs in
C too, :func:`minillm.model.decode_attention_in_c`. The compiled steps fuse the ~1,400 small ops
around the products into a few loops; on the developers' AMD EPYC compile+matvec took a step
from 54-60 to 33-36 ms. The "matvec" ones need a C compiler: without one they are not measured.)

How :func:`use_best_decode_path` (called by ``load_model``) picks one:

1. the environment variable MINILLM_DECODE_PATH names a candidate: that one, nothing
   measured (how a user or a test forces a path; "auto", empty or unset: go on);
2. the choice cached in ``<weights_dir>/calibration.json`` for this CPU, thread count,
   dtype and model shape;
3. else the eager candidates are measured now (decode ms/step, a few seconds for
   SmolLM2-135M) and the fastest is cached. ``minillm calibrate --decode-path`` measures
   them all, the compiled ones included (compiling takes from seconds to minutes).

Only CPU float32 has candidates; other devices and dtypes keep ``pack_weights``' default
(path "default"). linear()'s products are a process-wide switch (like torch's thread count),
so the last model loaded sets them. A compiled step compiles once a process (inductor keeps the
code on disk, so a later process compiles faster). The choice
is measured at batch 1 (the issue's case); a serving engine's batch of decodes may prefer another.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .config import ModelConfig
from . import matvec_kernels
from .model import Transformer, use_products

ENV_VAR = "MINILLM_DECODE_PATH"


@dataclass(frozen=True)
class DecodePath:
    """One way to run decode steps: the weight layout, linear()'s products, compiled or eager."""

    name: str
    long_rows: bool
    products: str  # one of minillm.model.PRODUCTS
    compiled: bool = False


CANDIDATES = {p.name: p for p in (
    DecodePath("long-rows+split", long_rows=True, products="split"),
    DecodePath("long-rows", long_rows=True, products="linear"),
    DecodePath("row-major+split", long_rows=False, products="split"),
    DecodePath("row-major", long_rows=False, products="linear"),
    DecodePath("matvec", long_rows=False, products="matvec"),
    DecodePath("compile", long_rows=False, products="linear", compiled=True),
    DecodePath("compile+matvec", long_rows=False, products="matvec", compiled=True),
)}
PLAIN = "row-major"  # plain F.linear on nn.Linear's layout: the reference every candidate must equal
EAGER = tuple(name for name, p in CANDIDATES.items() if not p.compiled)  # measured at first use


@dataclass(frozen=True)
class DecodeChoice:
    """The path a model runs and why.

    Attributes:
        name: a key of CANDIDATES, or "default" (not CPU float32: nothing to choose).
        source: "forced" (MINILLM_DECODE_PATH), "cached", "measured" or "default".
        timings_ms: decode ms/step of each measured candidate (empty when none was measured here).
        load_average_1m: the machine's load when they were measured (a busy machine slows the
            two-thread split product most: re-measure quietly with ``minillm calibrate --decode-path``).
    """

    name: str
    source: str
    timings_ms: dict[str, float]
    load_average_1m: float | None = None

    def __str__(self) -> str:
        if not self.timings_ms:
            return f"{self.name} ({self.source})"
        times = ", ".join(f"{n} {ms:.1f}" for n, ms in sorted(self.timings_ms.items(), key=lambda kv: kv[1]))
        load = "" if self.load_average_1m is None else f"; load average {self.load_average_1m:.1f} when measured"
        return f"{self.name} ({self.source}; decode ms/step: {times}{load})"


def choose(timings_ms: dict[str, float]) -> str:
    """The fastest candidate; a tie goes to the one listed first in CANDIDATES.

    Raises ValueError for no timings or an unknown name.
    """
    if not timings_ms:
        raise ValueError("no decode timings to choose from; measure at least one candidate")
    unknown = sorted(set(timings_ms) - set(CANDIDATES))
    if unknown:
        raise ValueError(f"unknown decode paths {unknown}; known: {', '.join(CANDIDATES)}")
    order = list(CANDIDATES)
    return min(timings_ms, key=lambda name: (timings_ms[name], order.index(name)))


def apply_decode_path(model: Transformer, name: str) -> Transformer:
    """Run ``model``'s decode steps on the named candidate: repack its weights, set linear()'s
    products, and (for a compiled one) give :func:`~minillm.phases.decode_step` a compiled step.
    Sets ``model.decode_path``. Returns the model. Raises ValueError for an unknown name."""
    path = _candidate(name)
    model.pack_weights(long_rows=path.long_rows)
    use_products(path.products)
    model.compiled_decode = _compiled_step() if path.compiled else None
    model.decode_path = path.name
    return model


def use_best_decode_path(model: Transformer, measure: Callable | None = None) -> DecodeChoice:
    """Apply the forced, cached or (measured now) fastest decode path to ``model``; see the module
    docstring for the order. ``measure(model, names) -> {name: ms}`` replaces the timing (tests).

    Returns the :class:`DecodeChoice` (also kept as ``model.decode_choice``). Raises ValueError
    when MINILLM_DECODE_PATH names no candidate, or a compiled one where torch.compile finds no C++
    compiler (a cached compiled choice is then measured again, among the eager paths).
    """
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        model.pack_weights()
        model.compiled_decode, model.decode_path = None, "default"
        choice = DecodeChoice("default", "default", {})
    elif (forced := os.environ.get(ENV_VAR) or "auto") != "auto":  # set but empty: as unset, like other tools
        if _candidate(forced, f"{ENV_VAR}={forced!r}").compiled and (why := compile_unavailable()):
            raise ValueError(f"{ENV_VAR}={forced} cannot run here: {why}; install one (g++) or choose an eager "
                             f"path ({', '.join(EAGER)})")
        choice = DecodeChoice(forced, "forced", {})
    elif (cached := load_decode_choice(model.config)) is not None and not (
            CANDIDATES[cached.name].compiled and compile_unavailable()):  # (a compiler since removed: measure)
        choice = cached
    else:  # seconds on a quiet machine, minutes on a busy one: say why the first load waits
        warnings.warn("measuring the eager decode paths for this model on this machine (once, seconds when the "
                      "machine is quiet, minutes when busy; kept in calibration.json, `minillm calibrate "
                      "--decode-path` measures again)", stacklevel=2)
        choice = calibrate_decode_path(model, EAGER, measure)
    if choice.name != "default":
        apply_decode_path(model, choice.name)
    model.decode_choice = choice
    return choice


def calibrate_decode_path(model: Transformer, names=tuple(CANDIDATES), measure: Callable | None = None,
                          progress: Callable[[str], None] | None = None) -> DecodeChoice:
    """Measure the named candidates on ``model``, cache the fastest in calibration.json, apply it.

    ``measure(model, names) -> {name: ms}`` replaces :func:`measure_decode_paths` (tests).
    Returns the :class:`DecodeChoice` with every measured ms/step. The "matvec" candidates are
    left out when the C kernels cannot be built, the compiled ones when torch.compile has no C++
    compiler (:func:`compile_unavailable`).
    """
    measure = measure or (lambda m, n: measure_decode_paths(m, n, progress=progress))
    names = [n for n in names if (CANDIDATES[n].products != "matvec" or matvec_kernels.available())
             and not (CANDIDATES[n].compiled and compile_unavailable())]
    timings = measure(model, names)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    choice = DecodeChoice(choose(timings), "measured", dict(timings), load)
    from .hardware import save_measurement

    save_measurement(decode_key(model.config), "cpu",
                     {"chosen": choice.name, "timings_ms": choice.timings_ms, "load_average_1m": load})
    apply_decode_path(model, choice.name)
    return choice


def compile_unavailable() -> str | None:
    """Why ``torch.compile`` cannot build a CPU decode step here, or None: its inductor backend
    compiles the fused loops as C++ and needs a compiler (``$CXX``, else g++)."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except RuntimeError as error:  # torch._inductor.exc.InvalidCxxCompiler
        return f"torch.compile finds no C++ compiler ({str(error).splitlines()[0]})"
    return None


def load_decode_choice(config: ModelConfig) -> DecodeChoice | None:
    """The choice cached on this machine for a model of this config (CPU, float32), or None."""
    from .hardware import load_measurement

    entry = load_measurement(decode_key(config), "cpu")
    if entry is None or entry.get("chosen") not in CANDIDATES:
        return None
    return DecodeChoice(entry["chosen"], "cached", entry.get("timings_ms", {}), entry.get("load_average_1m"))


def decode_key(config: ModelConfig) -> str:
    """calibration.json's key of a choice: CPU float32, torch's thread count and the model's shape
    (what decides which path wins; the CPU's name is checked separately)."""
    c = config
    shape = f"{c.model_type}-L{c.n_layers}-d{c.d_model}-h{c.n_heads}-kv{c.n_kv_heads}-mlp{c.d_mlp}-V{c.vocab_size}"
    return f"decode_path/cpu/float32/threads{torch.get_num_threads()}/{shape}"


def measure_decode_paths(model: Transformer, names, rounds: int = 2, steps: int = 16, context: int = 64,
                         progress: Callable[[str], None] | None = None) -> dict[str, float]:
    """Decode ms/step of each named candidate on ``model``, batch 1, after ``context`` cached tokens.

    The candidates take turns for ``rounds`` rounds (a noisy machine slows them alike); each
    round's number is the median of ``steps`` timed steps after 3 untimed ones (a compiled
    step compiles in its first); a candidate's result is its best round.
    """
    from .kv_cache import KVCache
    from .phases import decode_step, prefill

    ids = torch.arange(context) % model.config.vocab_size
    best = {name: float("inf") for name in names}
    for _ in range(rounds):
        for name in names:
            if progress:
                progress(f"decode path {name}")
            apply_decode_path(model, name)
            cache = KVCache.for_model(model, max_seq_len=context + 3 + steps)
            token = prefill(model, ids, cache).argmax(-1)
            times = []
            for i in range(3 + steps):
                start = time.perf_counter()
                token = decode_step(model, token, cache).argmax(-1)
                times.append(time.perf_counter() - start)
            best[name] = min(best[name], statistics.median(times[3:]) * 1e3)
    return best


def _candidate(name: str, what: str = "decode path") -> DecodePath:
    if name not in CANDIDATES:
        raise ValueError(f"{what} is not a decode path; use one of {', '.join(CANDIDATES)} (or auto)")
    return CANDIDATES[name]


_compiled = None  # one compiled step per process: its graphs serve every model (dynamo guards on the inputs)


def _compiled_step():
    global _compiled
    if _compiled is None:
        from .compile import compile_decode_step

        _compiled = compile_decode_step("default")
    return _compiled
