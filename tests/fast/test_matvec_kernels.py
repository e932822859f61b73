"""The C kernels (minillm/fast/csrc/) against their oracles: the float32 products (products.c) and the
product modules a decode path swaps in (minillm.fast.products) against float64 F.linear, the attention
kernels (attention.c) against float64 softmax, each C file's scalar reference against torch's math; every
kernel on the native build and the portable one (no -march=native). Also how the kernels and their torch
ops are built and kept. (The quantised kernels are checked in test_quantize.py and
test_quantized_batches.py, the norm in test_fast_block.py, silu_mul in test_silu_mul.py.)"""

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from torch import nn

from minillm.fast import kernels as matvec_kernels
from minillm.fast.choose import apply_decode_path
from minillm.fast.products import LINEARS, MATVEC_MAX_ROWS, PANEL_MAX_ROWS, SPLIT_MAX_ROWS


def _linear(name: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An nn.Linear holding these tensors, of the product class ``name`` (a key of LINEARS), as a decode
    path swaps it in."""
    with torch.device("meta"):
        linear = LINEARS[name](1, 1, bias=bias is not None)  # (no init: the tensors below replace it)
    linear.out_features, linear.in_features = weight.shape
    linear.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def _oracle(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


BUILDS = pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])


def _lib(portable: bool):
    """The native build, or the portable one (no -march=native: 4-float vectors, 8-output panels, the
    scalar exp, no AVX2 branch: what another CPU compiles)."""
    lib = matvec_kernels.kernels(portable)
    if lib is None:
        pytest.skip("needs the C kernels")
    return lib


@BUILDS
@pytest.mark.parametrize("out_features, in_features", [(5, 37), (576, 576), (49, 1), (3, 32), (7, 40), (40, 100)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_f32_matvec_equals_float64_linear(out_features, in_features, rows, portable):
    """Sizes that are and are not multiples of the kernel's 32- and 8-wide steps, several rows."""
    g = torch.Generator().manual_seed(rows + in_features)
    w, x = torch.randn(out_features, in_features, generator=g), torch.randn(rows, in_features, generator=g)
    y = matvec_kernels.f32_matvec(x, w, lib=_lib(portable))
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    assert (y.double() - _oracle(x, w)).abs().max() <= 1e-5 * max(1.0, _oracle(x, w).abs().max())


@BUILDS
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 150), out_features=st.integers(1, 100), in_features=st.integers(0, 90),
       seed=st.integers(0, 2**16))
def test_f32_rows_matmul_equals_float64_linear(rows, out_features, in_features, seed, portable):
    """x's rows along the lanes over hypothesis' shapes: one vector of rows or blocks of two, the last block
    part-filled, outputs that leave the last tile part-filled, any in (0 too: y is zeros); x a view of a wider
    tensor (copied), the weight read in place."""
    g, lib = torch.Generator().manual_seed(seed), _lib(portable)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features + 3, generator=g)[:, :in_features]
    y = matvec_kernels.f32_rows_matmul(x, w, lib=lib)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    assert (y.double() - _oracle(x, w)).abs().max() <= 1e-5 * max(1.0, _oracle(x, w).abs().max())


@BUILDS
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), out_features=st.integers(1, 100), in_features=st.integers(0, 90),
       seed=st.integers(0, 2**16))
def test_f32_panel_matmul_equals_float64_linear(rows, out_features, in_features, seed, portable):
    """The panel micro-kernel over hypothesis' shapes: rows across one to four row blocks, outputs
    that leave the last panel part-filled, any in (0 too: y is zeros)."""
    g, lib = torch.Generator().manual_seed(seed), _lib(portable)
    w, x = torch.randn(out_features, in_features, generator=g), torch.randn(rows, in_features, generator=g)
    panels = matvec_kernels.f32_pack_panels(w, lib=lib)
    width, data = matvec_kernels.panel_width(lib=lib), panels.data
    assert data.shape == (-(-out_features // width), in_features, width) and panels.out_features == out_features
    assert torch.equal(data.transpose(1, 2).reshape(data.shape[0] * width, in_features)[:out_features], w)
    y = matvec_kernels.f32_panel_matmul(x, panels, lib=lib)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    assert (y.double() - _oracle(x, w)).abs().max() <= 1e-5 * max(1.0, _oracle(x, w).abs().max())


def _pointers(*tensors):
    return [t.data_ptr() for t in tensors]


@BUILDS
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 5), out_features=st.integers(1, 20), groups=st.integers(1, 3), keys=st.integers(1, 40),
       seed=st.integers(0, 2**16))
def test_each_c_files_scalar_reference_equals_torch(rows, out_features, groups, keys, seed, portable):
    """The few lines each csrc/*.c file opens with, that a reader checks its fast kernels against:
    f32_matmul_reference and quantized_matmul_reference (int8, int4) against float64 F.linear on the
    dequantised matrix, attention_reference against float64 softmax, rms_norm_reference and
    silu_mul_reference against the formulas."""
    from minillm.quantize import QuantizedLinear

    g, lib = torch.Generator().manual_seed(seed), _lib(portable)
    in_features = 16 * groups
    w, x = torch.randn(out_features, in_features, generator=g), torch.randn(rows, in_features, generator=g)
    y = torch.empty(rows, out_features)
    lib.f32_matmul_reference(*_pointers(x, w, y), rows, out_features, in_features)
    assert (y.double() - _oracle(x, w)).abs().max() <= 1e-5 * max(1.0, _oracle(x, w).abs().max())
    for fmt in ("int8", "int4"):
        layer = QuantizedLinear(w, None, fmt, group_size=16)
        zero = None if fmt == "int8" else layer.zero.data_ptr()
        lib.quantized_matmul_reference(*_pointers(x, layer.qweight, layer.scale), zero, y.data_ptr(), rows,
                                       out_features, in_features, 16)
        expected = _oracle(x, layer.dequantize())
        assert (y.double() - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max())
    q, k, v, out = torch.randn(in_features, generator=g), *torch.randn(2, keys, in_features, generator=g), \
        torch.empty(in_features)
    lib.attention_reference(*_pointers(q, k, v, out), keys, in_features, 0.3)
    expected = torch.softmax(k.double() @ q.double() * 0.3, dim=0) @ v.double()
    assert (out.double() - expected).abs().max() <= 1e-5
    weight, normed = torch.randn(in_features, generator=g), torch.empty(rows, in_features)
    lib.rms_norm_reference(*_pointers(x, weight, normed), rows, in_features, 1e-6)
    x64 = x.double()
    expected = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert (normed.double() - expected).abs().max() <= 1e-5 * expected.abs().max()
    gate_up, activated = torch.randn(rows, 2 * in_features, generator=g) * 4, torch.empty(rows, in_features)
    lib.silu_mul_reference(*_pointers(gate_up, activated), rows, in_features)
    gate, up = gate_up.double().chunk(2, -1)
    assert (activated.double() - F.silu(gate) * up).abs().max() <= 1e-5 * max(1.0, (F.silu(gate) * up).abs().max())


