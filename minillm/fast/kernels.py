"""Decode's products in C (matvec_kernels.c): float32, int8 and int4 matrices, and decode's attention;
built at first use, called through ctypes.

Why C and not PyTorch: a decode step's product is one row by a matrix, so its floor is reading the
weights; MKL reads a one-row float32 product with one core (minillm.fast.products), and a quantised
kernel must widen the codes to float as fast as it reads them. Measured on the developers'
2-core AMD EPYC (AVX2), SmolLM2-135M's 49152x576 LM head, float32 ``F.linear`` 6.9-10.6 ms (layout):

    int8 torch._weight_int8pack_mm                     22.7 ms   (no AVX2 kernel: slower than float32)
    int4 torch._weight_int4pack_mm_for_cpu             30.9 ms
    int8 torch.compile'd dequantise-multiply-reduce     6.4 ms   (inductor's loop is compute-bound;
                                                                  ~170 us a call on small matrices)
    int8 this file                                  1.3-1.9 ms   (and ~10 us a call)
    int4 this file                                  1.3-2.2 ms

(BENCHMARKS-HISTORY.md, "Weight-only quantisation", has the runs.) float32: SmolLM2-135M's 121 decode
products took 32-35 ms here (16 GB/s) against 40-42 ms for the split MKL product (13 GB/s)
and 59-66 ms for one-core ``F.linear`` (same session); the "matvec" decode paths use it
(minillm.fast.choose). Prefill's many rows are compute-bound:
there the C loops only unpack each matrix to float (int4: 31 ms for SmolLM2's blocks, 204 ms in
PyTorch) for one float product.

Between the two, a serving step's batch of decodes (4-128 rows: one a sequence) runs
:func:`int8_matmul` / :func:`int4_matmul`: each thread dequantises a tile of the matrix into a float
buffer that stays in cache, once, and multiplies it with every row (benchmarks/quantized_batches.py
has the numbers against float32).

Decode's attention is here too (:func:`decode_attention`, on the "matvec" decode paths): one query
a sequence against the cache reads each layer's K and V once for a few FLOPs a byte, and SDPA's CPU
kernel spends its time elsewhere: on the developers' EPYC this loop took a compiled SmolLM2 step
2-4 ms below SDPA's at 128 positions and 7-8 ms below at 1,000 (BENCHMARKS-HISTORY.md).

The C compiler is the one ``torch.compile`` also needs (``cc``, or ``$CC``); the build takes about a
second, once per machine: it is kept in ``<weights_dir>/kernels/`` (``-march=native``: for this CPU
only, so the CPU's name is part of its file name). With
no compiler, :func:`available` is False and quantised matrices run their reference product (4-9x slower
than float32), saying so once.

Each kernel is also a torch op (``torch.ops.minillm.f32_matvec``, ...), which is how a
``torch.compile``'d decode step (the compiled decode paths) calls it: dynamo cannot trace into
ctypes, and an op is opaque to it by design. The ops' implementations are matvec_ops.cpp, built
at the first compile with ``c++`` (``$CXX``) against torch's headers, 12-19 s once a machine: an op
implemented in Python cost the graph ~30 us a call, ~1.2 ms of a SmolLM2 step (measured, A/B over
five process pairs). Without a C++ compiler, or where the build fails (kept as a ``.failed`` file
beside the kernels, so the next process does not spend the build again), the ops call this
module's functions, with a one-line warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

SOURCE = Path(__file__).with_name("matvec_kernels.c")
OPS_SOURCE = Path(__file__).with_name("matvec_ops.cpp")  # the same kernels as torch ops, for compiled code
# first OpenMP (threads), then without it (macOS clang has no -fopenmp: one thread), then portable
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])

_state: dict[str, object] = {}  # "lib": the loaded library or None, "why": the reason it is None


def kernels() -> ctypes.CDLL | None:
    """The built library, or None when no flag set compiles (the reason: :func:`unavailable_reason`)."""
    if "lib" not in _state:
        _state["lib"], _state["why"] = _build()
        if _state["lib"] is None:
            warnings.warn(f"the C matvec kernels are not available ({_state['why']}): quantised models run "
                          "the reference path (dequantise, then F.linear), 4-9x slower than float32 (measured), "
                          "and float32 keeps MKL's products; install a C compiler (cc) or set CC",
                          RuntimeWarning, stacklevel=3)
    return _state["lib"]


def unavailable_reason() -> str | None:
    """Why :func:`kernels` is None (None when they are built or not yet tried)."""
    return _state.get("why")


def _build(flag_sets=FLAG_SETS, cache_dir: Path | None = None) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library built with the first flag set that compiles, None), or (None, why not).

    A build is kept in ``cache_dir`` (default: :func:`cache_folder`) under a name made of the
    source, the compiler, the flags and the CPU's name, so later processes load it instead of
    compiling again (~1 s a process); where the folder cannot be written, the build stays temporary.
    """
    compiler = shlex.split(os.environ.get("CC") or "cc")  # CC may carry flags: "gcc -std=c11"
    if not compiler or shutil.which(compiler[0]) is None:
        return None, f"no C compiler {os.environ.get('CC') or 'cc'!r} on PATH"
    cache_dir = cache_folder() if cache_dir is None else cache_dir
    with tempfile.TemporaryDirectory(prefix="minillm-kernels-") as tmp:
        error = ""
        for flags in flag_sets:
            kept = cache_dir / f"matvec_kernels-{_build_key(compiler, flags, [SOURCE])}.so"
            if kept.is_file() and (loaded := _load(kept))[0] is not None:
                return loaded  # (a kept file that does not load, e.g. truncated, is built again and replaced)
            out = Path(tmp) / "matvec_kernels.so"
            run = subprocess.run([*compiler, *flags, "-shared", "-fPIC", str(SOURCE), "-lm", "-o", str(out)],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                _keep(out, kept)
                return _load(out)  # (not kept: a process that tried a bad file there has that path's handle)
            error = (run.stderr.strip().splitlines() or ["failed"])[-1]
    return None, f"{' '.join(compiler)} could not build {SOURCE.name}: {error}"


def cache_folder() -> Path:
    """``<weights_dir>/kernels``: the built libraries, beside calibration.json."""
    from ..paths import weights_dir

    return weights_dir() / "kernels"


def _build_key(compiler: list[str], flags: list[str], sources: list[Path]) -> str:
    """What decides the binary: the sources, the compiler and its flags, (-march=native) the CPU, and
    (the ops' C++) torch's version."""
    from ..hardware import _device_name

    parts = [*(source.read_bytes() for source in sources), " ".join(compiler + flags).encode(),
             _device_name(torch.device("cpu")).encode(), torch.__version__.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _keep(built: Path, kept: Path) -> None:
    """Copy a fresh build to its cache name (atomically: another process may be loading it); where the
    folder cannot be written, nothing is kept and each process builds its own."""
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        staged = kept.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(built, staged)
        os.replace(staged, kept)
    except OSError:
        pass


def _load(path: Path) -> tuple[ctypes.CDLL | None, str | None]:
    try:
        return _declare(ctypes.CDLL(str(path))), None  # loaded: a temporary file may go with its directory
    except AttributeError as e:  # a library of that name without the kernels (a stray file)
        return None, f"{path} is not minillm's kernels ({e}); delete it"
    except OSError as e:  # e.g. a temporary directory mounted noexec
        return None, (f"built but could not load {path} ({e}); set MINILLM_WEIGHTS and TMPDIR to folders "
                      "that may hold programs")


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.f32_matvec.argtypes = [ptr, ptr, ptr, i32, i32, i32, i32]
    lib.f32_matvec.restype = None
    lib.f32_panel_width.argtypes = []
    lib.f32_panel_width.restype = i32
    lib.f32_pack_panels.argtypes = [ptr, ptr, i32, i32, i32]
    lib.f32_pack_panels.restype = None
    lib.f32_panel_matmul.argtypes = [ptr, ptr, ptr, i32, i32, i32, i32]
    lib.f32_panel_matmul.restype = None
    lib.int8_pack_panels.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i32, i32]
    lib.int8_pack_panels.restype = None
    lib.int4_pack_panels.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32]
    lib.int4_pack_panels.restype = None
    lib.quantized_panel_matmul.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32]
    lib.quantized_panel_matmul.restype = None
    lib.quantized_panels_vectorised.argtypes = []
    lib.quantized_panels_vectorised.restype = i32
    lib.int8_matvec.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i32, i32]
    lib.int8_matvec.restype = None
    lib.int4_matvec.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32]
    lib.int4_matvec.restype = i32
    lib.int4_dequantize.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i32, i32]
    lib.int4_dequantize.restype = None
    lib.int8_dequantize.argtypes = [ptr, ptr, ptr, i32, i32, i32]
    lib.int8_dequantize.restype = None
    lib.int8_matmul.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i32, i32]
    lib.int8_matmul.restype = i32
    lib.int4_matmul.argtypes = [ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32]
    lib.int4_matmul.restype = i32
    i64 = ctypes.c_int64
    lib.decode_attention.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i64, i64, i64, i64,
                                     ctypes.c_float, i32]
    lib.decode_attention.restype = i32
    lib.paged_decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, i32,
                                           ctypes.c_float, i32]
    lib.paged_decode_attention.restype = i32
    lib.causal_attention.argtypes = [ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, i64, i64, i64, i64, i64, i64,
                                     i64, i64, i64, ctypes.c_float, i32]
    lib.causal_attention.restype = i32
    lib.rms_norm.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i32, ctypes.c_float, i32]
    lib.rms_norm.restype = None
    lib.silu_mul.argtypes = [ptr, ptr, i64, i32, i32]
    lib.silu_mul.restype = None
    return lib


