"""Which decode path a model runs: chosen by rule when it loads, measured only when a user asks.

The candidates (every one gives the plain path's logits up to float rounding):

    name               weights layout        products (minillm.fast.products)   decode step
    long-rows+split    long_rows=True        SplitLinear                        eager
    long-rows          long_rows=True        nn.Linear (F.linear)               eager
    row-major+split    long_rows=False       SplitLinear                        eager
    row-major          long_rows=False       nn.Linear                          eager
    matvec             long_rows=False       MatvecLinear (C), attention in C   eager
    replay             long_rows=False       MatvecLinear (C), attention in C   the same C calls replayed on fixed
                                                                                buffers (minillm.fast.replay)
    compile            long_rows=False       nn.Linear                          torch.compile of the whole step
    compile+matvec     long_rows=False       MatvecLinear (C), attention in C   over the static KV cache

Every path stacks q|k|v and gate|up (:mod:`minillm.fast.packing`); which modules each path swaps in, and
when: the table of :mod:`minillm.fast` (``SWAPS``, tested against :func:`apply_decode_path`).

Why several: a batch-1 decode step's floor is reading the weights, but SmolLM2-135M's step also runs
~1,400 small PyTorch ops, and which kernels and layouts win differs from CPU to CPU (issue 16): on the
developers' 2-core AMD EPYC the C products took a step from 101.7 (row-major) to 64.4 ms, the compiled
C step to 38.8 ms; on an Intel Xeon (AVX-512) plain row-major ``F.linear`` was as fast as any eager path.

How :func:`choose_decode_path` (called by ``load_model``) picks one, without timing anything:

1. the environment variable MINILLM_DECODE_PATH names a candidate: that one (how a user or a
   test forces a path; "auto", empty or unset: go on);
2. the choice ``minillm calibrate --decode-path`` measured and cached in
   ``<weights_dir>/calibration.json`` for this CPU, thread count, dtype and model shape;
3. the rule: "replay" where the C kernels build (a C compiler), else "row-major+split" (in bfloat16 the
   default path). The replayed step gives the eager "matvec" step's logits bit for bit without the Python
   between its kernels: SmolLM2-135M on the developers' AMD EPYC, bfloat16 16.6-16.9 -> 10.1-10.4 ms a step,
   float32 21.3-22.1 -> 15.3-15.9, int8 15.6-15.8 -> 10.1-10.2 (BENCHMARKS.md, "A decode step replayed").

CPU float32 has every candidate; CPU bfloat16, int8 and int4 three, C_CANDIDATES: their products in C (on the
matrix units where the CPU has them), eager, replayed, or in a compiled step that calls the same C as torch ops
and fuses what lies between them: a SmolLM2-135M bfloat16 step took 14.6-15.1 against 20.0-20.8 ms eagerly on
the Intel Xeon (BENCHMARKS.md, "A compiled decode step in bfloat16, int8 and int4"). Other devices and dtypes get
the stacked products and the default layout (path "default"). Which kernel a product of a few rows runs:
:func:`minillm.fast.products.few_rows_kernel`, 1-3 float32 rows by :func:`few_rows_in_c`. A compiled step
compiles in the first decode step of a process (inductor keeps the code on disk, so a later process compiles
faster).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ModelConfig
from ..hardware import device_name, load_measurement, save_measurement
from ..kv_cache import KVCache
from ..model import SwiGLU, Transformer
from ..phases import decode_step, prefill
from ..quantize import QuantizedLinear
from . import kernels
from .attention import FastAttention, c_decode_fits, c_kernels_fit, bf16_prefill_fits
from .block import FastBlock
from .compile import compile_decode_step
from .packing import PackedSwiGLU, Stack, product_modules, relayout
from .paged_attention import use_fast_paged_attention
from .products import LINEARS, MatvecLinear, swap_class
from .replay import ReplayedDecodeStep
from .replay_serving import ReplayedServingStep

ENV_VAR = "MINILLM_DECODE_PATH"


@dataclass(frozen=True)
class DecodePath:
    """One way to run decode steps: the weight layout, the products, and the step: eager, compiled, or
    replayed (:mod:`minillm.fast.replay`)."""

    name: str
    long_rows: bool
    products: str  # a key of minillm.fast.products.LINEARS
    compiled: bool = False
    replayed: bool = False


CANDIDATES = {p.name: p for p in (
    DecodePath("long-rows+split", long_rows=True, products="split"),
    DecodePath("long-rows", long_rows=True, products="linear"),
    DecodePath("row-major+split", long_rows=False, products="split"),
    DecodePath("row-major", long_rows=False, products="linear"),
    DecodePath("matvec", long_rows=False, products="matvec"),
    DecodePath("replay", long_rows=False, products="matvec", replayed=True),
    DecodePath("compile", long_rows=False, products="linear", compiled=True),
    DecodePath("compile+matvec", long_rows=False, products="matvec", compiled=True),
)}
PLAIN = "row-major"  # plain F.linear on nn.Linear's layout: the reference every candidate must equal
EAGER = tuple(name for name, p in CANDIDATES.items() if not p.compiled)
# bfloat16's and the quantised formats' candidates: their products in C (on the matrix units where the CPU has
# them), eager or in a compiled step. The other candidates differ only in how float32 weights are laid out and
# multiplied; F.linear's one-row bfloat16 product took 1.4-1.7x the C's time (BENCHMARKS.md, "Decode products:
# PyTorch against the C").
C_CANDIDATES = ("matvec", "replay", "compile+matvec")


def precision_of(model: Transformer) -> str:
    """What a decode step's products read: the quantised format ("int8", "int4") where the matrices are
    quantised (:mod:`minillm.quantize`), else the weights' dtype ("float32", "bfloat16", ...)."""
    formats = {m.fmt for m in model.modules() if isinstance(m, QuantizedLinear)}
    return formats.pop() if len(formats) == 1 else _name(model.embed.weight.dtype)


