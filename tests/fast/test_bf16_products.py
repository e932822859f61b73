"""The bfloat16 products (minillm/fast/csrc/bf16_products.c) against float64 F.linear, on the native build and
the portable one (no -march=native: the weights widened by the shift instead of AVX512-BF16's dot product; the rows'
kernel, AVX512-BF16 only, on the native build where it has them);
the C file's scalar reference too; and which kernel a product module runs, as the rule's table
(minillm.fast.products.few_rows_kernel, minillm.fast.choose.few_rows_in_c)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minillm.fast import kernels
from minillm.fast.choose import few_rows_in_c
from minillm.fast.products import MatvecLinear, few_rows_kernel

BUILDS = pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
BF16_EPS = 2.0 ** -8  # bfloat16 keeps 8 significant bits: rounding a result moves it by at most half of 2^-7


def _lib(portable: bool):
    lib = kernels.kernels(portable)
    if lib is None:
        pytest.skip("needs the C kernels")
    return lib


def _assert_bf16_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y is x @ wᵀ rounded once to bfloat16: within half an ulp of bfloat16 of the float64 product, plus
    the float32 sums' rounding (in·2^-24 of Σ|x·w|, Higham's bound for a sum of in terms)."""
    exact = F.linear(x.double(), w.double())
    magnitude = F.linear(x.double().abs(), w.double().abs())
    bound = BF16_EPS * exact.abs() + x.shape[1] * 2.0 ** -24 * magnitude * (1 + BF16_EPS) + 1e-30
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    assert ((y.double() - exact).abs() <= bound).all(), (y.double() - exact).abs().max()


@BUILDS
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 8), out_features=st.integers(1, 70), in_features=st.integers(1, 200),
       seed=st.integers(0, 2**16))
def test_bf16_matvec_equals_float64_linear(rows, out_features, in_features, seed, portable):
    """In-features across the 64-wide dot-product steps and their tails, 1-8 rows (4-row blocks and the rest)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    _assert_bf16_product(kernels.bf16_matvec(x, w, lib=_lib(portable)), x, w)


@BUILDS
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 576, 576), (8, 96, 1536), (3, 2048, 128)])
def test_bf16_matvec_at_a_models_shapes(rows, out_features, in_features, portable):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    _assert_bf16_product(kernels.bf16_matvec(x, w, lib=_lib(portable)), x, w)


@BUILDS
def test_bf16_matvec_keeps_nan_and_infinity(portable):
    """A NaN or an infinite input makes its outputs NaN or infinite, as F.linear's: not a plausible number."""
    w = torch.ones(3, 64, dtype=torch.bfloat16)
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    y = kernels.bf16_matvec(x, w, lib=_lib(portable))
    assert y[0].isnan().all() and (y[1] == float("inf")).all()


@BUILDS
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 4), out_features=st.integers(1, 20), in_features=st.integers(1, 70),
       seed=st.integers(0, 2**16))
def test_the_scalar_reference_equals_float64_linear(rows, out_features, in_features, seed, portable):
    """bf16_matmul_reference, the few lines bf16_products.c opens with, that its fast loop is read against."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    y = torch.empty(rows, out_features, dtype=torch.bfloat16)
    _lib(portable).bf16_matmul_reference(x.data_ptr(), w.data_ptr(), y.data_ptr(), rows, out_features, in_features)
    _assert_bf16_product(y, x, w)


def test_the_portable_build_has_no_dot_product_instruction():
    assert kernels.bf16_dot_instructions(lib=_lib(True)) is False


def _pairs_lib():
    lib = _lib(False)
    if not kernels.bf16_dot_instructions(lib=lib):
        pytest.skip("needs a build with AVX512-BF16")
    return lib


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), out_features=st.integers(1, 40), half_in=st.integers(1, 120),
       seed=st.integers(0, 2**16))
def test_bf16_rows_matmul_equals_float64_linear(rows, out_features, half_in, seed):
    """Rows across the blocks of 16 and 32 lanes (and their padding), outputs across the tiles of 8 and the rest, even
    in-features: within the bound of one rounding and the float32 sums."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, 2 * half_in, generator=g).bfloat16()
    x = torch.randn(rows, 2 * half_in, generator=g).bfloat16()
    _assert_bf16_product(kernels.bf16_rows_matmul(x, w, lib=_pairs_lib()), x, w)