def test_panel_kernel_refuses_a_copy_that_does_not_fit():
    w = torch.randn(40, 16)
    panels = matvec_kernels.f32_pack_panels(w)
    with pytest.raises(ValueError, match=r"f32_panel_matmul multiplies float32 CPU x \[rows, in\] by f32_pack_panels"):
        matvec_kernels.f32_panel_matmul(torch.randn(3, 17), panels)  # in differs
    for bad in (panels._replace(out_features=70), panels._replace(data=panels.data.to("meta")), (w, 40), w):
        with pytest.raises(ValueError, match="pack the matrix with f32_pack_panels"):  # (was: zeros; a crash on meta)
            matvec_kernels.f32_panel_matmul(torch.randn(3, 16), bad)
    with pytest.raises(ValueError, match=r"f32_pack_panels packs a contiguous float32 CPU matrix \[out, in\], "
                                         r"got torch.float64"):
        matvec_kernels.f32_pack_panels(w.double())
    with pytest.raises(ValueError, match="f32_pack_panels packs a contiguous"):
        matvec_kernels.f32_pack_panels(w.t())


@pytest.mark.parametrize("name", LINEARS)
@pytest.mark.parametrize("rows", [1, 5, MATVEC_MAX_ROWS, MATVEC_MAX_ROWS + 1, SPLIT_MAX_ROWS + 6])
def test_every_product_gives_linear_with_bias(name, rows):
    """Each product module, across its row limits (past them it hands over to F.linear), a bias,
    a [B, T, in] input and a matrix that is a row slice of a stacked one (q of q|k|v)."""
    g = torch.Generator().manual_seed(rows)
    packed, b = torch.randn(96, 64, generator=g), torch.randn(32, generator=g)
    w, x = packed[32:64], torch.randn(1, rows, 64, generator=g)
    with torch.no_grad():
        y = _linear(name, w, b)(x)
    assert y.shape == (1, rows, 32)
    assert (y.double() - _oracle(x, w, b)).abs().max() <= 1e-5 * _oracle(x, w, b).abs().max()


def test_matvec_on_column_major_weights_or_without_a_compiler_is_f_linear(monkeypatch):
    g = torch.Generator().manual_seed(1)  # (4 rows: 1-3 are the C loop's only where few_rows_in_c)
    w, x = torch.randn(64, 48, generator=g), torch.randn(4, 48, generator=g)
    calls = []
    monkeypatch.setattr(matvec_kernels, "f32_matvec", lambda *a: calls.append(a) or F.linear(*a))
    column_major = w.t().contiguous().t()  # the "long rows" layout: the kernel reads rows, so not this one
    with torch.no_grad():
        assert torch.allclose(_linear("matvec", column_major)(x), x @ w.t(), atol=1e-5) and calls == []
        _linear("matvec", w)(x)
        assert len(calls) == 1
        monkeypatch.setattr(matvec_kernels, "available", lambda: False)
        assert torch.allclose(_linear("matvec", w)(x), x @ w.t(), atol=1e-5) and len(calls) == 1


