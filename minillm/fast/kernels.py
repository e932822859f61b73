"""The C kernels (csrc/*.c): built at first use, called through ctypes, and as torch ops from compiled code.

One C file a family, each opening with the scalar reference it computes; one section of this module a
family, each function a kernel, checking what the C loops would misread (they trust shapes):

    csrc/products.c    float32 products of a few rows        f32_matvec, f32_pack_panels, f32_panel_matmul,
                                                             f32_rows_matmul
    csrc/bf16_products.c  bfloat16 products of a few rows    bf16_matvec, bf16_rows_matmul
    csrc/bf16_amx.c    bfloat16 products on AMX, w in place  bf16_amx_matmul, bf16_amx_ready
    csrc/quantized.c   int8 and int4 products                quantized_matvec, quantized_matmul, dequantize,
                                                             quantized_pack_panels, quantized_panel_matmul
    csrc/quantized_vnni.c  int8, int4 at one row, VNNI     (quantized_matvec's one row), quantized_vnni_ready
    csrc/quantized_amx.c  int8, int4 products on AMX      int8_amx_matmul, int4_amx_matmul, quantized_amx_ready
    csrc/attention.c   decode's and prefill's attention      decode_attention, paged_decode_attention,
                                                             causal_attention
    csrc/attention_bf16.c  bfloat16 prefill attention       causal_attention_bf16 (AMX tiles, or AVX512-BF16)
    csrc/rms_norm.c    the residual add and RMSNorm          rms_norm
    csrc/silu_mul.c    SwiGLU's activation                   silu_mul
    csrc/rope.c        RoPE of queries and keys in one call  rope
    csrc/common.h      what they share: the vector type, the panel micro-kernel's shape, a vector exp, a transpose
    csrc/amx.h         what the AMX products share: the tile configuration
    csrc/quantized_digits.h  what the quantised products at float32's precision share: x as four int8 digits
    csrc/ops.cpp       a few of them as torch ops, for compiled code

Why C and not PyTorch: a decode step's product is one row (a few) by a matrix, so its floor is reading
the weights; MKL reads a one-row float32 product with one core (minillm.fast.products), and a quantised
kernel must widen the codes to float as fast as it reads them, which torch's int8/int4 ops do not on a
CPU (``torch._weight_int8pack_mm`` took 3.8-9.0x the C's time at one row, 19-99x at 32). Where the CPU has matrix
units (Intel AMX), the tiles' operand layout decides: bf16_amx.c and quantized_amx.c (int8) read the weight as it
lies, where oneDNN reorders it at every call or keeps a second copy. BENCHMARKS.md ("The C kernels against
PyTorch") has each family against what PyTorch ships for the
same work, on this project's machines; a kernel that does not win there is not kept.

The C compiler is the one ``torch.compile`` also needs (``cc``, or ``$CC``); the build takes about a
second, once per machine: it is kept in ``<weights_dir>/kernels/`` (``-march=native``: for this CPU
only, so the CPU's name is part of its file name). ``kernels(portable=True)`` is the same sources without
``-march=native`` (no AVX2 or AVX-512 branch: what another CPU compiles); the tests check every kernel on
both. With no compiler, :func:`available` is False and quantised matrices run their reference product
(4-9x slower than float32), saying so once.

Each function takes ``lib``, the library to run (default: :func:`kernels`). The products and decode's
attention are also torch ops (``torch.ops.minillm.f32_matvec``, ...), which is how a ``torch.compile``'d
decode step calls them: dynamo cannot trace into ctypes, and an op is opaque to it by design. The ops'
implementations are csrc/ops.cpp, built at the first compile with ``c++`` (``$CXX``) against torch's
headers, 12-19 s once a machine: an op implemented in Python cost the graph ~30 us a call, ~1.2 ms of a
SmolLM2 step (measured, A/B over five process pairs). Without a C++ compiler, or where the build fails
(kept as a ``.failed`` file beside the kernels, so the next process does not spend the build again), the
ops call this module's functions, with a one-line warning.
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

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("common.h", "amx.h", "quantized_digits.h", "products.c", "bf16_products.c",
                                    "bf16_amx.c", "quantized.c", "quantized_vnni.c", "quantized_amx.c", "attention.c",
                                    "attention_bf16.c",
                                    "rms_norm.c", "silu_mul.c", "rope.c")]  # what the library is built from
OPS_SOURCE = CSRC / "ops.cpp"  # the products and decode attention as torch ops, for compiled code
# first OpenMP (threads), then without it (macOS clang has no -fopenmp: one thread), then portable
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])
PORTABLE_FLAG_SETS = (["-O3", "-fopenmp"], ["-O3"])  # no -march=native: the vector code every x86-64 runs

_state: dict[str, object] = {}  # "lib" / "portable": the loaded library or None, "why": the reason it is None


def kernels(portable: bool = False) -> ctypes.CDLL | None:
    """The built library, or None when no flag set compiles (the reason: :func:`unavailable_reason`).
    ``portable``: built without -march=native (kept like the native one; the tests run every kernel on it)."""
    key = "portable" if portable else "lib"
    if key not in _state:
        _state[key], why = _build(PORTABLE_FLAG_SETS if portable else FLAG_SETS)
        if not portable:
            _state["why"] = why
        if _state[key] is None and not portable:
            warnings.warn(f"the C matvec kernels are not available ({why}): quantised models run "
                          "the reference path (dequantise, then F.linear), 4-9x slower than float32 (measured), "
                          "and float32 keeps MKL's products; install a C compiler (cc) or set CC",
                          RuntimeWarning, stacklevel=3)
    return _state[key]


def unavailable_reason() -> str | None:
    """Why :func:`kernels` is None (None when they are built or not yet tried)."""
    return _state.get("why")


def available() -> bool:
    """Whether the kernels are built (building them at the first call)."""
    return kernels() is not None


def _build(flag_sets=FLAG_SETS, cache_dir: Path | None = None) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library built with the first flag set that compiles, None), or (None, why not).

    A build is kept in ``cache_dir`` (default: :func:`cache_folder`) under a name made of the
    sources, the compiler, the flags and the CPU's name, so later processes load it instead of
    compiling again (~1 s a process); where the folder cannot be written, the build stays temporary.
    """
    compiler = shlex.split(os.environ.get("CC") or "cc")  # CC may carry flags: "gcc -std=c11"
    if not compiler or shutil.which(compiler[0]) is None:
        return None, f"no C compiler {os.environ.get('CC') or 'cc'!r} on PATH"
    cache_dir = cache_folder() if cache_dir is None else cache_dir
    c_files = [str(s) for s in SOURCES if s.suffix == ".c"]
    with tempfile.TemporaryDirectory(prefix="minillm-kernels-") as tmp:
        error = ""
        for flags in flag_sets:
            kept = cache_dir / f"kernels-{_build_key(compiler, flags, SOURCES)}.so"
            if kept.is_file() and (loaded := _load(kept))[0] is not None:
                return loaded  # (a kept file that does not load, e.g. truncated, is built again and replaced)
            out = Path(tmp) / "kernels.so"
            run = subprocess.run([*compiler, *flags, "-shared", "-fPIC", *c_files, "-lm", "-o", str(out)],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                _keep(out, kept)
                return _load(out)  # (not kept: a process that tried a bad file there has that path's handle)
            error = (run.stderr.strip().splitlines() or ["failed"])[-1]
    return None, f"{' '.join(compiler)} could not build {CSRC.name}/*.c: {error}"


def cache_folder() -> Path:
    """``<weights_dir>/kernels``: the built libraries, beside calibration.json."""
    from ..paths import weights_dir

    return weights_dir() / "kernels"


def _build_key(compiler: list[str], flags: list[str], sources: list[Path]) -> str:
    """What decides the binary: the sources, the compiler and its flags, (-march=native) the CPU, and
    (the ops' C++) torch's version."""
    from ..hardware import device_name

    parts = [*(source.read_bytes() for source in sources), " ".join(compiler + flags).encode(),
             device_name(torch.device("cpu")).encode(), torch.__version__.encode()]
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


_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
C_FUNCTIONS = {  # name: (argument types, result type), as csrc/*.c declares them
    # products.c
    "f32_matmul_reference": ([_P, _P, _P, _I, _I, _I], None),
    "f32_matvec": ([_P, _P, _P, _I, _I, _I, _I], None),
    "f32_panel_width": ([], _I),
    "f32_pack_panels": ([_P, _P, _I, _I, _I], None),
    "f32_panel_matmul": ([_P, _P, _P, _I, _I, _I, _I], None),
    "f32_rows_matmul": ([_P, _P, _P, _I, _I, _I, _I], _I),
    # bf16_products.c
    "bf16_matmul_reference": ([_P, _P, _P, _I, _I, _I], None),
    "bf16_matvec": ([_P, _P, _P, _I, _I, _I, _I], _I),
    "bf16_rows_matmul": ([_P, _P, _P, _I, _I, _I, _I], _I),
    "bf16_dot_instructions": ([], _I),
    # bf16_amx.c
    "bf16_amx_ready": ([], _I),
    "bf16_amx_matmul": ([_P, _P, _P, _P, _I, _I, _I, _I], _I),
    # quantized.c
    "quantized_matmul_reference": ([_P, _P, _P, _P, _P, _I, _I, _I, _I], None),
    "int8_matvec": ([_P, _P, _P, _P, _I, _I, _I, _I], _I),
    "int4_matvec": ([_P, _P, _P, _P, _P, _I, _I, _I, _I, _I], _I),
    "int8_matmul": ([_P, _P, _P, _P, _I, _I, _I, _I], _I),
    "int4_matmul": ([_P, _P, _P, _P, _P, _I, _I, _I, _I, _I], _I),
    "int8_dequantize": ([_P, _P, _P, _I, _I, _I], _I),
    "int4_dequantize": ([_P, _P, _P, _P, _I, _I, _I, _I], _I),
    "int8_pack_panels": ([_P, _P, _P, _P, _P, _I, _I, _I], None),
    "int4_pack_panels": ([_P, _P, _P, _P, _P, _P, _I, _I, _I, _I], None),
    "quantized_panels_vectorised": ([], _I),
    "quantized_panel_matmul": ([_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I], None),
    # quantized_vnni.c
    "quantized_vnni_ready": ([], _I),
    # quantized_amx.c
    "quantized_amx_ready": ([], _I),
    "int8_amx_matmul": ([_P, _P, _P, _P, _I, _I, _I, _I], _I),
    "int4_amx_matmul": ([_P, _P, _P, _P, _P, _I, _I, _I, _I, _I], _I),
    # attention.c
    "attention_reference": ([_P, _P, _P, _P, _I, _I, _F], None),
    "decode_attention": ([_P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _L, _L, _L, _L, _F, _I], _I),
    "paged_decode_attention": ([_P, _P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _I], _I),
    "causal_attention": ([_P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _L, _L, _L, _L, _L, _L, _L, _L, _L, _F, _I],
                         _I),
    # attention_bf16.c
    "causal_attention_bf16": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _L, _L, _L, _L, _L, _L, _L, _L, _F, _I, _I], _I),
    # rms_norm.c, silu_mul.c
    "rms_norm_reference": ([_P, _P, _P, _L, _I, _F], None),
    "rms_norm": ([_P, _P, _P, _P, _P, _L, _I, _F, _I], None),
    "rms_norm_bf16": ([_P, _P, _P, _P, _P, _L, _I, _F, _I], None),
    "silu_mul_reference": ([_P, _P, _L, _I], None),
    "silu_mul": ([_P, _P, _L, _I, _I], None),
    "silu_mul_bf16": ([_P, _P, _L, _I, _I], None),
    "silu_mul_bf16_vectorised": ([], _I),
    # rope.c
    "rope": ([_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _L, _L, _L, _L, _L, _L, _I, _I], None),
}


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (arguments, result) in C_FUNCTIONS.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = arguments, result
    return lib