def available() -> bool:
    """Whether the kernels are built (building them at the first call)."""
    return kernels() is not None


def prepare_for_compile() -> None:
    """Before torch.compile traces code that calls the kernels: build them and their torch ops, and
    make :func:`available` a constant to the tracer (it cannot trace the build). Done here, not at
    import: marking it imports torch._dynamo, ~70 MB of RSS that a process which never compiles need
    not hold, and building the ops takes 12-19 s once a machine."""
    if kernels() is not None:
        _register_ops()
    torch.compiler.assume_constant_result(available)


def functions():
    """The kernels as this module's plain functions, or as torch ops while torch.compile traces (it
    cannot trace into their ctypes calls; an op's dispatch costs eager code ~20 us a call)."""
    return torch.ops.minillm if torch.compiler.is_compiling() else sys.modules[__name__]


# -- the kernels: x and the results float32, row-major (contiguous) ------------------------------


def f32_matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32, weight [out, in] float32 (row-major) -> x @ weightᵀ [rows, out] float32."""
    return _f32_matvec(kernels(), x, weight)


class Panels(NamedTuple):
    """A float32 matrix [out_features, in] copied into panels of P outputs (:func:`f32_pack_panels`):
    ``data[p, i, l] = weight[p·P + l, i]``, [ceil(out_features / P), in, P] float32, zeros past
    out_features; P the build's panel width (:func:`panel_width`). Made by f32_pack_panels, not by
    hand: an out_features changed within the last panel cannot be told from the data."""

    data: torch.Tensor
    out_features: int


class QuantizedPanels(NamedTuple):
    """An int8 or int4 matrix [out_features, in] copied into panels (:func:`quantized_pack_panels`):
    ``codes`` [panels, in, P] int8, or [panels, in, P/2] uint8 (the outputs l and l + P/2 in one byte,
    low and high nibble); ``scales`` and ``offsets`` [panels, groups, P] float32 (int8: one group),
    ŵ = q · scale + offset (offset = -zero · scale: quantize.py's values)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    out_features: int


def f32_pack_panels(weight: torch.Tensor) -> Panels:
    """weight [out, in] float32 CPU (row-major) -> its copy in :class:`Panels`, what
    :func:`f32_panel_matmul` reads. Raises ValueError for another dtype, device or layout."""
    return _f32_pack_panels(kernels(), weight)


def f32_panel_matmul(x: torch.Tensor, panels: Panels) -> torch.Tensor:
    """x [rows, in] float32 @ wᵀ -> [rows, out_features] float32, w given as its :class:`Panels`
    (matvec_kernels.c says how; F.linear's values up to float rounding). Raises ValueError when x does
    not fit the copy."""
    return _f32_panel_matmul(kernels(), x, panels)


def quantized_pack_panels(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                          group_size: int | None = None) -> QuantizedPanels:
    """The codes of an int8 matrix (codes [out, in] int8, scale [out] float32) or an int4 one (codes
    [out, in/2] uint8, scale [out, in/G] float32, zero [out, in/G] uint8, G = group_size) copied into
    :class:`QuantizedPanels`, what :func:`quantized_panel_matmul` reads. Raises ValueError for codes the
    kernels would misread."""
    return _quantized_pack_panels(kernels(), codes, scale, zero, group_size)


def quantized_panels_vectorised() -> bool:
    """Whether this build converts codes in :func:`quantized_panel_matmul` with vector instructions (AVX2 or
    AVX-512); elsewhere the tiled kernels (:func:`int8_matmul`) are faster."""
    return bool(kernels().quantized_panels_vectorised())


def quantized_panel_matmul(x: torch.Tensor, panels: QuantizedPanels) -> torch.Tensor:
    """A server's batch of rows over quantised weights: x [rows, in] float32 @ ŵᵀ -> [rows, out_features]
    float32 from the :class:`QuantizedPanels`, each weight dequantised in registers as the panel
    micro-kernel loads it (matvec_kernels.c). Same values as :func:`int8_matmul` / :func:`int4_matmul`
    up to float rounding. Raises ValueError when x does not fit the copy."""
    return _quantized_panel_matmul(kernels(), x, panels)


def int8_matvec(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32, q [out, in] int8, scale [out] float32 -> (x @ qᵀ) · scale [rows, out] float32."""
    return _int8_matvec(kernels(), x, q, scale)


def int4_matvec(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """x [rows, in] float32, packed [out, in/2] uint8, scale [out, in/G] float32, zero [out, in/G]
    uint8 -> x @ ŵᵀ [rows, out] float32, ŵ = (q - zero) · scale per group of G = group_size.

    Needs G a multiple of 16 dividing in. Raises MemoryError when its scratch copy of x cannot be
    allocated."""
    return _int4_matvec(kernels(), x, packed, scale, zero, group_size)


def int8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrix [out, in] of int8 codes q [out, in]: q · scale[o] (dequantize_int8's values)."""
    return _int8_dequantize(kernels(), q, scale)


def int4_dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 matrix [out, in] of packed [out, in/2] uint8 codes: (q - zero) · scale per group
    (minillm.quantize.dequantize_int4's values, up to float rounding). Needs G a multiple of 16
    dividing in."""
    return _int4_dequantize(kernels(), packed, scale, zero, group_size)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A batch of rows: x [rows, in] float32, q [out, in] int8, scale [out] float32 -> x @ ŵᵀ [rows, out]
    float32, ŵ = q · scale[o], the matrix dequantised a tile at a time (matvec_kernels.c says how).

    Same values as :func:`int8_matvec` up to float rounding; faster from a few rows (a serving step's
    decodes), where int8_matvec widens every code once a row. Raises MemoryError when its scratch
    buffers cannot be allocated."""
    return _int8_matmul(kernels(), x, q, scale)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """A batch of rows, int4 (the layouts of :func:`int4_matvec`): x @ ŵᵀ [rows, out] float32, ŵ = (q -
    zero) · scale per group, the matrix dequantised a tile at a time. Needs G a multiple of 16 dividing
    in. Raises MemoryError when its scratch buffers cannot be allocated."""
    return _int4_matmul(kernels(), x, packed, scale, zero, group_size)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_keys: int | torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Decode's attention: softmax(scale · q·kᵀ) · v over the first ``n_keys`` keys.

    q [B, n_heads, 1, head_dim] float32 (one new query a sequence); k, v [B, n_kv_heads, S, head_dim]
    float32 with contiguous rows (a KV cache's buffer or a view of its first positions), n_heads a
    multiple of n_kv_heads (GQA), head_dim a multiple of 8; ``n_keys`` (an int or a one-element
    tensor, 1 <= n_keys <= S) how many keys the query sees. Returns [B, n_heads, 1, head_dim]
    float32, ``F.scaled_dot_product_attention``'s values up to float rounding. Raises ValueError for
    inputs the C loop would misread, MemoryError when its scratch cannot be allocated.
    """
    return _decode_attention(kernels(), q, k, v, n_keys, scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Prefill's attention: the T queries are the last T of the S positions, each attending causally
    (query t sees keys 0 .. S - T + t: the mask aligned to the bottom right, as a chunk after a cached
    prefix needs, unlike SDPA's ``is_causal`` when T < S), softmax(scale · q·kᵀ + mask) · v, by a
    flash-attention loop in C (matvec_kernels.c).

    q [B, H, T, D], k, v [B, Hkv, S, D] float32, any strides but a contiguous last dimension (a KV
    cache's buffer, a transposed gather), T <= S, H a multiple of Hkv (GQA), D a multiple of :func:`panel_width`.
    Returns [B, H, T, D] float32, ``F.scaled_dot_product_attention``'s values (``is_causal`` when T ==
    S) up to float rounding. Raises ValueError for inputs the loop would misread, MemoryError when its
    scratch cannot be allocated."""
    return _causal_attention(kernels(), q, k, v, scale)


def panel_width() -> int:
    """The floats of one panel in this build: 32 with AVX-512, 16 with AVX or AVX2, 8 in a portable build
    (:class:`Panels`' last dimension, and what causal_attention's head_dim must be a multiple of)."""
    return kernels().f32_panel_width()


def _decode_attention_fake(q, k, v, n_keys):
    # (also what runs, on the Meta dispatch key, when one input is a meta tensor and the rest are not)
    if len({t.device for t in (q, k, v, n_keys)}) > 1:
        raise ValueError(f"decode_attention takes its tensors on one device, got q on {q.device}, k on {k.device}, "
                         f"v on {v.device}, n_keys on {n_keys.device}")
    return q.new_empty(q.shape)


# The same kernels as torch ops (torch.ops.minillm.f32_matvec, ...) for compiled code; eager code calls
# the functions above (an op's dispatch costs eager code ~20 us a call, 4 ms of a SmolLM2 decode
# step). Here: their schemas and fakes (the output's shape and dtype, for tracing); their CPU
# implementations come with prepare_for_compile.
_OPS = {
    "f32_matvec": ("(Tensor x, Tensor weight) -> Tensor",
                   lambda x, weight: x.new_empty(x.shape[0], weight.shape[0])),
    "int8_matvec": ("(Tensor x, Tensor q, Tensor scale) -> Tensor",
                    lambda x, q, scale: x.new_empty(x.shape[0], q.shape[0])),
    "int4_matvec": ("(Tensor x, Tensor packed, Tensor scale, Tensor zero, int group_size) -> Tensor",
                    lambda x, packed, scale, zero, group_size: x.new_empty(x.shape[0], packed.shape[0])),
    "int8_dequantize": ("(Tensor q, Tensor scale) -> Tensor", lambda q, scale: scale.new_empty(q.shape)),
    "int4_dequantize": ("(Tensor packed, Tensor scale, Tensor zero, int group_size) -> Tensor",
                        lambda packed, scale, zero, group_size: scale.new_empty(packed.shape[0], packed.shape[1] * 2)),
    "int8_matmul": ("(Tensor x, Tensor q, Tensor scale) -> Tensor",
                    lambda x, q, scale: x.new_empty(x.shape[0], q.shape[0])),
    "int4_matmul": ("(Tensor x, Tensor packed, Tensor scale, Tensor zero, int group_size) -> Tensor",
                    lambda x, packed, scale, zero, group_size: x.new_empty(x.shape[0], packed.shape[0])),
    # n_keys a tensor: in a compiled step it is the position, data that changes every step
    "decode_attention": ("(Tensor q, Tensor k, Tensor v, Tensor n_keys, float scale) -> Tensor",
                         lambda q, k, v, n_keys, scale: _decode_attention_fake(q, k, v, n_keys)),
}
_LIBRARY = torch.library.Library("minillm", "FRAGMENT")
for _name, (_schema, _fake) in _OPS.items():
    _LIBRARY.define(_name + _schema)
    torch.library.register_fake(f"minillm::{_name}", _fake, lib=_LIBRARY)


def _register_ops() -> None:
    """The ops' CPU implementations, once a process: matvec_ops.cpp's, built against this torch (a
    compiled graph calls them without going back to Python: ~9 against ~30 us a call, measured), or,
    where it does not build, this module's functions. :func:`ops_implementation` says which."""
    if "ops" in _state:
        return
    loaded, why = _build_ops()
    if not loaded:
        warnings.warn(f"compiled decode steps call the C products through Python (~1.2 ms more a SmolLM2 step, "
                      f"measured): {why}", stacklevel=3)
        for name in _OPS:
            _LIBRARY.impl(name, getattr(sys.modules[__name__], name), "CPU")
    _state["ops"], _state["ops_why"] = ("C++" if loaded else "Python"), why


def ops_implementation() -> tuple[str | None, str | None]:
    """("C++" or "Python", why not C++), or (None, None) before any compiled step registered them."""
    return _state.get("ops"), _state.get("ops_why")


def _build_ops(cache_dir: Path | None = None) -> tuple[bool, str | None]:
    """Build (or find kept) matvec_ops.cpp and load it into torch: (True, None), or (False, why not)."""
    compiler = shlex.split(os.environ.get("CXX") or "c++")
    if not compiler or shutil.which(compiler[0]) is None:
        return False, f"no C++ compiler {os.environ.get('CXX') or 'c++'!r} on PATH"
    torch_dir = Path(torch.__file__).parent
    cache_dir = cache_folder() if cache_dir is None else cache_dir
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    # a failed build is kept too: trying again costs every process 20-40 s for the same error
    failed = cache_dir / f"matvec_ops-{_build_key(compiler, [abi], [OPS_SOURCE, SOURCE])}.failed"
    if failed.is_file():
        return False, f"{failed.read_text().strip()} (kept from an earlier try: delete {failed} to build again)"
    error = ""
    with tempfile.TemporaryDirectory(prefix="minillm-ops-") as tmp:
        for flags in FLAG_SETS[:2]:
            flags = [*flags, "-std=c++17", abi]
            kept = cache_dir / f"matvec_ops-{_build_key(compiler, flags, [OPS_SOURCE, SOURCE])}.so"
            if kept.is_file() and _load_ops(kept):
                return True, None
            out = Path(tmp) / "matvec_ops.so"
            run = subprocess.run([*compiler, *flags, "-shared", "-fPIC", "-w", f"-I{torch_dir / 'include'}",
                                  str(OPS_SOURCE), "-o", str(out), f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10",
                                  f"-Wl,-rpath,{torch_dir / 'lib'}"], capture_output=True, text=True)
            if run.returncode == 0 and _load_ops(out):
                _keep(out, kept)
                return True, None
            said = run.stderr.strip().splitlines()
            error = said[-1] if said else f"exit status {run.returncode}" if run.returncode else "built, but did not load"
    why = f"{' '.join(compiler)} could not build {OPS_SOURCE.name}: {error}"
    try:
        failed.parent.mkdir(parents=True, exist_ok=True)
        failed.write_text(why + "\n")
    except OSError:  # a read-only cache: try again next time
        pass
    return False, why


def _load_ops(path: Path) -> bool:
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError):  # a truncated file; a library built against another torch
        return False
    # a library that loads but is not these ops (a stray file of the kept name) registers nothing
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"minillm::{name}", "CPU") for name in _OPS)


# -- the ctypes calls, on a given library (tests build a portable one too) -----------------------


def _f32_matvec(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"f32_matvec takes float32 CPU tensors, got x {x.dtype} on {x.device.type} and weight "
                         f"{weight.dtype} on {weight.device.type}; use F.linear")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or not weight.is_contiguous():
        raise ValueError(f"f32_matvec multiplies x [rows, in] by a contiguous weight [out, in], got x "
                         f"{list(x.shape)} and weight {list(weight.shape)} (contiguous: {weight.is_contiguous()})")
    x = x.contiguous()
    y = _output(x.shape[0], weight.shape[0])
    lib.f32_matvec(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1],
                   torch.get_num_threads())
    return y