def test_a_build_is_kept_and_loaded_by_the_next_process(tmp_path, monkeypatch):
    """The second build finds the first one's library (no compiler run), under a name that changes
    with the flags; a folder that cannot be written leaves the build temporary, still loaded."""
    lib, why = matvec_kernels._build(flag_sets=(["-O2"],), cache_dir=tmp_path)
    kept = list(tmp_path.glob("kernels-*.so"))
    assert lib is not None and len(kept) == 1, why
    monkeypatch.setattr(matvec_kernels.subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    again, _ = matvec_kernels._build(flag_sets=(["-O2"],), cache_dir=tmp_path)
    assert again is not None and again._name == str(kept[0])
    sources = matvec_kernels.SOURCES
    assert matvec_kernels._build_key(["cc"], ["-O2"], sources) != matvec_kernels._build_key(["cc"], ["-O3"], sources)
    monkeypatch.undo()
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder should be: mkdir fails
    lib, why = matvec_kernels._build(flag_sets=(["-O1"],), cache_dir=blocked / "kernels")
    assert lib is not None and not (blocked / "kernels").exists(), why


def test_a_kept_library_that_does_not_load_is_built_again(tmp_path, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    kept = tmp_path / f"kernels-{matvec_kernels._build_key(['cc'], ['-O2'], matvec_kernels.SOURCES)}.so"
    kept.write_bytes(b"not a library")  # a half-written or damaged file
    lib, why = matvec_kernels._build(flag_sets=(["-O2"],), cache_dir=tmp_path)
    assert lib is not None and kept.read_bytes()[:4] == b"\x7fELF", why


@pytest.mark.parametrize("name", LINEARS)
def test_what_f_linear_refuses_or_computes_every_product_does_alike(name):
    """A fresh-user trial found the matvec product reading past a buffer for a float64 or half
    weight or a wrong in-size (garbage, no error), dividing by zero for in = 0, and dropping autograd."""
    x = torch.randn(1, 8)
    for weight in (torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8).half(), torch.randn(4, 5)):
        with pytest.raises(RuntimeError) as expected:
            F.linear(x, weight)
        with pytest.raises(RuntimeError, match=str(expected.value).split("(")[0][:30]):
            _linear(name, weight)(x)
    assert torch.equal(_linear(name, torch.randn(4, 0))(torch.randn(2, 0)), torch.zeros(2, 4))
    linear = _linear(name, torch.randn(4, 8, requires_grad=True))
    linear(x).sum().backward()
    assert torch.allclose(linear.weight.grad, x.expand(4, 8))


def test_the_kernel_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(ValueError, match="f32_matvec takes float32 CPU tensors, got x torch.float64"):
        matvec_kernels.f32_matvec(torch.ones(1, 4, dtype=torch.float64), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"got x \[1, 10\] and weight \[37, 53\]"):
        matvec_kernels.f32_matvec(torch.ones(1, 10), torch.ones(37, 53))
    with pytest.raises(ValueError, match="f32_rows_matmul takes float32 CPU tensors, got x torch.bfloat16"):
        matvec_kernels.f32_rows_matmul(torch.ones(9, 4, dtype=torch.bfloat16), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"f32_rows_matmul reads the weight row-major"):
        matvec_kernels.f32_rows_matmul(torch.ones(9, 4), torch.ones(4, 2).t())


@pytest.mark.cli
def test_a_stray_library_of_the_kept_name_is_built_over(tmp_path, monkeypatch):
    """A valid shared library without the kernels (was: AttributeError, the command died)."""
    monkeypatch.delenv("CC", raising=False)
    stray = tmp_path / "stray.c"
    stray.write_text("int nothing(void) { return 0; }\n")
    kept = tmp_path / f"kernels-{matvec_kernels._build_key(['cc'], ['-O2'], matvec_kernels.SOURCES)}.so"
    matvec_kernels.subprocess.run(["cc", "-shared", "-fPIC", str(stray), "-o", str(kept)], check=True)
    assert "is not minillm's kernels" in matvec_kernels._load(kept)[1]
    lib, why = matvec_kernels._build(flag_sets=(["-O2"],), cache_dir=tmp_path)
    assert lib is not None and lib.f32_matvec, why
    # this process keeps the stray's handle for that path; a new process loads the rebuilt kernels
    check = f"import ctypes; ctypes.CDLL({str(kept)!r}).f32_matvec"
    assert matvec_kernels.subprocess.run([sys.executable, "-c", check]).returncode == 0


@pytest.mark.skipif(not matvec_kernels.available() or matvec_kernels.shutil.which("c++") is None,
                    reason="needs the C kernels and a C++ compiler")
def test_the_ops_a_compiled_step_calls_are_the_cpp_build_and_equal_the_ctypes_kernels():
    """torch.ops.minillm.* run csrc/ops.cpp (no call back into Python); each equals the function
    eager code calls (same C loops, so the same values), and refuses a wrong input with a message."""
    from minillm.quantize import QuantizedLinear

    matvec_kernels.prepare_for_compile()
    assert matvec_kernels.ops_implementation() == ("C++", None)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 128, generator=g), torch.randn(40, 128, generator=g)
    ops, functions = torch.ops.minillm, matvec_kernels
    assert torch.equal(ops.f32_matvec(x, w), functions.f32_matvec(x, w))
    q8, q4 = QuantizedLinear(w, None, "int8"), QuantizedLinear(w, None, "int4")
    for codes in ((q8.qweight, q8.scale, None, 0), (q4.qweight, q4.scale, q4.zero, 64)):
        for name in ("quantized_matvec", "quantized_matmul"):
            assert torch.equal(getattr(ops, name)(x, *codes), getattr(functions, name)(x, *codes))
        assert torch.equal(ops.dequantize(*codes), functions.dequantize(*codes))
    q, (k, v) = torch.randn(1, 6, 1, 64, generator=g), torch.randn(2, 1, 2, 50, 64, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        assert torch.equal(ops.decode_attention(q, k, v, torch.tensor([45]), 0.125),
                           functions.decode_attention(q, k, v, 45, 0.125))
    with pytest.raises(RuntimeError, match=r"f32_matvec takes x float32 \[rows, 128\], got Double \[3, 128\]"):
        ops.f32_matvec(x.double(), w)


def test_without_a_cpp_compiler_the_ops_are_not_built_and_say_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-minillm")
    assert matvec_kernels._build_ops(cache_dir=tmp_path) == (False, "no C++ compiler 'no-such-compiler-minillm' on PATH")


@pytest.mark.cli
def test_a_failed_ops_build_is_kept_and_not_tried_again(monkeypatch, tmp_path):
    """A compiler that fails (here: `false`) is tried once; the next process reads why from the
    kept marker instead of spending 20-40 s on the same error."""
    monkeypatch.setenv("CXX", "false")
    calls = []
    real_run = matvec_kernels.subprocess.run
    monkeypatch.setattr(matvec_kernels.subprocess, "run", lambda *a, **kw: calls.append(a) or real_run(*a, **kw))
    loaded, why = matvec_kernels._build_ops(cache_dir=tmp_path)
    assert (loaded, why, len(calls)) == (False, "false could not build csrc/ops.cpp: exit status 1", 2)
    (marker,) = tmp_path.glob("kernel_ops-*.failed")
    assert matvec_kernels._build_ops(cache_dir=tmp_path) == (
        False, f"{why} (kept from an earlier try: delete {marker} to build again)")
    assert len(calls) == 2  # not built again
    marker.unlink()
    matvec_kernels._build_ops(cache_dir=tmp_path)
    assert len(calls) == 4


@pytest.mark.cli
@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
def test_without_the_cpp_build_the_ops_run_the_python_functions(monkeypatch):
    """In a fresh process (an op's implementation is registered once a process)."""
    monkeypatch.setenv("CXX", "no-such-compiler-minillm")
    check = ("import torch; from minillm.fast import kernels as k; k.prepare_for_compile(); "
             "x, w = torch.randn(2, 64), torch.randn(9, 64); "
             "assert k.ops_implementation() == ('Python', \"no C++ compiler 'no-such-compiler-minillm' on PATH\"); "
             "assert torch.equal(torch.ops.minillm.f32_matvec(x, w), k.f32_matvec(x, w))")
    run = matvec_kernels.subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
@pytest.mark.parametrize("call, message", [
    (lambda f, x, q4, q8: f.quantized_matvec(x, q4.qweight, q4.scale, q4.zero, 0), "group_size must be a positive multiple of 16 dividing 128, got 0"),
    (lambda f, x, q4, q8: f.quantized_matmul(x, q4.qweight, q4.scale, q4.zero, 8), "group_size must be a positive multiple of 16"),
    (lambda f, x, q4, q8: f.dequantize(q4.qweight, q4.scale, q4.zero, -64), "group_size must be a positive multiple"),
    (lambda f, x, q4, q8: f.quantized_matvec(x, q4.qweight, q4.scale[:1], q4.zero, 64), r"scale must be contiguous float32 \[40, 2\]"),
    (lambda f, x, q4, q8: f.quantized_matvec(x, q8.qweight, torch.ones(1), None, 0), r"scale must be contiguous float32 \[40\]"),
    (lambda f, x, q4, q8: f.quantized_matmul(x, q8.qweight.t().contiguous().t(), q8.scale, None, 0), "codes must be a contiguous 2-D int8"),
    (lambda f, x, q4, q8: f.dequantize(q8.qweight, torch.ones(3), None, 0), r"scale must be contiguous float32 \[40\]"),
    (lambda f, x, q4, q8: f.quantized_matvec(x, q4.qweight, q4.scale, None, 64), "codes must be a contiguous 2-D int8"),
])
@pytest.mark.parametrize("where", ["functions", "ops"])
def test_quantised_kernels_refuse_codes_they_would_misread(call, message, where):
    """Was: SIGFPE (group_size 0), silent garbage (group 8, a non-contiguous q) or out-of-bounds reads
    (a short scale) from a direct call; the model's own calls were never affected."""
    from minillm.quantize import QuantizedLinear

    matvec_kernels.prepare_for_compile()
    w, x = torch.randn(40, 128), torch.randn(2, 128)
    q4, q8 = QuantizedLinear(w, None, "int4"), QuantizedLinear(w, None, "int8")
    kernels = torch.ops.minillm if where == "ops" else matvec_kernels
    with pytest.raises((ValueError, RuntimeError), match=message):
        call(kernels, x, q4, q8)


@pytest.mark.cli
def test_a_kept_ops_file_that_is_not_the_ops_is_not_taken_for_them(tmp_path, monkeypatch):
    """A stray library of the ops' kept name loads but registers nothing: not "C++"."""
    stray = tmp_path / "stray.c"
    stray.write_text("int nothing(void) { return 0; }\n")
    out = tmp_path / "stray.so"
    matvec_kernels.subprocess.run(["cc", "-shared", "-fPIC", str(stray), "-o", str(out)], check=True)
    check = f"from pathlib import Path; from minillm.fast import kernels as k; assert k._load_ops(Path({str(out)!r})) is False"
    run = matvec_kernels.subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)  # (a fresh
    assert run.returncode == 0, run.stderr[-2000:]  # process: this one may have registered the ops already)


