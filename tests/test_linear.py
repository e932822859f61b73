"""model.linear: decode's few-row products split into one column block per CPU thread.

The oracle is F.linear on the same tensors, on both weight layouts pack_weights uses.
"""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from minillm.model import SPLIT_MAX_ROWS, linear


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
        got = linear(x, w, b)
    assert bmm.call_count == 1  # the split path ran
    assert got.shape == (rows, 1, 96)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["many rows", "one thread", "out not divisible", "bfloat16"])
def test_other_products_go_to_f_linear(threads, case):
    threads(1 if case == "one thread" else 3 if case == "out not divisible" else 2)
    rows = SPLIT_MAX_ROWS + 1 if case == "many rows" else 1
    w, x = torch.randn(64, 24), torch.randn(rows, 24)  # 64 % 3 != 0
    if case == "bfloat16":
        w, x = w.bfloat16(), x.bfloat16()
    with mock.patch("torch.bmm", wraps=torch.bmm) as bmm:
        got = linear(x, w)
    assert bmm.call_count == 0
    torch.testing.assert_close(got, F.linear(x, w))


@pytest.mark.parametrize("dtype, transposed", [("float32", True), ("bfloat16", True), ("float16", False)])
def test_cpu_layout_is_column_major_except_in_float16(tmp_path, dtype, transposed):
    from tiny_models import CONFIGS, build_hf, save_hf

    from minillm import load_model

    family, kwargs = CONFIGS["llama_gqa"]
    model = load_model(save_hf(build_hf(family, kwargs), tmp_path), device="cpu", dtype=dtype)
    gate_up = model.blocks[0].mlp.gate_up_weight  # [2·d_mlp, d_model], out >= in
    assert gate_up.t().is_contiguous() == transposed and gate_up.is_contiguous() == (not transposed)