@pytest.mark.parametrize("rows, out_features, in_features", [(32, 960, 576), (17, 576, 1536), (128, 64, 2048)])
def test_bf16_rows_matmul_at_a_models_shapes(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    _assert_bf16_product(kernels.bf16_rows_matmul(x, w, lib=_pairs_lib()), x, w)


def test_bf16_rows_matmul_keeps_nan_and_infinity_and_reads_no_padding():
    """A NaN or infinite input makes its row's outputs NaN or infinite; the rows padded to a block do not reach y (a
    NaN past the rows would)."""
    w = torch.ones(9, 64, dtype=torch.bfloat16)
    x = torch.ones(18, 64, dtype=torch.bfloat16)
    x[0, 5], x[17, 7] = float("nan"), float("inf")
    y = kernels.bf16_rows_matmul(x, w, lib=_pairs_lib())
    assert y[0].isnan().all() and (y[17] == float("inf")).all() and (y[1:17] == 64).all()


@pytest.mark.parametrize("x, w, message", [
    (torch.ones(2, 5, dtype=torch.bfloat16), torch.ones(3, 5, dtype=torch.bfloat16), "in must be even, got 5"),
    (torch.ones(2, 4), torch.ones(3, 4), "bfloat16 CPU tensors"),
])
def test_bf16_rows_matmul_refuses_what_its_loop_would_misread(x, w, message):
    lib = _pairs_lib()
    with pytest.raises(ValueError, match=message):
        kernels.bf16_rows_matmul(x, w, lib=lib)


def test_bf16_rows_matmul_refuses_a_build_without_the_dot_products():
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"AVX512-BF16 \(bf16_dot_instructions\(\) is False here\)"):
        kernels.bf16_rows_matmul(x, x, lib=_lib(True))


@pytest.mark.parametrize("x, w, message", [
    (torch.ones(1, 4), torch.ones(2, 4, dtype=torch.bfloat16), "bfloat16 CPU tensors, got x torch.float32"),
    (torch.ones(1, 4, dtype=torch.bfloat16), torch.ones(2, 5, dtype=torch.bfloat16),
     r"of the same in, got x \[1, 4\] and weight \[2, 5\]; reshape"),
    (torch.ones(1, 4, dtype=torch.bfloat16, requires_grad=True), torch.ones(2, 4, dtype=torch.bfloat16),
     r"no backward pass"),
    (torch.ones(1, 4, dtype=torch.bfloat16), torch.ones(4, 2, dtype=torch.bfloat16).t(),
     r"contiguous: False\); pass weight.contiguous\(\)"),
    (torch.ones(4, dtype=torch.bfloat16), torch.ones(2, 4, dtype=torch.bfloat16), r"x \[rows, in\]"),
])
def test_bf16_matvec_refuses_what_its_loop_would_misread(x, w, message):
    _lib(False)
    with pytest.raises(ValueError, match=message):
        kernels.bf16_matvec(x, w)


# -- which kernel runs: the rule as a table -------------------------------------------------------

F32, BF16 = torch.float32, torch.bfloat16
PAIRS = kernels.available() and kernels.bf16_dot_instructions()  # (this build runs bf16_rows_matmul)