def prepare_for_compile() -> None:
    """Before torch.compile traces code that calls the kernels: build them and their torch ops, and
    make :func:`available` a constant to the tracer (it cannot trace the build). Done here, not at
    import: marking it imports torch._dynamo, ~70 MB of RSS that a process which never compiles need
    not hold, and building the ops takes 12-19 s once a machine."""
    if kernels() is not None:
        _register_ops()
    torch.compiler.assume_constant_result(available)
    torch.compiler.assume_constant_result(bf16_amx_ready)
    torch.compiler.assume_constant_result(quantized_amx_ready)


def functions():
    """The kernels as this module's plain functions, or as torch ops while torch.compile traces (it
    cannot trace into their ctypes calls; an op's dispatch costs eager code ~20 us a call)."""
    return torch.ops.minillm if torch.compiler.is_compiling() else sys.modules[__name__]


def _output(*shape: int) -> torch.Tensor:
    """An uninitialised float32 CPU tensor for a C loop to fill: float32 whatever torch's default dtype
    (the loops write float32 bits)."""
    return torch.empty(*shape, dtype=torch.float32)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# -- float32 products (csrc/products.c): x and the results float32, row-major -----------------------


class Panels(NamedTuple):
    """A float32 matrix [out_features, in] copied into panels of P outputs (:func:`f32_pack_panels`):
    ``data[p, i, l] = weight[p·P + l, i]``, [ceil(out_features / P), in, P] float32, zeros past
    out_features; P the build's panel width (:func:`panel_width`). Made by f32_pack_panels, not by
    hand: an out_features changed within the last panel cannot be told from the data."""

    data: torch.Tensor
    out_features: int


def f32_matvec(x: torch.Tensor, weight: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] float32, weight [out, in] float32 (row-major) -> x @ weightᵀ [rows, out] float32, each
    weight read once for all rows (a decode step's few). Raises ValueError for other dtypes, devices or shapes."""
    lib = lib or kernels()
    _check_matvec("f32_matvec", torch.float32, x, weight)
    x = x.contiguous()
    y = _output(x.shape[0], weight.shape[0])
    lib.f32_matvec(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1],
                   torch.get_num_threads())
    return y


def f32_rows_matmul(x: torch.Tensor, weight: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] float32, weight [out, in] float32 (row-major, read in place) -> x @ weightᵀ [rows, out] float32:
    x copied transposed, its rows along a vector's lanes, each weight broadcast to them (csrc/products.c), for a
    server's batch of decodes without a packed copy of the matrix. Raises ValueError for other dtypes, devices or
    shapes, MemoryError when x's transposed copy cannot be allocated."""
    lib = lib or kernels()
    _check_matvec("f32_rows_matmul", torch.float32, x, weight)
    x = x.contiguous()
    y = _output(x.shape[0], weight.shape[0])
    if lib.f32_rows_matmul(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], weight.shape[0],
                           weight.shape[1], torch.get_num_threads()):
        raise MemoryError(f"f32_rows_matmul could not allocate x's transposed copy (more than {x.numel() * 4:,} bytes: "
                          "its rows padded to a block)")
    return y


def panel_width(*, lib: ctypes.CDLL | None = None) -> int:
    """The floats of one panel in this build: 32 with AVX-512, 16 with AVX or AVX2, 8 in a portable build
    (:class:`Panels`' last dimension, and what causal_attention's head_dim must be a multiple of)."""
    return (lib or kernels()).f32_panel_width()


def f32_pack_panels(weight: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> Panels:
    """weight [out, in] float32 CPU (row-major) -> its copy in :class:`Panels`, what
    :func:`f32_panel_matmul` reads. Raises ValueError for another dtype, device or layout."""
    lib = lib or kernels()
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"f32_pack_panels packs a contiguous float32 CPU matrix [out, in], got {weight.dtype} "
                         f"{list(weight.shape)} on {weight.device.type}")
    width = lib.f32_panel_width()
    out, in_features = weight.shape
    data = torch.empty(-(-out // width), in_features, width, dtype=torch.float32)
    lib.f32_pack_panels(weight.data_ptr(), data.data_ptr(), out, in_features, torch.get_num_threads())
    return Panels(data, out)


def f32_panel_matmul(x: torch.Tensor, panels: Panels, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] float32 @ wᵀ -> [rows, out_features] float32, w given as its :class:`Panels`
    (csrc/products.c says how; F.linear's values up to float rounding). Raises ValueError when x does
    not fit the copy."""
    lib = lib or kernels()
    data, out_features = panels if isinstance(panels, Panels) else (x.new_empty(0), -1)
    if (isinstance(out_features, bool) or not isinstance(out_features, int) or out_features < 0
            or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2
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


# -- bfloat16 products (csrc/bf16_products.c): x, the weight and the results bfloat16, row-major -------


def _check_matvec(name: str, dtype: torch.dtype, x: torch.Tensor, weight: torch.Tensor) -> None:
    """One line, unless x [rows, in] and a contiguous weight [out, in] are ``dtype`` CPU tensors without autograd:
    TypeError for what is not a tensor, else ValueError."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} takes tensors x and weight, got {type(x).__name__} and {type(weight).__name__}")
    if x.dtype != dtype or weight.dtype != dtype or x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"{name} takes {str(dtype).removeprefix('torch.')} CPU tensors, got x {x.dtype} on "
                         f"{x.device.type} and weight {weight.dtype} on {weight.device.type}; use F.linear")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name} multiplies x [rows, in] by a weight [out, in] of the same in, got x "
                         f"{list(x.shape)} and weight {list(weight.shape)}; reshape x to [rows, in]")
    if not weight.is_contiguous():
        raise ValueError(f"{name} reads the weight row-major, got a weight {list(weight.shape)} with strides "
                         f"{list(weight.stride())} (contiguous: False); pass weight.contiguous()")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        raise ValueError(f"{name} has no backward pass, and x or the weight requires grad; use F.linear, or call "
                         "it under torch.no_grad()")


