"""load_model chooses the speed layer by rule and never times a decode step while it loads.

A first load used to time every eager decode path (minutes on a busy machine), and a model whose
context was shorter than that measurement's cache could not load at all: a GPT-2 saved with
n_positions=64 failed with "max_seq_len must be in [1, 64] (the model's context), got 83".
"""

import pytest
import torch
from tiny_models import build_hf, save_hf

from minillm import KVCache, decode_step, load_model, prefill
from minillm.fast import choose

pytest.importorskip("transformers")

GPT2_64 = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)


@pytest.fixture
def no_timing(monkeypatch, tmp_path):
    """Any decode-path measurement fails the test; an empty weights dir holds no cached choice."""
    def refuse(*args, **kwargs):
        raise AssertionError("load_model timed decode paths")

    monkeypatch.setattr(choose, "measure_decode_paths", refuse)
    monkeypatch.setattr(choose, "calibrate_decode_path", refuse)
    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path / "weights"))
    monkeypatch.delenv("MINILLM_DECODE_PATH", raising=False)


@pytest.mark.parametrize("fast", [True, False])
def test_a_64_position_gpt2_loads_and_gives_transformers_logits(no_timing, tmp_path, fast):
    hf = build_hf("gpt2", GPT2_64)
    model = load_model(save_hf(hf, tmp_path / "gpt2-64"), device="cpu", fast=fast)
    assert model.decode_choice.source == "rule" if fast else model.decode_path is None
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(model(ids), expected, rtol=1e-4, atol=1e-4)

    cache = KVCache.for_model(model)  # the whole 64-position context, prefill then decode to its end
    logits = [prefill(model, ids[0, :60], cache)] + [decode_step(model, ids[0, i], cache) for i in range(60, 63)]
    for got, position in zip(logits, range(59, 63)):
        torch.testing.assert_close(got[0], expected[0, position], rtol=1e-4, atol=1e-4)


def test_the_rule_picks_the_c_path_where_the_kernels_build(no_timing, tmp_path):
    model = load_model(save_hf(build_hf("gpt2", GPT2_64), tmp_path / "m"), device="cpu")
    expected = "replay" if choose.kernels.available() else "row-major+split"
    assert (model.decode_path, model.decode_choice.timings_ms) == (expected, {})


@pytest.mark.parametrize("fast", [True, False])
def test_float64_loads_and_agrees_with_float32_through_prefill_and_decode(no_timing, tmp_path, fast):
    """float64 (DTYPES' checking dtype) end to end: weights and KV cache in float64, the same logits as float32."""
    folder = save_hf(build_hf("gpt2", GPT2_64), tmp_path / "gpt2-64")
    ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for dtype in (torch.float32, torch.float64):
        model = load_model(folder, device="cpu", dtype=dtype, fast=fast)
        cache = KVCache.for_model(model, max_seq_len=16)
        assert {p.dtype for p in model.parameters()} == {dtype} and cache.k.dtype == dtype
        steps = [prefill(model, ids[:8], cache)] + [decode_step(model, ids[i], cache) for i in range(8, 12)]
        logits[dtype] = torch.cat(steps)  # [5, vocab]: float32 by prefill's and decode_step's contract
    torch.testing.assert_close(logits[torch.float64], logits[torch.float32], rtol=0, atol=1e-5)


def test_fast_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match="fast must be True or False, got 'no'"):
        load_model(tmp_path, fast="no")