@pytest.mark.parametrize("rows, dtype, few_rows_in_c, panels, kernel", [
    (1, F32, False, False, "F.linear"),  # an Intel CPU: MKL's product of 1-3 rows wins
    (1, F32, True, False, "f32_matvec"),  # an AMD CPU: the C loop wins
    (3, F32, False, False, "F.linear"),
    (3, F32, True, False, "f32_matvec"),
    (4, F32, False, False, "f32_matvec"),
    (8, F32, False, True, "f32_matvec"),
    (9, F32, False, False, "F.linear"),  # generate's prefill chunk: no packed copy
    (9, F32, False, True, "f32_panel_matmul"),  # a server's batch
    (4, F32, True, False, "f32_matvec"),  # an AMD CPU, 4 rows: the C loop (about even with the rows' kernel)
    (5, F32, True, False, "f32_rows_matmul"),  # an AMD CPU, 5-128 rows: x's rows along the lanes
    (32, F32, True, False, "f32_rows_matmul"),
    (128, F32, True, False, "f32_rows_matmul"),
    (129, F32, True, False, "F.linear"),
    (8, F32, True, True, "f32_matvec"),  # a server that packed its panels keeps them
    (32, F32, True, True, "f32_panel_matmul"),
    (32, F32, False, False, "F.linear"),  # an Intel CPU: MKL
    (256, F32, True, True, "f32_panel_matmul"),
    (257, F32, True, True, "F.linear"),
    (1, BF16, False, False, "bf16_matvec"),
    (1, BF16, True, True, "bf16_matvec"),
    (2, BF16, True, True, "bf16_matvec"),  # (a batch of two decodes: 0.85-0.88x F.linear's time)
    (3, BF16, False, False, "F.linear"),  # (the C loop's multiply-adds bound it: about even at 3 rows)
    (8, BF16, False, False, "F.linear"),
    (3, BF16, True, False, "bf16_matvec"),  # an AMD CPU without AVX512-BF16's pairs: 0.76-0.86x F.linear's time
    (8, BF16, True, True, "bf16_matvec"),
    (9, BF16, True, True, "F.linear"),
    (9, BF16, False, True, "F.linear"),  # (prefill: oneDNN's AMX kernels)
    (1, torch.float16, True, True, "F.linear"),
    (1, torch.float64, True, True, "F.linear"),
])
def test_few_rows_kernel_table(rows, dtype, few_rows_in_c, panels, kernel):
    assert few_rows_kernel(rows, dtype, few_rows_in_c, panels) == kernel


@pytest.mark.parametrize("rows, few_rows_in_c, compiled, kernel", [
    (1, True, False, "bf16_matvec"),  # (1-8 rows: the C loop with its prefetch, 8.2-10.9 against 12.8-13.2 ms)
    (8, True, False, "bf16_matvec"),
    (9, True, False, "bf16_rows_matmul"),  # (0.59x F.linear's time at 9 rows, 0.66x at 32)
    (32, True, False, "bf16_rows_matmul"),
    (128, True, False, "bf16_rows_matmul"),
    (129, True, False, "F.linear"),
    (32, False, False, "F.linear"),  # (an Intel CPU: not measured there)
    (4, True, True, "bf16_matvec"),  # (compiled code: no torch op of the rows' kernel)
])
def test_few_rows_kernel_table_with_bfloat16_pairs(rows, few_rows_in_c, compiled, kernel):
    assert few_rows_kernel(rows, BF16, few_rows_in_c, False, compiled=compiled, pairs=True) == kernel


@pytest.mark.parametrize("rows, dtype, kernel", [
    (1, BF16, "bf16_amx_matmul"),  # (the matrix units with the weight in place: 0.60x F.linear's time at one row)
    (2, BF16, "bf16_amx_matmul"),
    (32, BF16, "bf16_amx_matmul"),
    (256, BF16, "bf16_amx_matmul"),  # (0.83x)
    (257, BF16, "F.linear"),  # (at 512 rows 1.05-1.10x: oneDNN's reorder of the weight is paid back)
    (1, F32, "F.linear"),  # (float32 has no matrix units)
    (8, torch.float16, "F.linear"),
])
def test_few_rows_kernel_table_on_the_matrix_units(rows, dtype, kernel):
    assert few_rows_kernel(rows, dtype, False, True, amx=True) == kernel