def bf16_matvec(x: torch.Tensor, weight: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] bfloat16, weight [out, in] bfloat16 (row-major) -> x @ weightᵀ [rows, out] bfloat16, the
    sums in float32, each weight read once for all rows (a decode step's few). Raises ValueError for other
    dtypes, devices or shapes, MemoryError when its scratch copy of x cannot be allocated."""
    lib = lib or kernels()
    _check_matvec("bf16_matvec", torch.bfloat16, x, weight)
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    if lib.bf16_matvec(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1],
                       torch.get_num_threads()):
        raise MemoryError(f"bf16_matvec could not allocate {x.numel() * 4:,} bytes for a float32 copy of x")
    return y


def bf16_rows_matmul(x: torch.Tensor, weight: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] bfloat16, weight [out, in] bfloat16 (row-major, read in place), in even -> x @ weightᵀ [rows, out]
    bfloat16, the sums in float32: x copied into pairs with its rows along a vector's lanes, each pair of weights
    broadcast to them by AVX512-BF16's dot products (csrc/bf16_products.c), for a server's batch of decodes; the dot
    products flush subnormal results (below 2^-126) to zero, as bf16_matvec's (F.linear keeps them). Raises
    ValueError for other dtypes, devices or shapes, an odd ``in`` or a build without AVX512-BF16
    (:func:`bf16_dot_instructions`), MemoryError when x's copy cannot be allocated."""
    lib = lib or kernels()
    _check_matvec("bf16_rows_matmul", torch.bfloat16, x, weight)
    if not bf16_dot_instructions(lib=lib):
        raise ValueError("bf16_rows_matmul needs a build with AVX512-BF16 (bf16_dot_instructions() is False here); use "
                         "F.linear or bf16_matvec")
    if x.shape[1] % 2:
        raise ValueError(f"bf16_rows_matmul multiplies pairs: in must be even, got {x.shape[1]}; use F.linear")
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    if lib.bf16_rows_matmul(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], weight.shape[0],
                            weight.shape[1], torch.get_num_threads()):
        raise MemoryError(f"bf16_rows_matmul could not allocate x's copy in pairs (more than {x.numel() * 2:,} bytes: "
                          "its rows padded to a block)")
    return y


def bf16_dot_instructions(*, lib: ctypes.CDLL | None = None) -> bool:
    """Whether this build's :func:`bf16_matvec` multiplies with AVX512-BF16's dot-product instruction
    (elsewhere it widens each weight to float32 by a shift), and :func:`causal_attention_bf16` runs."""
    return _asked_once("bf16_dot_instructions", lib)


def bf16_amx_ready(*, lib: ctypes.CDLL | None = None) -> bool:
    """Whether :func:`bf16_amx_matmul` runs here: the build targets AMX-BF16 (``-march=native`` on an Intel
    Xeon from Sapphire Rapids on) and Linux granted this process the tile registers. False for a portable
    build and on every other CPU."""
    return _asked_once("bf16_amx_ready", lib)


def _asked_once(question: str, lib: ctypes.CDLL | None) -> bool:
    """The library's answer to the C function ``question()``; the default library's asked once (a product asks
    at every call)."""
    if lib is not None:
        return bool(getattr(lib, question)())
    if question not in _state:
        _state[question] = kernels() is not None and bool(getattr(kernels(), question)())
    return _state[question]


def bf16_amx_fits(weight: torch.Tensor) -> bool:
    """Whether :func:`bf16_amx_matmul` takes this [out, in] weight's shape: in a multiple of 32 (a tile's ks),
    out a multiple of 16 (a tile's outputs)."""
    return weight.dim() == 2 and weight.shape[1] % 32 == 0 and weight.shape[0] % 16 == 0


def bf16_amx_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] bfloat16, weight [out, in] bfloat16 (row-major), bias [out] bfloat16 or None -> x @ weightᵀ +
    bias [rows, out] bfloat16 on the CPU's matrix units (Intel AMX), the weight read in place, the sums in float32,
    the bias added to them, rounded once to nearest even as F.linear rounds (csrc/bf16_amx.c). Raises ValueError
    for other dtypes, devices or shapes (:func:`bf16_amx_fits`), or where it does not run
    (:func:`bf16_amx_ready`); MemoryError when x's packed copy cannot be allocated."""
    lib = lib or kernels()
    _check_matvec("bf16_amx_matmul", torch.bfloat16, x, weight)
    if not bf16_amx_fits(weight) or x.shape[0] == 0:
        raise ValueError(f"bf16_amx_matmul takes a weight [out, in] with out a multiple of 16 and in a multiple of "
                         f"32, and at least one row, got x {list(x.shape)} and weight {list(weight.shape)}; "
                         "use F.linear")
    if not bf16_amx_ready(lib=lib):
        raise ValueError("bf16_amx_matmul needs a build for AMX-BF16 (an Intel Xeon from Sapphire Rapids on, "
                         "-march=native) and the tile registers granted by Linux; use F.linear")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)
                             or bias.dtype != torch.bfloat16 or bias.device.type != "cpu"):
        what = (f"{bias.dtype} {list(bias.shape)} on {bias.device.type}" if isinstance(bias, torch.Tensor)
                else type(bias).__name__)
        raise ValueError(f"bf16_amx_matmul's bias is bfloat16 [out] = [{weight.shape[0]}] on the CPU (as F.linear "
                         f"takes it), got {what}")
    return bf16_amx_unchecked(x, weight, None if bias is None else bias.float().contiguous(), lib)