def _f32_pack_panels(lib: ctypes.CDLL, weight: torch.Tensor) -> Panels:
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"f32_pack_panels packs a contiguous float32 CPU matrix [out, in], got {weight.dtype} "
                         f"{list(weight.shape)} on {weight.device.type}")
    width = lib.f32_panel_width()
    out, in_features = weight.shape
    data = torch.empty(-(-out // width), in_features, width, dtype=torch.float32)
    lib.f32_pack_panels(weight.data_ptr(), data.data_ptr(), out, in_features, torch.get_num_threads())
    return Panels(data, out)


def _f32_panel_matmul(lib: ctypes.CDLL, x: torch.Tensor, panels: Panels) -> torch.Tensor:
    data, out_features = panels if isinstance(panels, Panels) else (x.new_empty(0), -1)
    if (isinstance(out_features, bool) or not isinstance(out_features, int) or out_features < 0 or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2
            or data.device.type != "cpu" or data.dtype != torch.float32 or data.dim() != 3 or not data.is_contiguous()
            or data.shape[2] != lib.f32_panel_width() or data.shape[1] != x.shape[1]
            or data.shape[0] != -(-out_features // data.shape[2])):
        what = (f"Panels of data {data.dtype} {list(data.shape)} on {data.device.type}, out_features {out_features!r}"
                if isinstance(panels, Panels) else type(panels).__name__)
        raise ValueError(f"f32_panel_matmul multiplies float32 CPU x [rows, in] by f32_pack_panels' Panels of a "
                         f"[out, in] matrix, got x {x.dtype} {list(x.shape)} on {x.device.type} and {what}; "
                         "pack the matrix with f32_pack_panels")
    x = x.contiguous()
    y = _output(x.shape[0], out_features)
    lib.f32_panel_matmul(x.data_ptr(), data.data_ptr(), y.data_ptr(), x.shape[0], out_features, x.shape[1],
                         torch.get_num_threads())
    return y


def _causal_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> torch.Tensor:
    B, H, T, D = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    ok = (k.dim() == 4 and k.shape == v.shape and k.shape[0] == B and k.shape[1] > 0 and H % k.shape[1] == 0
          and k.shape[3] == D and 0 < T <= k.shape[2] and D > 0 and D % lib.f32_panel_width() == 0
          and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v))
          and q.stride(3) == k.stride(3) == v.stride(3) == 1
          and isinstance(scale, (int, float)) and not isinstance(scale, bool))
    if not ok:
        raise ValueError(f"causal_attention takes float32 CPU q [B, heads, T, D] and k, v [B, kv_heads, S, D] with "
                         f"a contiguous last dimension, T <= S, heads a multiple of kv_heads, D a multiple of "
                         f"{lib.f32_panel_width()}, and a number scale; got q {q.dtype} {list(q.shape)}, k {k.dtype} "
                         f"{list(k.shape)} strides {list(k.stride())}, v {list(v.shape)}, scale {scale!r}")
    out = _output(B, H, T, D)
    failed = lib.causal_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), B, H, k.shape[1], T,
                                  k.shape[2], D, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                                  k.stride(2), v.stride(0), v.stride(1), v.stride(2), scale, torch.get_num_threads())
    if failed:
        raise MemoryError("causal_attention could not allocate its scratch buffers")
    return out