def candidates_for(precision: str) -> tuple[str, ...]:
    """The decode paths measured and allowed for a CPU model of this :func:`precision_of`: every one in float32,
    C_CANDIDATES in bfloat16, int8 and int4, none otherwise (the default path runs)."""
    return tuple(CANDIDATES) if precision == "float32" else C_CANDIDATES if precision in (
        "bfloat16", "int8", "int4") else ()


@dataclass(frozen=True)
class DecodeChoice:
    """The path a model runs and why.

    Attributes:
        name: a key of CANDIDATES, or "default" (not CPU float32: nothing to choose).
        source: "forced" (MINILLM_DECODE_PATH), "cached" (measured earlier by calibrate), "rule",
            "measured" (now, by calibrate) or "default".
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
    """Run ``model``'s decode steps on the named candidate (or "default"): swap in the faster modules
    (same parameters), lay the weights out, and (for a compiled one) give
    :func:`~minillm.phases.decode_step` a compiled step. Sets ``model.decode_path``. Returns the model.
    Raises ValueError for an unknown name."""
    path = _default_path(model) if name == "default" else _candidate(name)
    linear_cls = LINEARS[path.products]
    c_decode = path.products == "matvec" and c_decode_fits(model)
    c_prefill = c_decode and model.config.head_dim % kernels.panel_width() == 0
    c_norms = path.products == "matvec" and c_kernels_fit(model)
    bf16_prefill = c_norms and bf16_prefill_fits(model)
    tied = model.lm_head.weight is model.embed.weight if hasattr(model.lm_head, "weight") else False
    originals = {id(p): p for p in model.parameters()}  # (holding them keeps their ids unique)
    for block in model.blocks:
        if c_norms:  # (the C kernels' paths: the norms in C too, float32 or bfloat16)
            swap_class(block, FastBlock)
        attn, mlp = swap_class(block.attn, FastAttention), block.mlp
        attn.qkv = Stack(attn, ("q_proj", "k_proj", "v_proj"), linear_cls, path.long_rows)
        attn.c_decode, attn.c_prefill, attn.c_rope = c_decode, c_prefill, c_norms
        attn.bf16_prefill = bf16_prefill
        relayout(attn.o_proj, linear_cls, path.long_rows)
        if isinstance(mlp, SwiGLU):
            swap_class(mlp, PackedSwiGLU).gate_up = Stack(mlp, ("gate_proj", "up_proj"), linear_cls, path.long_rows)
        else:
            relayout(mlp.up_proj, linear_cls, path.long_rows)
        relayout(mlp.down_proj, linear_cls, path.long_rows)
    relayout(model.lm_head, linear_cls, path.long_rows)  # the LM head is the largest matrix of a small model
    if tied:
        model.embed.weight = model.lm_head.weight  # looking up rows of a column-major table works alike
    for module in model.modules():  # the rest (norms, an untied embedding) gets its own memory too, so
        for param_name, p in list(module.named_parameters(recurse=False)):  # nothing pins a mapped file
            if id(p) in originals:
                setattr(module, param_name, torch.nn.Parameter(p.detach().clone(), requires_grad=False))
    c_few_rows = few_rows_in_c()
    for module in product_modules(model):
        if isinstance(module, MatvecLinear):
            module.few_rows_in_c = c_few_rows
    model.compiled_decode = _compiled_step() if path.compiled else ReplayedDecodeStep() if path.replayed else None
    model.replayed_batch = ReplayedServingStep() if path.replayed else None  # a server's steps of decodes only
    use_fast_paged_attention(model)  # the serving engine's decodes: attention over the pool's blocks in C
    model.decode_path = path.name
    return model


def choose_decode_path(model: Transformer) -> DecodeChoice:
    """Apply the forced, cached or rule's decode path to ``model`` (see the module docstring); times nothing.

    Returns the :class:`DecodeChoice` (also kept as ``model.decode_choice``). Raises ValueError
    when MINILLM_DECODE_PATH names no candidate (for a model in bfloat16, int8 or int4: none of
    C_CANDIDATES), or a compiled one where torch.compile finds no C++ compiler.
    """
    precision = precision_of(model)
    allowed = candidates_for(precision) if model.embed.weight.device.type == "cpu" else ()
    if not allowed:
        choice = DecodeChoice("default", "default", {})
    elif (forced := os.environ.get(ENV_VAR) or "auto") != "auto":  # set but empty: as unset, like other tools
        _check_forced(forced, allowed, precision)
        choice = DecodeChoice(forced, "forced", {})
    elif (cached := load_decode_choice(model.config, precision)) is not None and _runs_here(cached.name):
        choice = cached
    elif kernels.available():
        choice = DecodeChoice("replay", "rule", {})
    else:
        choice = DecodeChoice("default" if precision == "bfloat16" else "row-major+split", "rule", {})
    apply_decode_path(model, choice.name)
    model.decode_choice = choice
    return choice


def _check_forced(name: str, allowed: tuple[str, ...], precision: str) -> None:
    """One line when MINILLM_DECODE_PATH=name is no candidate for this precision, or cannot run here."""
    if name not in allowed:
        raise ValueError(f"{ENV_VAR}={name!r} is not a decode path for a model in {precision}; use one of "
                         f"{', '.join(allowed)} (or auto)")
    if CANDIDATES[name].compiled and (why := compile_unavailable()):
        eager = [n for n in allowed if not CANDIDATES[n].compiled]
        raise ValueError(f"{ENV_VAR}={name} cannot run here: {why}; install one (g++) or choose an eager "
                         f"path ({', '.join(eager)})")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def few_rows_in_c(cpu_name: str | None = None) -> bool:
    """Whether a float32 product of 1-3 rows (a batch-1 decode step's, a short verify pass's) runs the C loop
    (:func:`minillm.fast.kernels.f32_matvec`) rather than PyTorch's ``F.linear``: on an AMD CPU, not elsewhere.

    Measured (BENCHMARKS.md, "Decode products: PyTorch against the C" and "Decode paths against the lesson"):
    on the Intel Xeon (AVX-512) MKL's product of 1-3 rows streams the weights at the memory's speed and the
    C loop took 1.02-1.15x its time (2026-12-05, four rows of weights a tile; 1.19-1.34x row by row before);
    on the developers' AMD EPYC the row-by-row C loop took a SmolLM2-135M step from 101.7 to 64.4 ms
    (BENCHMARKS-HISTORY.md, issue 16): torch's MKL runs its generic code on a CPU that is not Intel's. Elsewhere
    (Intel, ARM, unknown) ``F.linear`` keeps the lesson's own product, so the default decode is never slower
    than ``--no-fast`` there by construction. The same rule sends 3-8 bfloat16 rows to the C loop
    (:func:`~minillm.fast.products.few_rows_kernel`). ``cpu_name``: the CPU's model name (default: this machine's,
    :func:`minillm.hardware.device_name`).
    """
    name = device_name(torch.device("cpu")) if cpu_name is None else cpu_name
    return "AMD" in name.split()


def calibrate_decode_path(model: Transformer, names=None, measure: Callable | None = None,
                          progress: Callable[[str], None] | None = None) -> DecodeChoice:
    """Measure the named candidates on ``model`` (default: every one for its precision, :func:`candidates_for`),
    cache the fastest in calibration.json, apply it.

    ``measure(model, names) -> {name: ms}`` replaces :func:`measure_decode_paths` (tests).
    Returns the :class:`DecodeChoice` with every measured ms/step. The "matvec" candidates are
    left out when the C kernels cannot be built, the compiled ones when torch.compile has no C++
    compiler (:func:`compile_unavailable`). Raises ValueError for a model that is not on the CPU in
    float32, bfloat16, int8 or int4.
    """
    precision, device = precision_of(model), model.embed.weight.device.type
    allowed = candidates_for(precision) if device == "cpu" else ()
    if not allowed:
        raise ValueError(f"decode paths are measured on the CPU in float32, bfloat16, int8 or int4, got {precision} "
                         f"on {device}; load the model with device='cpu' and one of those")
    measure = measure or (lambda m, n: measure_decode_paths(m, n, progress=progress))
    names = [n for n in (allowed if names is None else names)
             if (CANDIDATES[n].products != "matvec" or kernels.available())
             and not (CANDIDATES[n].compiled and compile_unavailable())]
    timings = measure(model, names)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    choice = DecodeChoice(choose(timings), "measured", dict(timings), load)
    save_measurement(decode_key(model.config, precision), "cpu",
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


def load_decode_choice(config: ModelConfig, precision: str = "float32") -> DecodeChoice | None:
    """The choice cached on this machine for a model of this config on the CPU in this :func:`precision_of`,
    or None."""
    entry = load_measurement(decode_key(config, precision), "cpu")
    if entry is None or entry.get("chosen") not in candidates_for(precision):
        return None  # (nothing kept, or a hand-edited entry naming no candidate of this precision)
    return DecodeChoice(entry["chosen"], "cached", entry.get("timings_ms", {}), entry.get("load_average_1m"))


def decode_key(config: ModelConfig, precision: str = "float32") -> str:
    """calibration.json's key of a choice: the CPU, the precision (:func:`precision_of`), torch's thread count and
    the model's shape (what decides which path wins; the CPU's name is checked separately)."""
    c = config
    shape = f"{c.model_type}-L{c.n_layers}-d{c.d_model}-h{c.n_heads}-kv{c.n_kv_heads}-mlp{c.d_mlp}-V{c.vocab_size}"
    return f"decode_path/cpu/{precision}/threads{torch.get_num_threads()}/{shape}"


def measure_decode_paths(model: Transformer, names, rounds: int = 2, steps: int = 16, context: int = 64,
                         progress: Callable[[str], None] | None = None) -> dict[str, float]:
    """Decode ms/step of each named candidate on ``model``, batch 1, after ``context`` cached tokens.

    The candidates take turns for ``rounds`` rounds (a noisy machine slows them alike); each
    round's number is the median of ``steps`` timed steps after 3 untimed ones (a compiled
    step compiles in its first); a candidate's result is its best round.
    """
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


def _candidate(name: str, what: str | None = None) -> DecodePath:
    """The candidate ``name``; ``what`` names the setting it came from (the environment: "or auto")."""
    if name not in CANDIDATES:
        raise ValueError(f"{what or repr(name)} is not a decode path; use one of {', '.join(CANDIDATES)} "
                         f"(or {'auto' if what else 'default'})")
    return CANDIDATES[name]


def _runs_here(name: str) -> bool:
    """A cached choice still runs here (the C kernels build; torch.compile finds its compiler)."""
    path = CANDIDATES[name]
    return (path.products != "matvec" or kernels.available()) and not (path.compiled and compile_unavailable())


def _default_path(model: Transformer) -> DecodePath:
    """Not CPU float32, and no candidate to run (another device or dtype, or no C kernels): stacked F.linear
    products, on long rows on a CPU except in float16 (its CPU products with transposed weights fall to a slow
    kernel: 241 against 14 ms for a 64-row prefill through gate|up)."""
    weight = model.embed.weight
    return DecodePath("default", long_rows=weight.device.type == "cpu" and weight.dtype != torch.float16,
                      products="linear")


_compiled = []  # one compiled step per process: its graphs serve every model (dynamo guards on the inputs)


def _compiled_step():
    if not _compiled:
        _compiled.append(compile_decode_step("default"))
    return _compiled[0]
