"""minillm.fast.products: decode's few-row products split into one column block per CPU thread.

The oracle is F.linear on the same tensors, on both weight layouts the decode paths use.
"""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minillm.fast import kernels
from minillm.fast.products import SPLIT_MAX_ROWS, SplitLinear, split_product, swap_class


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def weight(out, inp, column_major):
    return torch.randn(inp, out).t() if column_major else torch.randn(out, inp)  # [out, in] either way


@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("rows", [1, 3, SPLIT_MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_split_product_equals_f_linear(threads, column_major, rows, with_bias):
    threads(2)
    torch.manual_seed(rows)
    w, x = weight(96, 40, column_major), torch.randn(rows, 1, 40)
    b = torch.randn(96) if with_bias else None
    with mock.patch("torch.bmm", wraps=torch.bmm) as bmm:
        got = split_product(x, w, b)
    assert bmm.call_count == 1  # the split path ran
    assert got.shape == (rows, 1, 96)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["many rows", "one thread", "out not divisible", "bfloat16", "autograd"])
def test_other_products_go_to_f_linear(threads, case):
    threads(1 if case == "one thread" else 3 if case == "out not divisible" else 2)
    rows = SPLIT_MAX_ROWS + 1 if case == "many rows" else 1
    w, x = torch.randn(64, 24), torch.randn(rows, 24)  # 64 % 3 != 0
    if case == "bfloat16":
        w, x = w.bfloat16(), x.bfloat16()
    w.requires_grad_(case == "autograd")
    with mock.patch("torch.bmm", wraps=torch.bmm) as bmm:
        got = split_product(x, w)
    assert bmm.call_count == 0
    torch.testing.assert_close(got, F.linear(x, w))
    if case == "autograd":
        got.sum().backward()
        torch.testing.assert_close(w.grad, x.expand(64, 24))


@pytest.mark.parametrize("with_bias", [False, True])
def test_split_linear_is_nn_linear_with_the_same_parameters_and_values(threads, with_bias):
    """The module a decode path swaps in: same parameter objects and state_dict, the split product,
    values of the plain nn.Linear (float64 oracle)."""
    threads(2)
    torch.manual_seed(0)
    linear = nn.Linear(40, 96, bias=with_bias).requires_grad_(False)
    params, keys = list(linear.parameters()), list(linear.state_dict())
    x = torch.randn(2, 3, 40)
    expected = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    swapped = swap_class(linear, SplitLinear)
    assert swapped is linear and isinstance(linear, nn.Linear)
    assert all(a is b for a, b in zip(linear.parameters(), params)) and list(linear.state_dict()) == keys
    with mock.patch("torch.bmm", wraps=torch.bmm) as bmm:
        got = linear(x)
    assert bmm.call_count == 1 and got.shape == (2, 3, 96)
    assert (got.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("dtype, path, transposed", [
    ("float32", "long-rows+split", True), ("float32", "matvec", False), ("float32", "row-major", False),
    ("bfloat16", "default", True), pytest.param("bfloat16", "replay", False, marks=pytest.mark.skipif(
        not kernels.available(), reason="needs the C kernels")), ("float16", "default", False),
    ("float64", "default", True)])
def test_each_paths_layout_and_float16s_row_major_default(tmp_path, dtype, path, transposed):
    """A long-rows path (and the default path off float32, but for float16) stores [out, in] matrices with out >= in
    transposed; the others (bfloat16's C paths among them: their one-row products read rows) keep nn.Linear's rows.
    Values stay the weights'."""
    from tiny_models import CONFIGS, build_hf, save_hf

    from minillm import load_model
    from minillm.fast.choose import apply_decode_path

    family, kwargs = CONFIGS["llama_gqa"]
    folder = save_hf(build_hf(family, kwargs), tmp_path)
    model = load_model(folder, device="cpu", dtype=dtype, fast=False)
    gate, up = (model.blocks[0].mlp.gate_proj.weight.clone(), model.blocks[0].mlp.up_proj.weight.clone())
    apply_decode_path(model, path)
    gate_up = model.blocks[0].mlp.gate_up.module.weight  # [2·d_mlp, d_model], out >= in
    assert gate_up.t().is_contiguous() == transposed and gate_up.is_contiguous() == (not transposed)
    assert torch.equal(gate_up, torch.cat([gate, up]))