def _rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float,
              delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = (x, weight) if delta is None else (x, weight, delta)
    if (any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
            or x.dim() == 0 or weight.shape != x.shape[-1:] or (delta is not None and delta.shape != x.shape)
            or isinstance(eps, bool) or not isinstance(eps, (int, float))):
        raise ValueError(f"rms_norm takes contiguous float32 CPU x [..., dim], weight [dim] (and delta as x) and a "
                         f"number eps, got x {x.dtype} {list(x.shape)} on {x.device.type}, weight {weight.dtype} "
                         f"{list(weight.shape)}" + ("" if delta is None else f", delta {delta.dtype} {list(delta.shape)}")
                         + f", eps {eps!r}")
    out, total = _output(*x.shape), x if delta is None else _output(*x.shape)
    if x.numel():
        lib.rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), total.data_ptr(), weight.data_ptr(),
                     out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, torch.get_num_threads())
    return total, out


def _quantized_pack_panels(lib: ctypes.CDLL, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                           group_size: int | None) -> QuantizedPanels:
    _check_codes("quantized_pack_panels", codes, scale, zero, group_size)
    if codes.device.type != "cpu":
        raise ValueError(f"quantized_pack_panels packs codes on the CPU, got them on {codes.device.type}")
    int4, width, out = zero is not None, lib.f32_panel_width(), codes.shape[0]
    in_features, panels, threads = codes.shape[1] * (2 if int4 else 1), -(-out // width), torch.get_num_threads()
    groups = in_features // group_size if int4 else 1
    scales, offsets = _output(panels, groups, width), _output(panels, groups, width)
    if not int4:
        packed = torch.empty(panels, in_features, width, dtype=torch.int8)
        lib.int8_pack_panels(codes.data_ptr(), scale.data_ptr(), packed.data_ptr(), scales.data_ptr(),
                             offsets.data_ptr(), out, in_features, threads)
    else:
        packed = torch.empty(panels, in_features, width // 2, dtype=torch.uint8)
        lib.int4_pack_panels(codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), packed.data_ptr(), scales.data_ptr(),
                             offsets.data_ptr(), out, in_features, group_size, threads)
    return QuantizedPanels(packed, scales, offsets, out)


def _quantized_panel_matmul(lib: ctypes.CDLL, x: torch.Tensor, panels: QuantizedPanels) -> torch.Tensor:
    if not isinstance(panels, QuantizedPanels):
        raise ValueError(f"quantized_panel_matmul multiplies x by quantized_pack_panels' QuantizedPanels, got "
                         f"{type(panels).__name__}; pack the matrix with quantized_pack_panels")
    codes, scales, offsets, out_features = panels
    width, int4 = lib.f32_panel_width(), codes.dtype == torch.uint8
    fits = (isinstance(out_features, int) and not isinstance(out_features, bool) and codes.dim() == 3 and scales.dim() == 3
            and codes.dtype in (torch.int8, torch.uint8) and codes.is_contiguous()
            and all(t.device.type == "cpu" for t in (x, codes, scales, offsets))
            and scales.dtype == offsets.dtype == torch.float32 and scales.is_contiguous() and offsets.is_contiguous()
            and codes.shape[2] == (width // 2 if int4 else width) and codes.shape[0] == -(-out_features // width)
            and scales.shape == offsets.shape == (codes.shape[0], scales.shape[1], width)
            and scales.shape[1] > 0 and codes.shape[1] % scales.shape[1] == 0)
    if not fits or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != codes.shape[1]:
        raise ValueError(f"quantized_panel_matmul multiplies float32 CPU x [rows, in] by quantized_pack_panels' "
                         f"QuantizedPanels, got x {x.dtype} {list(x.shape)} on {x.device.type} and codes "
                         f"{codes.dtype} {list(codes.shape)} on {codes.device.type}; pack the matrix with "
                         "quantized_pack_panels")
    in_features = codes.shape[1]
    x = x.contiguous()
    y = _output(x.shape[0], out_features)
    lib.quantized_panel_matmul(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), offsets.data_ptr(), y.data_ptr(),
                               x.shape[0], out_features, in_features, in_features // scales.shape[1], int(int4),
                               torch.get_num_threads())
    return y


def _output(*shape: int) -> torch.Tensor:
    """An uninitialised float32 CPU tensor for a C loop to fill: float32 whatever torch's default dtype
    (the loops write float32 bits)."""
    return torch.empty(*shape, dtype=torch.float32)


def _check_codes(op: str, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                 group_size: int | None = None, x: torch.Tensor | None = None) -> None:
    """Refuse, in one line, what the C loops would read out of bounds or wrongly (they trust shapes).
    Each message is formatted only on failure: this runs on every product of a decode step."""
    int4 = zero is not None
    code_dtype = torch.uint8 if int4 else torch.int8
    if any(t is not None and t.device.type != "cpu" for t in (codes, scale, zero, x)):  # (was: a crash)
        raise ValueError(f"{op}: the C kernels read CPU tensors, got codes on {codes.device.type}, scale on "
                         f"{scale.device.type}" + ("" if zero is None else f", zero on {zero.device.type}")
                         + ("" if x is None else f", x on {x.device.type}"))
    if int4 and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise ValueError(f"{op}: group_size must be an int, got {group_size!r}")
    if codes.dim() != 2 or not codes.is_contiguous() or codes.dtype != code_dtype:
        raise ValueError(f"{op}: codes must be a contiguous 2-D {_name(code_dtype)} tensor, got {codes.dtype} "
                         f"{list(codes.shape)}")
    in_features = codes.shape[1] * (2 if int4 else 1)
    if int4 and (not group_size or group_size < 0 or group_size % 16 or in_features % group_size):
        raise ValueError(f"{op}: group_size must be a positive multiple of 16 dividing {in_features}, got {group_size}")
    expected = (codes.shape[0], in_features // group_size) if int4 else (codes.shape[0],)
    for name, t, dtype in (("scale", scale, torch.float32), ("zero", zero, torch.uint8)):
        if t is not None and (t.dtype != dtype or not t.is_contiguous() or tuple(t.shape) != expected):
            raise ValueError(f"{op}: {name} must be contiguous {_name(dtype)} {list(expected)}, got {t.dtype} "
                             f"{list(t.shape)}")
    if x is not None and (x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_features):
        raise ValueError(f"{op}: x must be float32 [rows, {in_features}], got {x.dtype} {list(x.shape)}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _int8_matvec(lib: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check_codes("int8_matvec", q, scale, x=x)
    x = x.contiguous()
    y = _output(x.shape[0], q.shape[0])
    lib.int8_matvec(x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(),
                    x.shape[0], q.shape[0], q.shape[1], torch.get_num_threads())
    return y


def _int4_matvec(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor, group_size: int) -> torch.Tensor:
    _check_codes("int4_matvec", packed, scale, zero, group_size, x)
    x = x.contiguous()
    y = _output(x.shape[0], packed.shape[0])
    status = lib.int4_matvec(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), y.data_ptr(),
                             x.shape[0], packed.shape[0], x.shape[1], group_size, torch.get_num_threads())
    if status:
        raise MemoryError(f"int4_matvec could not allocate {x.numel() * 8:,} bytes for a copy of x")
    return y


def _int8_dequantize(lib: ctypes.CDLL, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check_codes("int8_dequantize", q, scale)
    w = _output(*q.shape)
    lib.int8_dequantize(q.data_ptr(), scale.data_ptr(), w.data_ptr(), q.shape[0], q.shape[1], torch.get_num_threads())
    return w


def _int4_dequantize(lib: ctypes.CDLL, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    _check_codes("int4_dequantize", packed, scale, zero, group_size)
    out, in_features = packed.shape[0], packed.shape[1] * 2
    w = _output(out, in_features)
    lib.int4_dequantize(packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), w.data_ptr(),
                        out, in_features, group_size, torch.get_num_threads())
    return w


def _int8_matmul(lib: ctypes.CDLL, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check_codes("int8_matmul", q, scale, x=x)
    x = x.contiguous()
    y = _output(x.shape[0], q.shape[0])
    status = lib.int8_matmul(x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(),
                             x.shape[0], q.shape[0], q.shape[1], torch.get_num_threads())
    if status:
        raise MemoryError(f"int8_matmul could not allocate {x.numel() * 4:,} bytes for a copy of x and a tile a thread")
    return y


def _int4_matmul(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor, group_size: int) -> torch.Tensor:
    _check_codes("int4_matmul", packed, scale, zero, group_size, x)
    x = x.contiguous()
    y = _output(x.shape[0], packed.shape[0])
    status = lib.int4_matmul(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), y.data_ptr(),
                             x.shape[0], packed.shape[0], x.shape[1], group_size, torch.get_num_threads())
    if status:
        raise MemoryError(f"int4_matmul could not allocate {x.numel() * 4:,} bytes for a copy of x and a tile a thread")
    return y


def _decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      n_keys: int | torch.Tensor, scale: float) -> torch.Tensor:
    if isinstance(n_keys, torch.Tensor) and n_keys.numel() == 1 and n_keys.device.type == "cpu" \
            and not n_keys.is_floating_point() and not n_keys.is_complex():
        n_keys = int(n_keys)
    if not isinstance(n_keys, int) or isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"decode_attention takes n_keys an int (or a one-element integer CPU tensor) and scale a "
                         f"number, got n_keys {n_keys!r} and scale {scale!r}")
    B, n_heads, T, head_dim = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    ok = (T == 1 and head_dim % 8 == 0 and head_dim > 0 and k.dim() == 4 and k.shape == v.shape
          and k.shape[0] == B and k.shape[1] > 0 and k.shape[3] == head_dim and n_heads % k.shape[1] == 0
          and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v))
          and k.stride(3) == v.stride(3) == 1 and k.stride(2) == v.stride(2) == head_dim)
    if not ok or not 1 <= n_keys <= k.shape[2]:
        raise ValueError(f"decode_attention takes float32 CPU q [B, heads, 1, D] (D a multiple of 8) and k, v "
                         f"[B, kv_heads, S, D] with contiguous rows, heads a multiple of kv_heads, 1 <= n_keys <= S; "
                         f"got q {q.dtype} {list(q.shape)}, k {k.dtype} {list(k.shape)} strides {list(k.stride())}, "
                         f"v {list(v.shape)}, n_keys {n_keys}")
    q, out = q.contiguous(), _output(*q.shape)
    status = lib.decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), B, n_heads, k.shape[1],
                                  n_keys, head_dim, k.stride(0), k.stride(1), v.stride(0), v.stride(1), scale,
                                  torch.get_num_threads())
    if status:
        raise MemoryError("decode_attention could not allocate its partial results")
    return out


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           first: torch.Tensor, last: torch.Tensor, scale: float, check: bool = True) -> torch.Tensor:
    """Decode attention read from a paged pool in place (matvec_kernels.c's ``paged_decode_attention``).

    q [B, heads, head_dim] float32; k_pool, v_pool one layer's pool [num_blocks, block_size, kv_heads,
    head_dim] float32, contiguous; block_tables [B, max_blocks] int64; first, last [B] int64: sequence b
    attends over its positions first[b] <= j < last[b]. Returns [B, heads, head_dim] float32, softmax(scale ·
    q·kᵀ) · v over those keys. Raises ValueError for other shapes, dtypes or devices, or (with ``check``)
    a block id outside the pool or a range outside its table (a caller that calls once a layer with the
    same tables checks them once: the check reads the tensors, ~0.1 ms).
    """
    B, n_heads, head_dim = q.shape if q.dim() == 3 else (0, 0, 0)
    num_blocks, block_size, kv_heads = k_pool.shape[:3] if k_pool.dim() == 4 else (0, 0, 0)
    ok = (B > 0 and head_dim % 8 == 0 and head_dim > 0 and k_pool.shape == v_pool.shape
          and k_pool.shape[3] == head_dim and kv_heads > 0 and n_heads % kv_heads == 0
          and q.dtype == k_pool.dtype == v_pool.dtype == torch.float32
          and q.device.type == k_pool.device.type == v_pool.device.type == "cpu"
          and k_pool.is_contiguous() and v_pool.is_contiguous()
          and block_tables.dim() == 2 and block_tables.shape[0] == B and first.shape == last.shape == (B,)
          and block_tables.dtype == first.dtype == last.dtype == torch.int64
          and block_tables.device.type == first.device.type == last.device.type == "cpu")
    if not ok or (check and not paged_ranges_fit(block_tables, first, last, num_blocks, block_size)):
        raise ValueError(f"paged_decode_attention takes float32 CPU q [B, heads, D] (D a multiple of 8), contiguous "
                         f"pools [num_blocks, block_size, kv_heads, D], int64 block_tables [B, max_blocks] of the "
                         f"pool's blocks and int64 first < last [B] within the tables; got q {q.dtype} "
                         f"{list(q.shape)}, k_pool {k_pool.dtype} {list(k_pool.shape)}, block_tables "
                         f"{block_tables.dtype} {list(block_tables.shape)}, first {first.tolist()}, "
                         f"last {last.tolist()}")
    keys_per_task = max(n for n in range(1, 33) if block_size % n == 0)  # a chunk within one block, <= 32 keys
    tables, first, last = block_tables.contiguous(), first.contiguous(), last.contiguous()
    q, out = q.contiguous(), _output(B, n_heads, head_dim)
    kernels().paged_decode_attention(
        q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(), tables.data_ptr(), first.data_ptr(),
        last.data_ptr(), B, n_heads, kv_heads, head_dim, block_size, tables.shape[1], keys_per_task, scale,
        torch.get_num_threads())
    return out