def _attention_oracle(q, k, v, n_keys, scale):
    """softmax(scale · q·kᵀ) · v over the first n_keys keys, in float64, GQA by repeating K/V heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = (t[:, :, :n_keys].double().repeat_interleave(rep, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    return torch.softmax(scores, dim=-1) @ v


@BUILDS
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim", [(1, 9, 3, 64), (2, 12, 12, 64), (1, 8, 2, 128), (3, 4, 1, 72),
                                                              (1, 4, 2, 32)])
@pytest.mark.parametrize("n_keys", [1, 31, 32, 33, 65, 200])
def test_decode_attention_equals_float64_softmax(batch, heads, kv_heads, head_dim, n_keys, portable):
    """Over the first n_keys of a longer cache buffer (key counts around the 32-key tasks and the
    8-key steps; a head_dim whose columns are not a multiple of 64 takes the portable tail)."""
    g = torch.Generator().manual_seed(n_keys + head_dim)
    q = torch.randn(batch, heads, 1, head_dim, generator=g)
    k, v = torch.randn(2, batch, kv_heads, n_keys + 7, head_dim, generator=g)
    out = matvec_kernels.decode_attention(q, k, v, n_keys, 0.3, lib=_lib(portable))
    assert out.shape == q.shape and out.dtype == torch.float32
    assert (out.double() - _attention_oracle(q, k, v, n_keys, 0.3)).abs().max() <= 1e-5


@BUILDS
@pytest.mark.parametrize("batch, heads, kv_heads, head_dim", [(1, 9, 3, 64), (2, 4, 4, 128), (1, 4, 2, 72)])
@pytest.mark.parametrize("n_keys", [1, 33, 200])
def test_decode_attention_in_bfloat16_equals_float64_softmax(batch, heads, kv_heads, head_dim, n_keys, portable):
    """A bfloat16 cache, read where it lies (a view of a longer buffer): the float64 softmax of the same bfloat16
    numbers, off by the float32 sums (1e-5, as above) and two roundings to bfloat16 (each at most u = 2^-8 of what
    it rounds), where SDPA's CPU kernel rounds: each softmax numerator before it multiplies its value row (so at
    most 2^-8 · Σ_j p_j·|v_j|), and the output (2^-8 of it). (A new user's 2,000 random cases: worst 0.85 of this
    bound.)"""
    g = torch.Generator().manual_seed(n_keys + head_dim)
    q = torch.randn(batch, heads, 1, head_dim, generator=g).bfloat16()
    k, v = torch.randn(2, batch, kv_heads, n_keys + 7, head_dim, generator=g).bfloat16()
    out = matvec_kernels.decode_attention(q, k, v, n_keys, 0.3, lib=_lib(portable))
    expected, magnitude = _attention_oracle(q, k, v, n_keys, 0.3), _attention_oracle(q, k, v.abs(), n_keys, 0.3)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert ((out.double() - expected).abs() <= 1e-5 + 2.0 ** -8 * (magnitude + expected.abs())).all()


@BUILDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [slice(0, 32), slice(32, 64)])
def test_a_chunk_of_masked_keys_gets_no_weight(dtype, masked, portable):
    """32 keys scoring -inf (one task's chunk, first or in the middle) weigh 0, as in the float64 softmax; was NaN
    (exp(-inf - -inf) in the chunk's partial softmax; a new user's trial)."""
    g = torch.Generator().manual_seed(1)
    q = torch.zeros(1, 2, 1, 64, dtype=dtype)
    q[..., 0] = 1.0  # a key's score is its first element
    k, v = torch.randn(2, 1, 1, 80, 64, generator=g).to(dtype)
    k[0, 0, masked, 0] = float("-inf")
    out = matvec_kernels.decode_attention(q, k, v, 80, 1.0, lib=_lib(portable))
    expected = _attention_oracle(q, k, v, 80, 1.0)
    assert ((out.double() - expected).abs() <= 1e-5 + 2.0 ** -7 * expected.abs().amax()).all()


@BUILDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_far_below_the_maximum_get_no_weight(dtype, portable):
    """Keys 1,000 below the maximum weigh exp(-1000) = 0 even where their values are 3e38: the vector exp gave
    ~1.6e-38 below -87, so 15 such keys made 1.0 into 75 (a new user's trial)."""
    q = torch.zeros(1, 1, 1, 16, dtype=dtype)
    q[..., 0] = 100.0
    k = torch.zeros(1, 1, 16, 16, dtype=dtype)
    k[0, 0, 1:, 0] = -10.0
    v = torch.full((1, 1, 16, 16), 3e38).to(dtype)
    v[0, 0, 0] = 1.0
    assert torch.equal(matvec_kernels.decode_attention(q, k, v, 16, 1.0, lib=_lib(portable)), torch.ones_like(q))


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
def test_decode_attention_reads_a_cache_view_and_far_apart_scores():
    """A view of a cache's first positions (heads max_seq_len rows apart, sequences further), as
    eager decode hands over; and scores 500 apart, where exp underflows (softmax ~one-hot)."""
    g = torch.Generator().manual_seed(0)
    buffer = torch.randn(2, 2, 3, 100, 64, generator=g)  # [k|v, B, kv_heads, max_seq_len, D]
    k, v = buffer[0, :, :, :40], buffer[1, :, :, :40]
    q = torch.randn(2, 6, 1, 64, generator=g)
    assert not k.is_contiguous()
    out = matvec_kernels.decode_attention(q, k, v, torch.tensor([40]), 0.125)
    assert (out.double() - _attention_oracle(q, k, v, 40, 0.125)).abs().max() <= 1e-5
    loud = matvec_kernels.decode_attention(q * 100, k, v, 40, 1.0)
    assert (loud.double() - _attention_oracle(q * 100, k, v, 40, 1.0)).abs().max() <= 1e-5


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
@pytest.mark.parametrize("change, message", [
    (lambda q, k, n: (q[..., :60], k[..., :60], n), r"D a multiple of 8.*got q (torch.float32|Float) \[1, 4, 1, 60\]"),
    (lambda q, k, n: (q.expand(1, 4, 2, 64), k, n), r"q \[B, heads, 1, D\]"),
    (lambda q, k, n: (q, k, 0), "n_keys 0"),
    (lambda q, k, n: (q, k, 11), "n_keys 11"),
    (lambda q, k, n: (q.double(), k, n), "got q (torch.float64|Double)"),
    (lambda q, k, n: (q.bfloat16(), k, n), "got q (torch.bfloat16|BFloat16)"),  # (q bfloat16, k and v float32)
    (lambda q, k, n: (q[:, :3], k, n), "heads a multiple of kv_heads"),
    (lambda q, k, n: (q, k.transpose(2, 3).contiguous().transpose(2, 3), n), "contiguous rows"),
    (lambda q, k, n: (q, k[:, :0], n), "heads a multiple of kv_heads"),  # (was: SIGFPE in the op)
])
@pytest.mark.parametrize("where", ["functions", "ops"])
def test_decode_attention_refuses_what_it_would_misread(change, message, where):
    matvec_kernels.prepare_for_compile()
    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 10, 64)
    q, k, n_keys = change(q, k, 5)
    kernels = torch.ops.minillm if where == "ops" else matvec_kernels
    with pytest.raises((ValueError, RuntimeError), match=message):
        kernels.decode_attention(q, k, k.clone(), torch.tensor([n_keys]) if where == "ops" else n_keys, 0.1)


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
def test_decode_attention_refuses_a_q_that_requires_grad():
    """As the other C kernels: it has no backward pass (was: an output without a gradient, silently)."""
    q, k = torch.randn(1, 4, 1, 64, requires_grad=True), torch.randn(1, 2, 10, 64)
    with pytest.raises(ValueError, match="decode_attention: it has no backward pass"):
        matvec_kernels.decode_attention(q, k, k, 5, 0.1)
    with torch.no_grad():
        assert matvec_kernels.decode_attention(q, k, k, 5, 0.1).shape == q.shape


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
@pytest.mark.parametrize("path, in_c", [("matvec", True), ("row-major+split", False), ("long-rows", False)])
@pytest.mark.parametrize("window", [None, 4])
def test_decode_runs_attention_in_c_on_the_matvec_path_only(path, in_c, window, monkeypatch, tmp_path):
    """A decode step's logits are the plain model's (up to float rounding), a sliding window
    (the last 4 keys of 10) too; prefill (many queries) keeps SDPA."""
    from tiny_models import LLAMA_BASE, build_hf, save_hf

    from minillm import KVCache, decode_step, load_model, prefill

    model = load_model(save_hf(build_hf("mistral", dict(LLAMA_BASE, sliding_window=window)), tmp_path), device="cpu",
                       fast=False)
    calls = []
    real = matvec_kernels.decode_attention
    monkeypatch.setattr(matvec_kernels, "decode_attention", lambda *a: calls.append(a[3]) or real(*a))
    logits = []
    for apply in (lambda: None, lambda: apply_decode_path(model, path)):  # the plain modules, then the path's
        apply()
        cache = KVCache.for_model(model, max_seq_len=20)
        prefill(model, torch.arange(9), cache)
        logits.append(decode_step(model, torch.tensor([3]), cache))
    assert model.decode_path == path and (logits[1] - logits[0]).abs().max() <= 1e-5
    assert calls == ([window or 10] * model.config.n_layers if in_c else [])


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
@pytest.mark.parametrize("window", [None, 4])
def test_a_bfloat16_decode_runs_attention_in_c_within_bfloat16s_error(window, monkeypatch, tmp_path):
    """A bfloat16 model's default path reads its bfloat16 cache in C each layer of a decode step (a sliding window:
    its last 4 keys of 12). Oracle: the float32 lesson model. Yardstick: E, the plain bfloat16 model's largest logit
    error from it over the steps; the fast model's is within 2E (as tests/test_dtypes_vs_hf.py bounds bfloat16)."""
    from tiny_models import LLAMA_BASE, build_hf, save_hf

    from minillm import KVCache, decode_step, load_model, prefill

    folder = save_hf(build_hf("mistral", dict(LLAMA_BASE, sliding_window=window)), tmp_path)
    monkeypatch.setenv("MINILLM_DECODE_PATH", "matvec")  # (the eager step: the replayed one calls the C directly)
    models = [load_model(folder, device="cpu", fast=False), load_model(folder, device="cpu", dtype="bfloat16",
                                                                       fast=False),
              load_model(folder, device="cpu", dtype="bfloat16")]
    calls = []
    real = matvec_kernels.decode_attention
    monkeypatch.setattr(matvec_kernels, "decode_attention", lambda *a: calls.append(a[3]) or real(*a))
    caches = [KVCache.for_model(m, max_seq_len=24) for m in models]
    for m, c in zip(models, caches):
        prefill(m, torch.arange(9), c)
    token, errors = torch.tensor([3]), [0.0, 0.0]
    for _ in range(3):
        expected = decode_step(models[0], token, caches[0])
        for i in (1, 2):
            errors[i - 1] = max(errors[i - 1], (decode_step(models[i], token, caches[i]) - expected).abs().max().item())
        token = expected.argmax(-1)
    assert calls == [min(window or 99, n) for n in (10, 11, 12) for _ in range(models[2].config.n_layers)]
    assert 0 < errors[0] and errors[1] <= 2 * errors[0], errors


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
@pytest.mark.parametrize("where", ["functions", "ops"])
def test_decode_attention_keeps_a_nan_or_infinite_key_visible(where):
    """As SDPA: the query heads that read a NaN or +inf key get NaN, the others stay finite (was:
    the vector exp's clamp turned the NaN into ~0, a plausible wrong output)."""
    matvec_kernels.prepare_for_compile()
    g = torch.Generator().manual_seed(3)
    q, (k, v) = torch.randn(1, 6, 1, 64, generator=g), torch.randn(2, 1, 2, 40, 64, generator=g)
    k[0, 0, 5, 0] = float("nan")
    k[0, 1, 17] = float("inf")
    kernels, n_keys = (torch.ops.minillm, torch.tensor([40])) if where == "ops" else (matvec_kernels, 40)
    out = kernels.decode_attention(q, k, v, n_keys, 0.125)
    expected = _attention_oracle(q, k, v, 40, 0.125)
    assert out[0, :, 0].isnan().any(-1).tolist() == expected[0, :, 0].isnan().any(-1).tolist() == [True] * 6


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
def test_the_kernels_return_float32_whatever_the_default_dtype():
    """Was: outputs made with torch's default dtype, so float64 after set_default_dtype, filled with
    float32 bits (garbage, 1e5 off) by the C loops."""
    from minillm.quantize import QuantizedLinear

    g = torch.Generator().manual_seed(2)
    q, (k, v) = torch.randn(1, 4, 1, 64, generator=g), torch.randn(2, 1, 2, 9, 64, generator=g)
    x, w = torch.randn(2, 64, generator=g), torch.randn(8, 64, generator=g)
    q8, q4 = QuantizedLinear(w, None, "int8"), QuantizedLinear(w, None, "int4")
    def run():
        return (matvec_kernels.decode_attention(q, k, v, 9, 0.2), matvec_kernels.f32_matvec(x, w),
                matvec_kernels.quantized_matvec(x, q8.qweight, q8.scale),
                matvec_kernels.quantized_matvec(x, q4.qweight, q4.scale, q4.zero, 64))

    expected = run()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = run()
    finally:
        torch.set_default_dtype(default)
    for a, b in zip(got, expected):
        assert a.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
@pytest.mark.parametrize("n_keys, scale, where, message", [
    (3.7, 0.1, "functions", "n_keys an int"),
    (torch.tensor(3.7), 0.1, "functions", "n_keys an int"),
    (5, None, "functions", "scale a number"),
    (torch.tensor(3.7), 0.1, "ops", "n_keys a one-element integer tensor"),
    (torch.tensor([5], device="meta"), 0.1, "ops", "on meta"),  # (was: an uninitialised output)
    (torch.tensor([5, 6]), 0.1, "ops", "one-element"),
])
def test_decode_attention_refuses_an_n_keys_or_scale_it_would_misread(n_keys, scale, where, message):
    matvec_kernels.prepare_for_compile()
    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 10, 64)
    kernels = torch.ops.minillm if where == "ops" else matvec_kernels
    with pytest.raises((ValueError, RuntimeError), match=message):
        kernels.decode_attention(q, k, k, n_keys, scale)