@pytest.mark.parametrize("cpu_name, in_c", [
    ("AMD EPYC 9R14 96-Core Processor", True),
    ("AMD Ryzen 9 7950X 16-Core Processor", True),
    ("Intel(R) Xeon(R) Processor", False),
    ("Intel(R) Xeon(R) Platinum 8488C", False),
    ("Apple M2", False),
    ("aarch64", False),
    ("", False),
])
def test_few_rows_in_c_only_on_an_amd_cpu(cpu_name, in_c):
    assert few_rows_in_c(cpu_name) is in_c


def _matvec_linear(weight: torch.Tensor, few_rows_in_c: bool) -> MatvecLinear:
    with torch.device("meta"):
        linear = MatvecLinear(1, 1, bias=False)
    linear.out_features, linear.in_features = weight.shape
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.few_rows_in_c = few_rows_in_c
    return linear


@pytest.mark.parametrize("dtype, rows, few_rows_in_c, ran", [
    (F32, 1, False, None), (F32, 1, True, "f32_matvec"), (F32, 3, False, None), (F32, 4, False, "f32_matvec"),
    (BF16, 1, False, "bf16_matvec"), (BF16, 1, True, "bf16_matvec"), (BF16, 8, False, None),
    (BF16, 2, True, "bf16_matvec"), (BF16, 8, True, "bf16_matvec"),
    (BF16, 9, True, "bf16_rows_matmul" if PAIRS else None),
    (BF16, 32, True, "bf16_rows_matmul" if PAIRS else None), (F32, 5, True, "f32_rows_matmul"),
    (F32, 32, True, "f32_rows_matmul"), (F32, 32, False, None),
])
def test_a_product_module_runs_the_tables_kernel_with_linears_values(dtype, rows, few_rows_in_c, ran, monkeypatch):
    """MatvecLinear calls the kernel the table names (None: F.linear) and gives F.linear's values."""
    _lib(False)
    calls = []
    for name in ("f32_matvec", "bf16_matvec", "f32_rows_matmul", "bf16_rows_matmul"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, kernel=kernel, name=name, **k: calls.append(name) or kernel(*a, **k))
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(40, 100, generator=g).to(dtype), torch.randn(1, rows, 100, generator=g).to(dtype)
    y = _matvec_linear(w, few_rows_in_c)(x)
    assert calls == ([ran] if ran else [])
    if dtype == BF16:
        _assert_bf16_product(y[0], x[0], w)
    else:
        torch.testing.assert_close(y.double(), F.linear(x.double(), w.double()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, op", [(4, "minillm.f32_matvec"), (8, "minillm.f32_matvec"), (9, "linear")])
def test_a_compiled_product_of_a_few_rows_keeps_the_c_loops_op(rows, op):
    """f32_rows_matmul (5-128 rows where few_rows_in_c) has no torch op: a graph keeps f32_matvec's op to 8 rows, as it
    did before that kernel (a new user's trial: 5-8 rows had gone to F.linear, 1.4x its time), then F.linear."""
    _lib(False)
    kernels.prepare_for_compile()  # (the C kernels as torch ops)
    linear = _matvec_linear(torch.randn(24, 64), few_rows_in_c=True)
    seen = []

    def backend(graph, example_inputs):
        seen.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(linear, backend=backend, fullgraph=True)(torch.randn(rows, 64))
    products = [t for t in seen if "minillm" in t or "linear" in t]
    assert len(products) == 1 and op in products[0], seen


def test_a_bfloat16_product_with_a_bias_is_f_linears_to_the_bit():
    """A bias goes inside F.linear's one rounding: the kernel's bfloat16 sums plus a bias would round twice."""
    _lib(False)
    g = torch.Generator().manual_seed(7)
    linear = MatvecLinear(64, 24, bias=True).to(BF16)
    with torch.no_grad():
        linear.bias.copy_(torch.randn(24, generator=g))
    x = torch.randn(1, 1, 64, generator=g).to(BF16)
    assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