def paged_ranges_fit(block_tables: torch.Tensor, first: torch.Tensor, last: torch.Tensor, num_blocks: int,
                      block_size: int) -> bool:
    """0 <= first < last <= the tables' positions, and every block id a block of the pool."""
    return (bool((first >= 0).all()) and bool((first < last).all())
            and int(last.max()) <= block_tables.shape[1] * block_size
            and 0 <= int(block_tables.min()) and int(block_tables.max()) < num_blocks)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in one pass (matvec_kernels.c's ``rms_norm``): x [..., dim] float32 CPU, contiguous, weight
    [dim] float32 -> (x, x · 1/sqrt(mean(x²) + eps) · weight) [..., dim], minillm.model.RMSNorm's values
    up to float rounding. With ``delta`` (x's shape), the residual add first: returns (x + delta, its
    norm), the sum in a new tensor. Raises ValueError for other dtypes, devices, layouts or shapes."""
    return _rms_norm(kernels(), x, weight, eps, delta)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation in one pass (matvec_kernels.c's ``silu_mul``): gate_up [..., 2F] float32 CPU,
    contiguous (the stacked gate|up product) -> silu(gate) · up [..., F] float32, gate and up its two
    halves (``chunk(2, -1)``). Same values as ``F.silu(gate) * up`` up to float rounding. Raises
    ValueError for another dtype, device or layout."""
    if (gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or not gate_up.is_contiguous()
            or gate_up.dim() == 0 or gate_up.shape[-1] % 2):
        raise ValueError(f"silu_mul takes a contiguous float32 CPU tensor [..., 2F], got {gate_up.dtype} "
                         f"{list(gate_up.shape)} on {gate_up.device.type}; use F.silu(gate) * up")
    F = gate_up.shape[-1] // 2
    out = _output(*gate_up.shape[:-1], F)
    if out.numel():
        kernels().silu_mul(gate_up.data_ptr(), out.data_ptr(), out.numel() // F, F, torch.get_num_threads())
    return out