def test_packed_rows_follow_the_weight_when_it_is_edited_or_replaced(monkeypatch):
    """Between MATVEC_MAX_ROWS and PANEL_MAX_ROWS rows a server's product (``panels``) reads a packed copy
    of the matrix (above, F.linear): equal to the float64 oracle, and packed again after an in-place edit
    or a new weight tensor."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 64, generator=g), torch.randn(PANEL_MAX_ROWS + 1, 64, generator=g)
    packs = []
    pack = matvec_kernels.f32_pack_panels
    monkeypatch.setattr(matvec_kernels, "f32_pack_panels", lambda weight: packs.append(1) or pack(weight))
    linear = _linear("matvec", w)
    with torch.no_grad():
        linear(x[:PANEL_MAX_ROWS])
        assert packs == []  # not a server's module: F.linear, no copy
        linear.panels = True
        for rows in (MATVEC_MAX_ROWS, MATVEC_MAX_ROWS + 1, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1):
            assert (linear(x[:rows]).double() - _oracle(x[:rows], w)).abs().max() <= 1e-5 * _oracle(x, w).abs().max()
        assert len(packs) == 1  # at the first product of more than MATVEC_MAX_ROWS rows, once
        x = x[:PANEL_MAX_ROWS]
        before = linear(x)
        linear.weight.mul_(2)  # in place: the packed copy is stale
        assert torch.allclose(linear(x), 2 * before, atol=1e-4) and len(packs) == 2
        linear.weight = torch.nn.Parameter(-linear.weight, requires_grad=False)  # another tensor
        assert torch.allclose(linear(x), -2 * before, atol=1e-4) and len(packs) == 3


def _causal_oracle(q, k, v, scale):
    """softmax(scale · q·kᵀ) · v in float64, query t (the last T of S positions) seeing keys 0 .. S-T+t,
    written out: GQA by repeating K/V heads, the mask from the positions."""
    T, S, rep = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    visible = torch.arange(S)[None, :] <= (S - T + torch.arange(T))[:, None]
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


@BUILDS
@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), group=st.integers(1, 3), width=st.integers(1, 2),
       queries=st.integers(1, 70), cached=st.integers(0, 90), seed=st.integers(0, 2**16))
def test_causal_attention_equals_float64_softmax(batch, kv_heads, group, width, queries, cached, seed, portable):
    """Prefill's C attention over hypothesis' shapes: GQA groups, head_dim one or two panels, chunks of
    1-70 queries after 0-90 cached positions (row blocks and key panels cut anywhere), q a transposed
    projection and k, v a transposed gather (the layouts the model and the serving batch hand it)."""
    g, lib = torch.Generator().manual_seed(seed), _lib(portable)
    D, heads, S = width * matvec_kernels.panel_width(lib=lib), kv_heads * group, cached + queries
    q = torch.randn(batch, queries, heads, D, generator=g).transpose(1, 2)
    k, v = (torch.randn(batch, S, kv_heads, D, generator=g).transpose(1, 2) for _ in range(2))
    out = matvec_kernels.causal_attention(q, k, v, 0.3, lib=lib)
    assert out.shape == (batch, heads, queries, D) and out.is_contiguous()
    assert (out.double() - _causal_oracle(q, k, v, 0.3)).abs().max() <= 1e-5


@BUILDS
@settings(max_examples=30, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.integers(1, 3), width=st.integers(1, 2), queries=st.integers(1, 70),
       cached=st.integers(0, 90), seed=st.integers(0, 2**16))
def test_causal_attention_in_bfloat16_equals_float64_softmax(kv_heads, group, width, queries, cached, seed, portable):
    """bfloat16 q, k, v in the layouts above: the float64 softmax of the same bfloat16 numbers, off by the float32
    sums (1e-5, as above) and two roundings to bfloat16 (each at most u = 2^-8 of what it rounds), where SDPA's CPU
    flash kernel rounds: each softmax numerator before it weighs its value row (at most 2^-8 · Σ_j p_j·|v_j|), and
    the output (2^-8 of it), as decode_attention's bfloat16 test bounds them."""
    g, lib = torch.Generator().manual_seed(seed), _lib(portable)
    D, heads, S = width * matvec_kernels.panel_width(lib=lib), kv_heads * group, cached + queries
    q = torch.randn(1, queries, heads, D, generator=g).transpose(1, 2).bfloat16()
    k, v = (torch.randn(1, S, kv_heads, D, generator=g).transpose(1, 2).bfloat16() for _ in range(2))
    out = matvec_kernels.causal_attention(q, k, v, 0.3, lib=lib)
    expected, magnitude = _causal_oracle(q, k, v, 0.3), _causal_oracle(q, k, v.abs(), 0.3)
    assert out.shape == (1, heads, queries, D) and out.dtype == torch.bfloat16
    assert ((out.double() - expected).abs() <= 1e-5 + 2.0 ** -8 * (magnitude + expected.abs())).all()


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
def test_causal_attention_equals_sdpa_on_a_long_prompt_and_keeps_a_nan_visible():
    """A prompt of 300 positions (SDPA's is_causal the oracle, float32 both), far-apart scores (the
    online softmax's rescaling), and a NaN key: NaN for the queries that see it, as SDPA gives."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 9, 300, 64, generator=g) * 4, torch.randn(1, 3, 300, 64, generator=g), \
        torch.randn(1, 3, 300, 64, generator=g)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.5)
    assert (matvec_kernels.causal_attention(q, k, v, 0.5) - expected).abs().max() <= 1e-4
    k[0, 1, 150, 3] = float("nan")
    out = matvec_kernels.causal_attention(q, k, v, 0.5)
    sees_nan = out.isnan().any(-1)[0]  # [heads, T]
    assert sees_nan[3:6, 150:].all() and not sees_nan[3:6, :150].any() and not sees_nan[:3].any()


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
@pytest.mark.parametrize("change, message", [
    (lambda q, k: (q, k[:, :, :5]), r"1 <= T <= S"),  # more queries than keys
    (lambda q, k: (q[:, :, :0], k), r"1 <= T <= S.*got q torch.float32 \[1, 6, 0, "),  # no query
    (lambda q, k: (q[:, :5], k), r"heads a multiple of kv_heads"),
    (lambda q, k: (q[..., :24], k[..., :24]), r"D a multiple of"),
    (lambda q, k: (q.double(), k), r"got q torch.float64"),
    (lambda q, k: (q.bfloat16(), k), r"\(or all bfloat16\).*got q torch.bfloat16 .* k torch.float32"),
    (lambda q, k: (q.requires_grad_(), k), r"no backward pass, and an input requires grad"),
    (lambda q, k: (q, k.transpose(2, 3)), r"a contiguous last dimension"),
])
def test_causal_attention_refuses_what_it_would_misread(change, message):
    D = 2 * matvec_kernels.panel_width()
    q, k = change(torch.randn(1, 6, 10, D), torch.randn(1, 2, 10, D))
    with pytest.raises(ValueError, match=message):
        matvec_kernels.causal_attention(q, k, k.clone() if k.is_contiguous() else k, 0.1)


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
@pytest.mark.parametrize("window", [None, 40])
def test_prefill_runs_attention_in_c_on_the_matvec_path(window, monkeypatch, tmp_path):
    """A 120-token prefill on the matvec path gives the plain model's logits, its attention in C; a
    short one (below PREFILL_MIN_SCORES) and a sliding window keep SDPA."""
    from tiny_models import LLAMA_BASE, build_hf, save_hf

    from minillm import KVCache, load_model, prefill
    from minillm.fast.attention import PREFILL_MIN_SCORES

    config = dict(LLAMA_BASE, head_dim=matvec_kernels.panel_width(), sliding_window=window)
    model = load_model(save_hf(build_hf("mistral", config), tmp_path), device="cpu", fast=False)
    calls = []
    real = matvec_kernels.causal_attention
    monkeypatch.setattr(matvec_kernels, "causal_attention", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    ids = torch.randint(0, model.config.vocab_size, (120,), generator=torch.Generator().manual_seed(0))
    logits = []
    for apply in (lambda: None, lambda: apply_decode_path(model, "matvec")):
        apply()
        logits.append(prefill(model, ids, KVCache.for_model(model, max_seq_len=128)))
        prefill(model, ids[:8], KVCache.for_model(model, max_seq_len=128))  # 64 query-key pairs: SDPA
    assert 8 * 8 < PREFILL_MIN_SCORES <= 120 * 120
    assert (logits[1] - logits[0]).abs().max() <= 1e-4
    assert calls == ([] if window else [120] * model.config.n_layers)
    attn = model.blocks[0].attn  # what a trace records: the pairs of a pass after a cached prefix count
    assert 70 * 70 < PREFILL_MIN_SCORES <= 70 * 128
    assert [attn.impl_name(t, "sdpa", s) for t, s in ((70, 128), (8, 8), (1, 50))] == \
        (["sdpa", "sdpa", "c"] if window else ["c", "sdpa", "c"])


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
def test_a_bfloat16_prefill_runs_attention_in_c_within_bfloat16s_error(monkeypatch, tmp_path):
    """A bfloat16 model's 120-token prefill runs its attention in C each layer (SDPA's bfloat16 kernel took 1.8x its
    time at 480 tokens on the developers' AMD EPYC): on pairs of bfloat16s where the build has AVX512-BF16
    (causal_attention_bf16), else the float32 loop on widened keys and values. Oracle: the float32 lesson model.
    Yardstick: E, the plain bfloat16 model's largest logit error from it; the fast model's is within 2E (as
    tests/test_dtypes_vs_hf.py bounds bfloat16)."""
    from tiny_models import LLAMA_BASE, build_hf, save_hf

    from minillm import KVCache, load_model, prefill

    folder = save_hf(build_hf("llama", dict(LLAMA_BASE, head_dim=matvec_kernels.panel_width())), tmp_path)
    models = [load_model(folder, device="cpu", fast=False), load_model(folder, device="cpu", dtype="bfloat16",
                                                                       fast=False),
              load_model(folder, device="cpu", dtype="bfloat16")]
    calls = []
    for name in ("causal_attention", "causal_attention_bf16"):
        real = getattr(matvec_kernels, name)
        monkeypatch.setattr(matvec_kernels, name,
                            lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    ids = torch.randint(0, models[0].config.vocab_size, (120,), generator=torch.Generator().manual_seed(0))
    logits = [prefill(m, ids, KVCache.for_model(m, max_seq_len=128)) for m in models]
    errors = [(lg.float() - logits[0]).abs().max().item() for lg in logits[1:]]
    pairs = matvec_kernels.bf16_dot_instructions() and matvec_kernels.panel_width() % 32 == 0
    assert calls == ["causal_attention_bf16" if pairs else "causal_attention"] * models[2].config.n_layers
    assert 0 < errors[0] and errors[1] <= 2 * errors[0], errors


@pytest.mark.skipif(not matvec_kernels.available(), reason="needs the C kernels")
def test_a_server_packs_panels_only_when_asked(tmp_path):
    """One copy of the weights by default: generate's prefill and the serving engine's steps keep F.linear
    (no packed copy); after pack_panels (``minillm serve --pack-weights``) a step of 30 rows packs the
    decoder's matrices, with the same greedy tokens as generate both ways."""
    from tiny_models import LLAMA_BASE, build_hf, save_hf

    from minillm import LLMEngine, SamplingParams, generate, load_model
    from minillm.fast.packing import pack_panels, product_modules
    from minillm.fast.products import MatvecLinear

    model = load_model(save_hf(build_hf("llama", LLAMA_BASE), tmp_path), device="cpu", fast=False)
    apply_decode_path(model, "matvec")
    products = [m for m in product_modules(model) if isinstance(m, MatvecLinear)]
    run = [m for b in model.blocks for m in (b.attn.qkv.module, b.attn.o_proj, b.mlp.gate_up.module, b.mlp.down_proj)]
    prompt = list(range(3, 33))
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    alone = [step.token_id for step in generate(model, prompt, params, eos_token_ids=())]

    def served() -> list[int]:
        engine = LLMEngine(model, num_blocks=16)
        engine.add_request(prompt, params)
        finished = []
        while not finished:
            finished = [o for o in engine.step() if o.finished]
        return finished[0].token_ids

    assert products and served() == alone
    assert not any(m.panels or m._panels for m in products)
    assert pack_panels(model) == len(products)
    assert served() == alone
    assert all(m.panels for m in products) and all(m._panels is not None for m in run)  # (the head saw 1 row)