def bf16_amx_unchecked(x: torch.Tensor, weight: torch.Tensor, bias32: torch.Tensor | None,
                       lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """:func:`bf16_amx_matmul` without its checks (the bias float32 [out]), for a caller that made them once:
    a decode step makes ~120 products, and the checks cost each a third of a small one's time."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    bias_pointer = None if bias32 is None else bias32.data_ptr()
    if (lib or kernels()).bf16_amx_matmul(x.data_ptr(), weight.data_ptr(), bias_pointer, y.data_ptr(), x.shape[0],
                                          weight.shape[0], weight.shape[1], torch.get_num_threads()):
        raise MemoryError(f"bf16_amx_matmul could not allocate {-(-x.shape[0] // 16) * 32 * x.shape[1]:,} bytes "
                          "for x's packed copy")
    return y


# -- quantised products (csrc/quantized.c): int8 codes when zero is None, else int4 -----------------
#
#   int8  codes [out, in] int8,      scale [out] float32                        ŵ = q · scale[o]
#   int4  codes [out, in/2] uint8,   scale [out, in/G] float32, zero [out, in/G] uint8,
#         G = group_size (a multiple of 16 dividing in)                          ŵ = (q - zero) · scale


class QuantizedPanels(NamedTuple):
    """An int8 or int4 matrix [out_features, in] copied into panels (:func:`quantized_pack_panels`):
    ``codes`` [panels, in, P] int8, or [panels, in, P/2] uint8 (the outputs l and l + P/2 in one byte,
    low and high nibble); ``scales`` and ``offsets`` [panels, groups, P] float32 (int8: one group),
    ŵ = q · scale + offset (offset = -zero · scale: quantize.py's values)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    out_features: int


def quantized_matvec(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                     group_size: int = 0, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] float32 @ ŵᵀ -> [rows, out] float32 (the codes above), each code widened to float once a
    row: for 1-3 rows (a decode step's). One row, where the build has AVX512-VNNI (:func:`quantized_vnni_ready`),
    in is a multiple of 64 up to AMX_MAX_IN and out a multiple of 4 (int4: of 2, and groups a multiple of 64), runs
    on the vector units instead: x as four int8 digits by the codes (csrc/quantized_vnni.c), within
    :func:`quantized_amx_matmul`'s bound of float64's result. Raises ValueError for codes the loops would misread,
    MemoryError when its scratch copy of x (one row's digits) cannot be allocated."""
    return _quantized_product("matvec", lib or kernels(), x, codes, scale, zero, group_size)


def quantized_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                     group_size: int = 0, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """A batch of rows (a serving step's decodes): x [rows, in] float32 @ ŵᵀ -> [rows, out] float32, the
    matrix dequantised a tile at a time (csrc/quantized.c says how), each tile once for all rows. Same
    values as :func:`quantized_matvec` up to float rounding; faster from a few rows. Raises as it does."""
    return _quantized_product("matmul", lib or kernels(), x, codes, scale, zero, group_size)


def _quantized_product(kernel: str, lib: ctypes.CDLL, x, codes, scale, zero, group_size) -> torch.Tensor:
    op = f"quantized_{kernel}"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op} takes tensors, got x {type(x).__name__}")
    x = x.contiguous()
    y = _output(x.shape[0], codes.shape[0])
    function, arguments = quantized_call(kernel, lib, x, codes, scale, zero, group_size, y)  # (checks them)
    if function(*arguments):
        raise MemoryError(f"{op} could not allocate {x.numel() * 8:,} bytes for a copy of x and its scratch")
    return y


def quantized_call(kernel: str, lib: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                   zero: torch.Tensor | None, group_size: int, y: torch.Tensor) -> tuple:
    """(the C function, its arguments) that :func:`quantized_matvec` (``kernel`` "matvec") or
    :func:`quantized_matmul` ("matmul") calls for y = x @ ŵᵀ: x [rows, in] contiguous and y [rows, out] float32
    (x and the codes checked here, as those functions check them: ValueError, TypeError); the function returns 0,
    or 1 when its scratch could not be allocated. For a caller that calls it again on the same buffers
    (:mod:`minillm.fast.replay`)."""
    _check_codes(f"quantized_{kernel}", codes, scale, zero, group_size, x)
    pointers, sizes = (x.data_ptr(), codes.data_ptr(), scale.data_ptr()), (x.shape[0], codes.shape[0], x.shape[1])
    if zero is None:
        return getattr(lib, f"int8_{kernel}"), (*pointers, y.data_ptr(), *sizes, torch.get_num_threads())
    return getattr(lib, f"int4_{kernel}"), (*pointers, zero.data_ptr(), y.data_ptr(), *sizes, group_size,
                                            torch.get_num_threads())


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, group_size: int = 0,
               *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The float32 matrix ŵ [out, in] of the codes above: what prefill multiplies (many rows: one float
    product beats re-reading the codes a row at a time); minillm.quantize's dequantize_int8 /
    dequantize_int4 values up to float rounding."""
    lib = lib or kernels()
    _check_codes("dequantize", codes, scale, zero, group_size)
    out, in_features = codes.shape[0], codes.shape[1] * (1 if zero is None else 2)
    w = _output(out, in_features)
    if zero is None:
        lib.int8_dequantize(codes.data_ptr(), scale.data_ptr(), w.data_ptr(), out, in_features, torch.get_num_threads())
    else:
        lib.int4_dequantize(codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), w.data_ptr(), out, in_features,
                            group_size, torch.get_num_threads())
    return w


def quantized_pack_panels(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                          group_size: int | None = None, *, lib: ctypes.CDLL | None = None) -> QuantizedPanels:
    """The codes above copied into :class:`QuantizedPanels`, what :func:`quantized_panel_matmul` reads.
    Raises ValueError for codes the kernels would misread."""
    lib = lib or kernels()
    _check_codes("quantized_pack_panels", codes, scale, zero, group_size)
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


def quantized_panels_vectorised(*, lib: ctypes.CDLL | None = None) -> bool:
    """Whether this build converts codes in :func:`quantized_panel_matmul` with vector instructions (AVX2 or
    AVX-512); elsewhere the tiled kernels (:func:`quantized_matmul`) are faster."""
    return bool((lib or kernels()).quantized_panels_vectorised())


def quantized_panel_matmul(x: torch.Tensor, panels: QuantizedPanels, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """A server's batch of rows over quantised weights: x [rows, in] float32 @ ŵᵀ -> [rows, out_features]
    float32 from the :class:`QuantizedPanels`, each weight dequantised in registers as the panel
    micro-kernel loads it (csrc/quantized.c). Same values as :func:`quantized_matmul` up to float rounding.
    Raises ValueError when x does not fit the copy."""
    lib = lib or kernels()
    if not isinstance(panels, QuantizedPanels):
        raise ValueError(f"quantized_panel_matmul multiplies x by quantized_pack_panels' QuantizedPanels, got "
                         f"{type(panels).__name__}; pack the matrix with quantized_pack_panels")
    codes, scales, offsets, out_features = panels
    width, int4 = lib.f32_panel_width(), codes.dtype == torch.uint8
    fits = (isinstance(out_features, int) and not isinstance(out_features, bool) and codes.dim() == 3
            and scales.dim() == 3 and codes.dtype in (torch.int8, torch.uint8) and codes.is_contiguous()
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


def quantized_amx_ready(*, lib: ctypes.CDLL | None = None) -> bool:
    """Whether :func:`quantized_amx_matmul` runs here: the build targets AMX-INT8 (``-march=native`` on an Intel
    Xeon from Sapphire Rapids on) and Linux granted this process the tile registers. False for a portable
    build and on every other CPU."""
    return _asked_once("quantized_amx_ready", lib)


def quantized_vnni_ready(*, lib: ctypes.CDLL | None = None) -> bool:
    """Whether :func:`quantized_matvec` runs one row on the vector units (csrc/quantized_vnni.c): the build
    targets AVX-512 with VNNI (``-march=native`` on an Intel Xeon from Cascade Lake, an AMD from Zen 4). False
    for a portable build and on every other CPU."""
    return _asked_once("quantized_vnni_ready", lib)


AMX_MAX_IN = 131072  # in·127·128 < 2^31: the int32 sums of quantized_amx.c cannot overflow


def quantized_amx_fits(codes: torch.Tensor, group_size: int | None = None) -> bool:
    """Whether :func:`quantized_amx_matmul` takes these codes (int8 [out, in], or with a ``group_size`` int4
    [out, in/2]): in a multiple of 64 (a tile's ks) and at most AMX_MAX_IN, out a multiple of 16 (a tile's outputs),
    int4 groups whole tiles (group_size a multiple of 64)."""
    in_features = codes.shape[-1] * (1 if group_size is None else 2)
    return (codes.dim() == 2 and in_features % 64 == 0 and in_features <= AMX_MAX_IN and codes.shape[0] % 16 == 0
            and (group_size is None or group_size % 64 == 0))


def quantized_amx_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                         group_size: int = 0, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [rows, in] float32 @ ŵᵀ -> [rows, out] float32 on the CPU's matrix units (Intel AMX-INT8), ŵ the codes
    above (int8 when zero is None, else int4 in groups of ``group_size``). x is written as four int8 digits a
    value, off by less than 1e-9 of its row's largest |x| (csrc/quantized_amx.c), so the result is
    ``F.linear(x, ŵ)``'s up to float32 rounding for rows whose largest value is up to ~10^5 times the rest (the
    error grows with that ratio beyond): the activations are not quantised. int8 codes are read in place; int4 codes
    are unpacked 32 rows at a time, or at one row of x split into nibbles in registers and multiplied on the vector
    units (AVX512-VNNI), which stream them faster there.

    Raises ValueError for codes the kernel would misread, shapes it does not take (:func:`quantized_amx_fits`), or
    where it does not run (:func:`quantized_amx_ready`); MemoryError when x's digits cannot be allocated."""
    lib = lib or kernels()
    op = "quantized_amx_matmul"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op} takes tensors, got x {type(x).__name__}")
    _check_codes(op, codes, scale, zero, group_size, x)
    if not quantized_amx_fits(codes, None if zero is None else group_size):
        raise ValueError(f"{op} takes codes for [out, in] with out a multiple of 16, in a multiple of 64 up to "
                         f"{AMX_MAX_IN} (int4: group_size a multiple of 64 too), got codes {list(codes.shape)}"
                         + ("" if zero is None else f", group_size {group_size}") + "; use quantized_matmul")
    if not quantized_amx_ready(lib=lib):
        raise ValueError(f"{op} needs a build for AMX-INT8 (an Intel Xeon from Sapphire Rapids on, -march=native) "
                         "and the tile registers granted by Linux; use quantized_matmul")
    return quantized_amx_unchecked(x, codes, scale, zero, group_size, lib)


def quantized_amx_unchecked(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                            group_size: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """:func:`quantized_amx_matmul` without its checks, for a caller that made them once (a quantised layer,
    whose codes the format made)."""
    lib = lib or kernels()
    x = x.contiguous()
    y = _output(x.shape[0], codes.shape[0])
    if x.shape[0] == 0:
        return y
    sizes = (x.shape[0], codes.shape[0], x.shape[1])
    if zero is None:
        status = lib.int8_amx_matmul(x.data_ptr(), codes.data_ptr(), scale.data_ptr(), y.data_ptr(), *sizes,
                                     torch.get_num_threads())
    else:
        status = lib.int4_amx_matmul(x.data_ptr(), codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), y.data_ptr(),
                                     *sizes, group_size, torch.get_num_threads())
    if status:
        raise MemoryError(f"quantized_amx_matmul could not allocate {min(x.shape[0], 320) * x.shape[1] * 8:,} bytes "
                          "for x's digits")
    return y


def _check_codes(op: str, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                 group_size: int | None = None, x: torch.Tensor | None = None) -> None:
    """Refuse, in one line, what the C loops would read out of bounds or wrongly (they trust shapes).
    Each message is formatted only on failure: this runs on every product of a decode step."""
    int4 = zero is not None
    code_dtype = torch.uint8 if int4 else torch.int8
    if not (isinstance(codes, torch.Tensor) and isinstance(scale, torch.Tensor)
            and (zero is None or isinstance(zero, torch.Tensor)) and (x is None or isinstance(x, torch.Tensor))):
        named = (("codes", codes), ("scale", scale), ("zero", zero), ("x", x))
        raise TypeError(f"{op} takes tensors, got " + ", ".join(
            f"{name} {type(t).__name__}" for name, t in named
            if not isinstance(t, torch.Tensor) and (t is not None or name in ("codes", "scale"))))
    if any(t is not None and t.device.type != "cpu" for t in (codes, scale, zero, x)):  # (was: a crash)
        raise ValueError(f"{op}: the C kernels read CPU tensors, got codes on {codes.device.type}, scale on "
                         f"{scale.device.type}" + ("" if zero is None else f", zero on {zero.device.type}")
                         + ("" if x is None else f", x on {x.device.type}"))
    if int4 and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise ValueError(f"{op}: group_size must be an int, got {group_size!r}")
    if codes.dim() != 2 or not codes.is_contiguous() or codes.dtype != code_dtype:
        raise ValueError(f"{op}: codes must be a contiguous 2-D {_name(code_dtype)} tensor ({'int4' if int4 else 'int8'}: "
                         f"zero {'given' if int4 else 'None'}), got {codes.dtype} {list(codes.shape)}")
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


# -- attention (csrc/attention.c) -------------------------------------------------------------------


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_keys: int | torch.Tensor,
                     scale: float, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Decode's attention: softmax(scale · q·kᵀ) · v over the first ``n_keys`` keys.

    q [B, n_heads, 1, head_dim] (one new query a sequence); k, v [B, n_kv_heads, S, head_dim] with contiguous rows
    (a KV cache's buffer or a view of its first positions); all float32, or all bfloat16 (each chunk of keys and
    values widened to float32 as it is read, the sums float32; the softmax's numerators rounded to bfloat16 before
    they weigh the values, and the output once, where SDPA's CPU kernel rounds); n_heads a multiple of n_kv_heads
    (GQA), head_dim a multiple of 8; ``n_keys`` (an int or a one-element tensor, 1 <= n_keys <= S) how many keys
    the query sees. Returns [B, n_heads, 1, head_dim] of q's dtype, ``F.scaled_dot_product_attention``'s values up
    to float rounding. Raises ValueError for inputs the C loop would misread or an input that requires grad (it has
    no backward pass), MemoryError when its scratch cannot be allocated.
    """
    lib = lib or kernels()
    if isinstance(n_keys, torch.Tensor) and n_keys.numel() == 1 and n_keys.device.type == "cpu" \
            and not n_keys.is_floating_point() and not n_keys.is_complex():
        n_keys = int(n_keys)
    if not isinstance(n_keys, int) or not _is_number(scale):
        raise ValueError(f"decode_attention takes n_keys an int (or a one-element integer CPU tensor) and scale a "
                         f"number, got n_keys {n_keys!r} and scale {scale!r}")
    B, n_heads, T, head_dim = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    ok = (T == 1 and head_dim % 8 == 0 and head_dim > 0 and k.dim() == 4 and k.shape == v.shape
          and k.shape[0] == B and k.shape[1] > 0 and k.shape[3] == head_dim and n_heads % k.shape[1] == 0
          and q.dtype in (torch.float32, torch.bfloat16) and q.dtype == k.dtype == v.dtype
          and all(t.device.type == "cpu" for t in (q, k, v))
          and k.stride(3) == v.stride(3) == 1 and k.stride(2) == v.stride(2) == head_dim)
    if not ok or not 1 <= n_keys <= k.shape[2]:
        raise ValueError(f"decode_attention takes float32 (or all bfloat16) CPU q [B, heads, 1, D] (D a multiple of "
                         f"8) and k, v [B, kv_heads, S, D] with contiguous rows, heads a multiple of kv_heads, "
                         f"1 <= n_keys <= S; got q {q.dtype} {list(q.shape)}, k {k.dtype} {list(k.shape)} strides "
                         f"{list(k.stride())}, v {v.dtype} {list(v.shape)}, n_keys {n_keys}")
    if problem := _grad_problem(q, k, v):
        raise ValueError(f"decode_attention: {problem}; use F.scaled_dot_product_attention")
    q32, out = q.contiguous().float(), _output(*q.shape)
    status = lib.decode_attention(q32.data_ptr(), k.data_ptr(), v.data_ptr(), q.dtype == torch.bfloat16,
                                  out.data_ptr(), B, n_heads, k.shape[1], n_keys, head_dim, k.stride(0), k.stride(1),
                                  v.stride(0), v.stride(1), scale, torch.get_num_threads())
    if status:
        raise MemoryError("decode_attention could not allocate its partial results or a thread's float32 copy")
    return out.to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           first: torch.Tensor, last: torch.Tensor, scale: float, check: bool = True, *,
                           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Decode attention read from a paged pool in place.

    q [B, heads, head_dim]; k_pool, v_pool one layer's pool [num_blocks, block_size, kv_heads, head_dim],
    contiguous; q and the pools float32, or all bfloat16 (the keys and values widened to float32 as they are
    read, the sums float32, the output rounded to bfloat16 once); block_tables [B, max_blocks] int64; first,
    last [B] int64: sequence b attends over its positions first[b] <= j < last[b]. Returns [B, heads, head_dim]
    of q's dtype, softmax(scale · q·kᵀ) · v over those keys. Raises ValueError for other shapes, dtypes or
    devices, or (with ``check``) a block id outside the pool or a range outside its table (a caller that calls
    once a layer with the same tables checks them once: the check reads the tensors, ~0.1 ms); MemoryError
    when a bfloat16 chunk's float32 scratch cannot be allocated.
    """
    lib = lib or kernels()
    _check_tensors("paged_decode_attention", q=q, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables,
                   first=first, last=last)
    problem = (_paged_problem(q, k_pool, v_pool, block_tables, first, last, check) or _scale_problem(scale)
               or _grad_problem(q, k_pool, v_pool))
    if problem:
        raise ValueError(f"paged_decode_attention: {problem}")
    B, n_heads, head_dim = q.shape
    block_size, kv_heads = k_pool.shape[1], k_pool.shape[2]
    keys_per_task = paged_keys_per_task(block_size)
    tables, first, last = block_tables.contiguous(), first.contiguous(), last.contiguous()
    q32, out = q.contiguous().float(), _output(B, n_heads, head_dim)
    if lib.paged_decode_attention(q32.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), q.dtype == torch.bfloat16,
                                  out.data_ptr(), tables.data_ptr(), first.data_ptr(), last.data_ptr(), B, n_heads,
                                  kv_heads, head_dim, block_size, tables.shape[1], keys_per_task, scale,
                                  torch.get_num_threads()):
        raise MemoryError(f"paged_decode_attention could not allocate {2 * keys_per_task * kv_heads * head_dim * 4:,} "
                          f"bytes for a chunk's float32 keys and values")
    return out.to(q.dtype)


def paged_keys_per_task(block_size: int) -> int:
    """How many keys one task of :func:`paged_decode_attention` reads: a chunk within one block, at most 32."""
    return max(n for n in range(1, 33) if block_size % n == 0)


PAGED_MAX_HEAD_ELEMENTS = 65536  # heads · head_dim: the C loop keeps a sequence's sums on its thread's stack


def _paged_problem(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                   first: torch.Tensor, last: torch.Tensor, ranges: bool) -> str | None:
    """The first of :func:`paged_decode_attention`'s rules that its inputs break, in words (``ranges``: the tables'
    block ids and first < last too, which reads them); None when they keep them."""
    if q.dim() != 3 or q.shape[0] == 0 or q.shape[2] == 0 or q.shape[2] % 8:
        return f"q must be [B > 0, heads, head_dim] with head_dim a multiple of 8, got {list(q.shape)}"
    if not q.dtype == k_pool.dtype == v_pool.dtype or q.dtype not in (torch.float32, torch.bfloat16):
        return f"q and the pools must be all float32 or all bfloat16, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}"
    if not q.device.type == k_pool.device.type == v_pool.device.type == "cpu":
        return f"q and the pools must be CPU tensors, got {q.device}, {k_pool.device}, {v_pool.device}"
    if not (k_pool.dim() == 4 and k_pool.shape == v_pool.shape and k_pool.shape[3] == q.shape[2]
            and k_pool.shape[2] > 0 and q.shape[1] % k_pool.shape[2] == 0):
        return (f"the pools must be [num_blocks, block_size, kv_heads, head_dim] of q's head_dim, heads a multiple of "
                f"kv_heads, got q {list(q.shape)}, k_pool {list(k_pool.shape)}, v_pool {list(v_pool.shape)}")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        return "the pools must be contiguous; pass .contiguous() pools"
    if q.shape[1] * q.shape[2] > PAGED_MAX_HEAD_ELEMENTS:
        return (f"heads · head_dim must be at most {PAGED_MAX_HEAD_ELEMENTS:,} (a sequence's sums live on a thread's "
                f"stack), got {q.shape[1]} · {q.shape[2]}; use the reference path (PagedBatch)")
    if not (block_tables.dtype == first.dtype == last.dtype == torch.int64 and block_tables.dim() == 2
            and block_tables.shape[0] == q.shape[0] and first.shape == last.shape == (q.shape[0],)):
        return (f"block_tables must be int64 [B, max_blocks] and first, last int64 [B] (B = {q.shape[0]}), got "
                f"{block_tables.dtype} {list(block_tables.shape)}, {first.dtype} {list(first.shape)}, {last.dtype} "
                f"{list(last.shape)}")
    if not block_tables.device.type == first.device.type == last.device.type == "cpu":
        return "block_tables, first and last must be CPU tensors"
    if ranges and not paged_ranges_fit(block_tables, first, last, k_pool.shape[0], k_pool.shape[1]):
        return (f"each range must be 0 <= first < last <= max_blocks · block_size and every block id in [0, "
                f"{k_pool.shape[0]}), got first {first.tolist()}, last {last.tolist()}, block ids "
                f"{int(block_tables.min())}..{int(block_tables.max())}")
    return None


def paged_ranges_fit(block_tables: torch.Tensor, first: torch.Tensor, last: torch.Tensor, num_blocks: int,
                     block_size: int) -> bool:
    """0 <= first < last <= the tables' positions, and every block id a block of the pool."""
    return (bool((first >= 0).all()) and bool((first < last).all())
            and int(last.max()) <= block_tables.shape[1] * block_size
            and 0 <= int(block_tables.min()) and int(block_tables.max()) < num_blocks)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                     lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Prefill's attention: the T queries are the last T of the S positions, each attending causally
    (query t sees keys 0 .. S - T + t: the mask aligned to the bottom right, as a chunk after a cached
    prefix needs, unlike SDPA's ``is_causal`` when T < S), softmax(scale · q·kᵀ + mask) · v, by a
    flash-attention loop in C (csrc/attention.c).

    q [B, H, T, D], k, v [B, Hkv, S, D] all float32, or all bfloat16 (the keys and values widened to float32 once a
    call, the sums float32, the softmax's numerators rounded to bfloat16 before they weigh the values and the output
    once, where SDPA's CPU flash kernel rounds); any strides but a contiguous last dimension (a KV cache's buffer, a
    transposed gather), 1 <= T <= S, H a multiple of Hkv (GQA), D a multiple of :func:`panel_width`. Returns [B, H, T,
    D] of q's dtype, ``F.scaled_dot_product_attention``'s values (``is_causal`` when T == S) up to float rounding.
    Raises ValueError for inputs the loop would misread or an input that requires grad (it has no backward pass),
    MemoryError when its scratch cannot be allocated."""
    lib = lib or kernels()
    B, H, T, D = q.shape if q.dim() == 4 else (0, 0, 0, 0)
    ok = (k.dim() == 4 and k.shape == v.shape and k.shape[0] == B and k.shape[1] > 0 and H % k.shape[1] == 0
          and k.shape[3] == D and 0 < T <= k.shape[2] and D > 0 and D % lib.f32_panel_width() == 0
          and q.dtype in (torch.float32, torch.bfloat16) and q.dtype == k.dtype == v.dtype
          and all(t.device.type == "cpu" for t in (q, k, v))
          and q.stride(3) == k.stride(3) == v.stride(3) == 1 and _is_number(scale))
    if not ok:
        raise ValueError(f"causal_attention takes float32 (or all bfloat16) CPU q [B, heads, T, D] and k, v [B, "
                         f"kv_heads, S, D] with a contiguous last dimension, 1 <= T <= S, heads a multiple of kv_heads, "
                         f"D a multiple of {lib.f32_panel_width()}, and a number scale; got q {q.dtype} {list(q.shape)}, k "
                         f"{k.dtype} {list(k.shape)} strides {list(k.stride())}, v {v.dtype} {list(v.shape)}, scale "
                         f"{scale!r}")
    if problem := _grad_problem(q, k, v):
        raise ValueError(f"causal_attention: {problem}; use F.scaled_dot_product_attention")
    q32, out = q.float(), _output(B, H, T, D)
    failed = lib.causal_attention(q32.data_ptr(), k.data_ptr(), v.data_ptr(), q.dtype == torch.bfloat16,
                                  out.data_ptr(), B, H, k.shape[1], T, k.shape[2], D, *q32.stride()[:3],
                                  *k.stride()[:3], *v.stride()[:3], scale, torch.get_num_threads())
    if failed:
        raise MemoryError("causal_attention could not allocate its scratch buffers")
    return out.to(q.dtype)


def causal_attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, check: bool = True,
                          tiles: bool | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """Prefill's attention in bfloat16 with both products on pairs of bfloat16s (csrc/attention_bf16.c): the T queries
    are the last T of the S positions, query t seeing keys 0 .. S - T + t (as :func:`causal_attention`),
    softmax(scale · q·kᵀ + mask) · v with the scores and the output summed in float32 and the softmax's weights
    rounded to bfloat16 for their product with v (as SDPA's flash kernel rounds them). On the matrix units where
    :func:`bf16_amx_ready`, else by AVX512-BF16's dot products (``tiles``: True or False to choose; the same sums).

    q [B, H, T, D], k, v [B, Hkv, S, D] bfloat16 CPU, any strides but a contiguous last dimension, T <= S, H a
    multiple of Hkv (GQA), D a multiple of 32 up to 256. Returns [B, H, T, D] bfloat16, laid out [B, T, H, D] (what
    the output projection reads). Raises TypeError for a non-tensor, ValueError naming the rule another input breaks
    (inputs that require grad included: no backward pass) or where the build has no AVX512-BF16
    (:func:`bf16_dot_instructions`; with ``tiles``, no tiles), unless ``check`` is False: a caller that has asked
    :func:`causal_attention_bf16_fits` (the speed layer, every chunk of every layer) skips the second reading of the
    rules; MemoryError when the packed keys and values cannot be allocated."""
    lib = lib or kernels()
    tiles = bf16_amx_ready(lib=lib) if tiles is None else tiles
    if check:
        _check_tensors("causal_attention_bf16", q=q, k=k, v=v)
        problem = (_causal_bf16_problem(q, k, v, lib) or _scale_problem(scale) or _grad_problem(q, k, v)
                   or (tiles and not bf16_amx_ready(lib=lib) and "tiles=True, but bf16_amx_ready() is False here"))
        if problem:
            raise ValueError(f"causal_attention_bf16: {problem}; use F.scaled_dot_product_attention")
    B, H, T, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    out = torch.empty(B, T, H, D, dtype=torch.bfloat16)
    for b in range(B):
        status = lib.causal_attention_bf16(q[b].data_ptr(), k[b].data_ptr(), v[b].data_ptr(), out[b].data_ptr(), H, KV,
                                           T, S, D, q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1),
                                           v.stride(2), D, H * D, scale, bool(tiles), torch.get_num_threads())
        if status == 1:
            raise MemoryError(f"causal_attention_bf16 could not allocate {4 * KV * (S + 31) // 32 * 32 * D:,} bytes "
                              f"for the packed keys and values")
        if status:  # (2: what check=True refuses, reached unchecked)
            why = _causal_bf16_problem(q, k, v, lib) or "tiles=True where bf16_amx_ready() is False"
            raise ValueError(f"causal_attention_bf16 does not take these inputs here ({why}); use "
                             f"F.scaled_dot_product_attention")
    return out.transpose(1, 2)


def causal_attention_bf16_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               lib: ctypes.CDLL | None = None) -> bool:
    """What :func:`causal_attention_bf16` takes (its docstring), this CPU included."""
    return _causal_bf16_problem(q, k, v, lib) is None


def _causal_bf16_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lib: ctypes.CDLL | None) -> str | None:
    """The first of :func:`causal_attention_bf16`'s rules that q, k, v break, in words; None when they keep them."""
    def got():
        return f"q {q.dtype} {list(q.shape)}, k {k.dtype} {list(k.shape)}, v {v.dtype} {list(v.shape)}"
    if not q.dtype == k.dtype == v.dtype == torch.bfloat16:
        return f"q, k and v must be bfloat16, got {got()}"
    if not q.device.type == k.device.type == v.device.type == "cpu":
        return f"q, k and v must be CPU tensors, got {q.device}, {k.device}, {v.device}"
    if not (q.dim() == k.dim() == 4 and k.shape == v.shape and k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3]):
        return f"takes q [B, heads, T, D] and k, v [B, kv_heads, S, D] of the same B and D, got {got()}"
    if not (k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0):
        return f"heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[1]})"
    if not 0 < q.shape[2] <= k.shape[2]:
        return f"the T = {q.shape[2]} queries must be the last of the S = {k.shape[2]} positions (0 < T <= S)"
    if not (q.shape[3] % 32 == 0 and 0 < q.shape[3] <= 256):
        return f"head_dim must be a multiple of 32 up to 256, got {q.shape[3]}"
    if not q.stride(3) == k.stride(3) == v.stride(3) == 1:
        return (f"each head's D elements must be contiguous, got last strides {q.stride(3)}, {k.stride(3)}, "
                f"{v.stride(3)}; pass .contiguous() tensors")
    if not bf16_dot_instructions(lib=lib):
        return "this CPU (or build) has no AVX512-BF16: bf16_dot_instructions() is False"
    return None


def _check_tensors(op: str, **tensors) -> None:
    """TypeError naming the arguments of ``op`` that are not tensors."""
    wrong = {name: t for name, t in tensors.items() if not isinstance(t, torch.Tensor)}
    if wrong:
        raise TypeError(f"{op} takes tensors, got " + ", ".join(f"{n} {type(t).__name__}" for n, t in wrong.items()))


def _scale_problem(scale) -> str | None:
    if _is_number(scale):
        return None
    return f"scale must be a Python int or float, got {type(scale).__name__} {scale!r}; pass float(scale)"


def _grad_problem(*tensors: torch.Tensor) -> str | None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "it has no backward pass, and an input requires grad (call it under torch.no_grad())"
    return None


# -- the residual add and RMSNorm (csrc/rms_norm.c), SwiGLU's activation (csrc/silu_mul.c) -----------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None, *,
             check: bool = True, lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in one pass: x [..., dim] CPU, contiguous, weight [dim], all float32 or all bfloat16 -> (x, x ·
    1/sqrt(mean(x²) + eps) · weight) [..., dim] of x's dtype, minillm.model.RMSNorm's values up to float
    rounding (in bfloat16 with its roundings: the norm in float32 rounded to bfloat16, then times the weight,
    rounded). With ``delta`` (x's shape and dtype), the residual add first: returns (x + delta, its norm), the
    sum in a new tensor. Raises ValueError for other dtypes, devices, layouts or shapes, unless ``check`` is False:
    a caller that has checked them (:class:`~minillm.fast.block.FastBlock`'s first norm, every layer of every step,
    where the checks cost 5.6 of a call's 11.8 us)."""
    lib = lib or kernels()
    tensors = (x, weight) if delta is None else (x, weight, delta)
    if check and (any(t.dtype != x.dtype or t.device.type != "cpu" or not t.is_contiguous() for t in tensors)
            or x.dtype not in (torch.float32, torch.bfloat16)
            or x.dim() == 0 or weight.shape != x.shape[-1:] or (delta is not None and delta.shape != x.shape)
            or not _is_number(eps)):
        raise ValueError(f"rms_norm takes contiguous CPU x [..., dim], weight [dim] (and delta as x), all float32 or "
                         f"all bfloat16, and a number eps, got x {x.dtype} {list(x.shape)} on {x.device.type}, weight "
                         f"{weight.dtype} {list(weight.shape)}"
                         + ("" if delta is None else f", delta {delta.dtype} {list(delta.shape)}") + f", eps {eps!r}")
    out = torch.empty(x.shape, dtype=x.dtype)
    total = x if delta is None else torch.empty(x.shape, dtype=x.dtype)
    run = lib.rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.rms_norm
    if x.numel():
        run(x.data_ptr(), None if delta is None else delta.data_ptr(), total.data_ptr(), weight.data_ptr(),
            out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, torch.get_num_threads())
    return total, out


def silu_mul(gate_up: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """SwiGLU's activation in one pass: gate_up [..., 2F] float32 or bfloat16 CPU, contiguous (the stacked gate|up
    product) -> silu(gate) · up [..., F] of its dtype, gate and up its two halves (``chunk(2, -1)``). Same values as
    ``F.silu(gate) * up`` up to float rounding (in bfloat16 with its roundings: silu rounded, then the product;
    csrc/silu_mul.c says where its exp can move the last bit). Raises TypeError for a non-tensor, ValueError for
    another dtype, device or layout, or an input that requires grad (no backward pass)."""
    lib = lib or kernels()
    _check_tensors("silu_mul", gate_up=gate_up)
    if (gate_up.dtype not in (torch.float32, torch.bfloat16) or gate_up.device.type != "cpu"
            or not gate_up.is_contiguous() or gate_up.dim() == 0 or gate_up.shape[-1] % 2):
        raise ValueError(f"silu_mul takes a contiguous float32 or bfloat16 CPU tensor [..., 2F], got {gate_up.dtype} "
                         f"{list(gate_up.shape)} on {gate_up.device.type} (contiguous: {gate_up.is_contiguous()}); use "
                         f"F.silu(gate) * up")
    if problem := _grad_problem(gate_up):
        raise ValueError(f"silu_mul: {problem}; use F.silu(gate) * up")
    F = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], F, dtype=gate_up.dtype)
    run = lib.silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else lib.silu_mul
    if out.numel():
        run(gate_up.data_ptr(), out.data_ptr(), out.numel() // F, F, torch.get_num_threads())
    return out


def silu_mul_bf16_vectorised(*, lib: ctypes.CDLL | None = None) -> bool:
    """Whether :func:`silu_mul` in bfloat16 runs its AVX-512 loop here (elsewhere a scalar one, slower than
    ``F.silu(gate) * up``)."""
    return _asked_once("silu_mul_bf16_vectorised", lib)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, check: bool = True,
         lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of queries and keys in one call, :func:`minillm.rope.apply_rope`'s values bit for bit (its roundings:
    each product, then the sum, in float32 or bfloat16; csrc/rope.c says where a bfloat16 product below 2^-126
    becomes zero): q [B, H, T, D] and k [B, Hkv, T, D] (views of the stacked
    q|k|v product will do: a head's D elements contiguous, any other strides), cos and sin [T, D] contiguous, all
    float32 or all bfloat16 CPU tensors, D even. Returns the rotated (q, k) of the same shapes, laid out [B, T,
    heads, D] as ``x * cos`` would lay out a transposed view. Raises TypeError for a non-tensor, ValueError naming
    the rule another input breaks (inputs that require grad included: no backward pass), unless ``check`` is False
    (a caller that has checked them: :class:`~minillm.fast.attention.FastAttention`, every layer of every step)."""
    lib = lib or kernels()
    if check:
        _check_tensors("rope", q=q, k=k, cos=cos, sin=sin)
        if problem := _rope_problem(q, k, cos, sin) or _grad_problem(q, k, cos, sin):
            raise ValueError(f"rope: {problem}; use minillm.rope.apply_rope")
    B, H, T, D = q.shape
    KV = k.shape[1]
    q_out = torch.empty(B, T, H, D, dtype=q.dtype)
    k_out = torch.empty(B, T, KV, D, dtype=q.dtype)
    if q_out.numel():
        lib.rope(q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
                 B, T, H, KV, D, *q.stride()[:3], *k.stride()[:3], q.dtype == torch.bfloat16, torch.get_num_threads())
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def rope_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """What :func:`rope` takes (its docstring): the checks, apart, for a caller that makes them once."""
    return _rope_problem(q, k, cos, sin) is None


def _rope_problem(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """The first of :func:`rope`'s rules that q, k, cos and sin break, in words; None when they keep them (every
    layer of every step asks: the words are built only for a broken rule)."""
    def got():
        return (f"q {q.dtype} {list(q.shape)}, k {k.dtype} {list(k.shape)}, cos {cos.dtype} {list(cos.shape)}, sin "
                f"{sin.dtype} {list(sin.shape)}")
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype and q.dtype in (torch.float32, torch.bfloat16)):
        return f"q, k, cos and sin must be all float32 or all bfloat16, got {got()}"
    if not q.device.type == k.device.type == cos.device.type == sin.device.type == "cpu":
        return f"q, k, cos and sin must be CPU tensors, got {q.device}, {k.device}, {cos.device}, {sin.device}"
    if not (q.dim() == k.dim() == 4 and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:]
            and cos.shape == sin.shape == q.shape[2:]):
        return f"takes q [B, H, T, D], k [B, Hkv, T, D] and cos, sin [T, D], got {got()}"
    if q.shape[3] % 2:
        return f"head_dim must be even (RoPE rotates pairs), got {q.shape[3]}"
    if not (q.stride(3) == k.stride(3) == 1 and cos.is_contiguous() and sin.is_contiguous()):
        return (f"each head's D elements and cos, sin must be contiguous, got last strides {q.stride(3)}, "
                f"{k.stride(3)} and cos, sin contiguous: {cos.is_contiguous()}, {sin.is_contiguous()}; pass "
                f".contiguous() tensors")
    return None


# -- the same kernels as torch ops, for compiled code ------------------------------------------------
# (torch.ops.minillm.f32_matvec, ...; eager code calls the functions above: an op's dispatch costs eager
# code ~20 us a call, 4 ms of a SmolLM2 decode step.) Here: their schemas and fakes (the output's shape
# and dtype, for tracing); their CPU implementations come with prepare_for_compile.


def _decode_attention_fake(q, k, v, n_keys):
    # (also what runs, on the Meta dispatch key, when one input is a meta tensor and the rest are not)
    if len({t.device for t in (q, k, v, n_keys)}) > 1:
        raise ValueError(f"decode_attention takes its tensors on one device, got q on {q.device}, k on {k.device}, "
                         f"v on {v.device}, n_keys on {n_keys.device}")
    return q.new_empty(q.shape)


_QUANTIZED = "(Tensor x, Tensor codes, Tensor scale, Tensor? zero, int group_size) -> Tensor"
_OPS = {
    "f32_matvec": ("(Tensor x, Tensor weight) -> Tensor",
                   lambda x, weight: x.new_empty(x.shape[0], weight.shape[0])),
    "bf16_amx_matmul": ("(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
                        lambda x, weight, bias: x.new_empty(x.shape[0], weight.shape[0])),
    "quantized_matvec": (_QUANTIZED, lambda x, codes, scale, zero, group_size: x.new_empty(x.shape[0], codes.shape[0])),
    "quantized_matmul": (_QUANTIZED, lambda x, codes, scale, zero, group_size: x.new_empty(x.shape[0], codes.shape[0])),
    "quantized_amx_matmul": (_QUANTIZED,
                             lambda x, codes, scale, zero, group_size: x.new_empty(x.shape[0], codes.shape[0])),
    "dequantize": ("(Tensor codes, Tensor scale, Tensor? zero, int group_size) -> Tensor",
                   lambda codes, scale, zero, group_size: scale.new_empty(
                       codes.shape[0], codes.shape[1] * (1 if zero is None else 2))),
    # n_keys a tensor: in a compiled step it is the position, data that changes every step
    "decode_attention": ("(Tensor q, Tensor k, Tensor v, Tensor n_keys, float scale) -> Tensor",
                         lambda q, k, v, n_keys, scale: _decode_attention_fake(q, k, v, n_keys)),
}
_LIBRARY = torch.library.Library("minillm", "FRAGMENT")
for _op, (_schema, _fake) in _OPS.items():
    _LIBRARY.define(_op + _schema)
    torch.library.register_fake(f"minillm::{_op}", _fake, lib=_LIBRARY)


def _register_ops() -> None:
    """The ops' CPU implementations, once a process: csrc/ops.cpp's, built against this torch (a
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
    """Build (or find kept) csrc/ops.cpp and load it into torch: (True, None), or (False, why not)."""
    compiler = shlex.split(os.environ.get("CXX") or "c++")
    if not compiler or shutil.which(compiler[0]) is None:
        return False, f"no C++ compiler {os.environ.get('CXX') or 'c++'!r} on PATH"
    torch_dir = Path(torch.__file__).parent
    cache_dir = cache_folder() if cache_dir is None else cache_dir
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    sources = [OPS_SOURCE, *SOURCES]
    # a failed build is kept too: trying again costs every process 20-40 s for the same error
    failed = cache_dir / f"kernel_ops-{_build_key(compiler, [abi], sources)}.failed"
    if failed.is_file():
        return False, f"{failed.read_text().strip()} (kept from an earlier try: delete {failed} to build again)"
    error = ""
    with tempfile.TemporaryDirectory(prefix="minillm-ops-") as tmp:
        for flags in FLAG_SETS[:2]:
            flags = [*flags, "-std=c++17", abi]
            kept = cache_dir / f"kernel_ops-{_build_key(compiler, flags, sources)}.so"
            if kept.is_file() and _load_ops(kept):
                return True, None
            out = Path(tmp) / "kernel_ops.so"
            run = subprocess.run([*compiler, *flags, "-shared", "-fPIC", "-w", f"-I{torch_dir / 'include'}",
                                  str(OPS_SOURCE), "-o", str(out), f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10",
                                  f"-Wl,-rpath,{torch_dir / 'lib'}"], capture_output=True, text=True)
            if run.returncode == 0 and _load_ops(out):
                _keep(out, kept)
                return True, None
            said = run.stderr.strip().splitlines()
            error = said[-1] if said else f"exit status {run.returncode}" if run.returncode else "built, but did not load"
    why = f"{' '.join(compiler)} could not build {CSRC.name}/{OPS_SOURCE.name}: {error}"
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
