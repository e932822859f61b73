"""Sliding-window attention (Mistral's ``sliding_window``) against transformers on the same weights.

A query at position i sees keys j with i - W < j <= i. Checked: the mask against transformers'
own mask function, logits for prompts around the window, prefill + decode across it (a cache
that keeps every position, and a rolling buffer of W), greedy generation, and what the KV cache
and the cost model count.
"""

import pytest
import torch
from tiny_models import LLAMA_BASE, build_hf, save_hf

from minillm import KVCache, PrefixCache, SamplingParams, decode_step, generate, load_model, prefill
from minillm.costs import decode_cost, kv_bytes_per_token, prefill_cost
from minillm.model import causal_mask
from minillm.trace import Trace

pytest.importorskip("transformers")

TOL = 1e-4
W = 8
MISTRAL_W = dict(LLAMA_BASE, sliding_window=W)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(hf_model, folder): a random-weight Mistral with a window of 8 (context 128)."""
    hf = build_hf("mistral", MISTRAL_W)
    return hf, save_hf(hf, tmp_path_factory.mktemp("mistral_w8"))


@pytest.fixture(scope="module", params=[True, False], ids=["fast", "pure"])
def pair(request, checkpoint):
    """(hf_model, minillm_model) on the same weights: the speed layer's modules, or the plain ones."""
    hf, folder = checkpoint
    return hf, load_model(folder, device="cpu", dtype="float32", fast=request.param)


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, LLAMA_BASE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _cache(model, rolling: bool, max_seq_len: int = 64) -> KVCache:
    return KVCache.for_model(model, max_seq_len=max_seq_len, rolling=rolling)


@pytest.mark.parametrize("n_queries, n_keys", [(5, 5), (1, 12), (3, 12), (12, 12)])
@pytest.mark.parametrize("window", [1, 3, 8])
def test_mask_is_transformers_sliding_window_mask(n_queries, n_keys, window):
    from transformers.masking_utils import sliding_window_causal_mask_function

    allowed = sliding_window_causal_mask_function(window)
    offset = n_keys - n_queries  # the queries are the last positions
    q_idx = torch.arange(n_queries)[:, None] + offset
    kv_idx = torch.arange(n_keys)[None, :]
    expected = allowed(torch.tensor(0), torch.tensor(0), q_idx, kv_idx)
    assert torch.equal(causal_mask(n_queries, n_keys, window=window), expected)


def test_config_keeps_the_full_context(pair):
    from minillm.cli.models import family_rows

    hf, model = pair
    assert model.config.max_seq_len == LLAMA_BASE["max_position_embeddings"]
    assert [model.config.window(layer) for layer in range(2)] == [hf.config.sliding_window] * 2
    assert ("attention window", "sliding window of 8: each query sees the last 8 positions (every layer)") in (
        family_rows(model.config))  # minillm info's row


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("n", [W - 1, W, W + 1, 3 * W])
def test_logits_match_transformers(pair, impl, n):
    hf, model = pair
    model.attn_impl = impl
    ids = _ids(n)
    with torch.no_grad():
        expected = hf(ids).logits
        got = model(ids)
    assert (got - expected).abs().max().item() <= TOL


def test_window_changes_the_logits(pair):
    """The check above can fail: the same weights with full attention differ past the window."""
    hf, model = pair
    ids = _ids(3 * W)
    with torch.no_grad():
        windowed = model(ids)
        hf.config.sliding_window = None
        full = hf(ids).logits
        hf.config.sliding_window = W
    assert (windowed[:, :W] - full[:, :W]).abs().max().item() <= TOL  # the same inside the window
    assert (windowed[:, W:] - full[:, W:]).abs().max().item() > 1e-2


def test_issue_example_20_tokens_on_a_window_of_16(tmp_path):
    """Issue 17: a 20-token prompt on a window of 16 was refused as longer than the context."""
    hf = build_hf("mistral", dict(LLAMA_BASE, sliding_window=16), seed=2)
    model = load_model(save_hf(hf, tmp_path), device="cpu", dtype="float32")
    ids = _ids(20, seed=4)
    with torch.no_grad():
        expected = hf(ids).logits[:, -1]
    got = prefill(model, ids, KVCache.for_model(model, max_seq_len=20))
    assert (got - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("rolling", [False, True], ids=["full-cache", "rolling"])
@pytest.mark.parametrize("prompt", [3, W + 3])
def test_prefill_and_decode_across_the_window(pair, impl, rolling, prompt):
    """Decode from inside to far past the window equals the no-cache forward and transformers."""
    hf, model = pair
    model.attn_impl = impl
    ids = _ids(3 * W)
    with torch.no_grad():
        reference = model(ids)
        expected = hf(ids).logits
    cache = _cache(model, rolling)
    logits = [prefill(model, ids[:, :prompt], cache)]
    logits += [decode_step(model, ids[:, i], cache) for i in range(prompt, 3 * W - 1)]
    got = torch.stack(logits, dim=1)
    assert (got - reference[:, prompt - 1 : -1]).abs().max().item() <= TOL
    assert (got - expected[:, prompt - 1 : -1]).abs().max().item() <= TOL


@pytest.mark.parametrize("chunks", [(5, 13, 6), (W, W, W), (2, 19, 3)])
def test_chunked_prefill_into_a_rolling_buffer(pair, chunks):
    """A chunk onto a wrapped buffer reads the held keys before its own overwrite them."""
    _, model = pair
    model.attn_impl = "sdpa"
    ids = _ids(sum(chunks))
    with torch.no_grad():
        reference = model(ids)
    cache, start = _cache(model, rolling=True), 0
    for n in chunks:
        got = prefill(model, ids[:, start : start + n], cache)
        start += n
        assert (got - reference[:, start - 1]).abs().max().item() <= TOL


@pytest.mark.parametrize("rolling", [False, True], ids=["full-cache", "rolling"])
def test_greedy_generate_matches_transformers(pair, rolling):
    hf, model = pair
    prompt = _ids(W + 2, seed=3)
    with torch.no_grad():
        hf_out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    cache = _cache(model, rolling)
    steps = list(generate(model, prompt[0], SamplingParams(max_new_tokens=32), cache=cache, eos_token_ids=()))
    assert [s.token_id for s in steps] == hf_out[0, W + 2 :].tolist()


# -- the rolling buffer: memory, repr, what it refuses ------------------------------------


def test_rolling_cache_bytes_and_repr(pair):
    _, model = pair
    c = model.config
    per_layer_position = 2 * c.n_kv_heads * c.head_dim * 4  # K and V, float32
    cache = _cache(model, rolling=True, max_seq_len=64)
    assert cache.rolling_layers == (0, 1)
    assert cache.bytes_capacity == c.n_layers * W * per_layer_position
    prefill(model, _ids(5), cache)
    assert cache.bytes_used == c.n_layers * 5 * per_layer_position
    prefill(model, _ids(20), cache)
    assert cache.bytes_used == c.n_layers * W * per_layer_position  # never more than W positions
    assert "rolling='layers 0,1 roll (window 8)'" in repr(cache) and "length=25/64" in repr(cache)
    full = _cache(model, rolling=False, max_seq_len=64)
    assert full.bytes_capacity == c.n_layers * 64 * per_layer_position and "rolling" not in repr(full)


def test_rolling_keys_are_the_last_window_in_position_order(pair):
    _, model = pair
    ids = _ids(21)
    full, rolling = _cache(model, rolling=False), _cache(model, rolling=True)
    prefill(model, ids[:, :13], full)
    prefill(model, ids[:, :13], rolling)
    for i in range(13, 21):
        decode_step(model, ids[:, i], full)
        decode_step(model, ids[:, i], rolling)
    # Layer 0's K/V come from the embeddings alone: equal to the bit. Layer 1's went through
    # attention over the keys in slot order: equal up to float rounding.
    for layer, atol in ((0, 0.0), (1, 1e-6)):
        assert torch.allclose(rolling.keys(layer), full.keys(layer)[:, :, -W:], rtol=0, atol=atol)
        assert torch.allclose(rolling.values(layer), full.values(layer)[:, :, -W:], rtol=0, atol=atol)


def test_rolling_truncate_refuses_what_it_no_longer_holds(pair):
    _, model = pair
    cache = _cache(model, rolling=True)
    prefill(model, _ids(W - 2), cache)
    cache.truncate(3)  # nothing overwritten yet: allowed
    prefill(model, _ids(W + 4), cache)
    with pytest.raises(ValueError, match=r"rolling layers hold only positions 7\.\.14 \(window 8\).*rolling=False"):
        cache.truncate(14)
    cache.truncate(0)
    assert cache.length == 0


def test_a_full_cache_truncates_and_decodes_on(pair):
    """Speculative decoding's and chat's truncate keeps working with the default cache."""
    _, model = pair
    ids = _ids(30)
    with torch.no_grad():
        reference = model(ids)
    cache = _cache(model, rolling=False)
    prefill(model, ids[:, :25], cache)
    cache.truncate(20)
    got = prefill(model, ids[:, 20:30], cache)
    assert (got - reference[:, 29]).abs().max().item() <= TOL


def test_prefix_cache_refuses_a_rolling_cache(pair):
    _, model = pair
    rolling = _cache(model, rolling=True)
    prefill(model, _ids(20), rolling)
    with pytest.raises(ValueError, match="rolling buffers; build it with KVCache.for_model\\(model, rolling=False\\)"):
        PrefixCache(model, block_size=4).insert(model, _ids(20)[0].tolist(), rolling)


def test_serving_engine_masks_the_window(pair):
    """The paged engine (blocks of 4, chunks of at most 8 tokens, decodes batched) gives each
    request the greedy tokens generate gives it alone, which equal transformers' (above)."""
    from minillm import LLMEngine

    _, model = pair
    model.attn_impl = "sdpa"
    prompts = [_ids(n, seed=n)[0].tolist() for n in (3, W + 1, 2 * W + 1, 30)]
    params = SamplingParams(max_new_tokens=12)
    alone = [[s.token_id for s in generate(model, p, params, eos_token_ids=())] for p in prompts]
    engine = LLMEngine(model, block_size=4, num_blocks=64, max_num_batched_tokens=8, eos_token_ids=())
    outputs = sorted(engine.generate(prompts, params), key=lambda out: int(out.request_id))
    assert [out.token_ids for out in outputs] == alone


# -- what is counted: K/V read is min(W, context) per layer --------------------------------


@pytest.mark.parametrize("context", [3, W, W + 1, 100])
def test_decode_kv_read_is_min_of_window_and_context(pair, context):
    _, model = pair
    c = model.config
    per_token = kv_bytes_per_token(c, 4)  # all layers
    cost = decode_cost(c, context, 4)
    assert cost.kv_read_bytes == per_token * min(W, context)
    assert cost.kv_written_bytes == per_token


def test_prefill_kv_read_counts_the_band(pair):
    """A chunk of 10 after 30 cached: its first query sees from position 30 - 7 on: 17 positions;
    each of its queries sees W keys (80 pairs a layer), against 1 + 2 + ... + 8 + 8 + 8 = 52 from empty."""
    _, model = pair
    c = model.config
    assert prefill_cost(c, 10, 4, cached_tokens=30).kv_read_bytes == kv_bytes_per_token(c, 4) * (10 + W - 1)
    per_pair = 4 * c.n_heads * c.head_dim * c.n_layers  # q·k and pattern·v, every layer
    extra = prefill_cost(c, 10, 4, cached_tokens=30).flops - prefill_cost(c, 10, 4, cached_tokens=0).flops
    assert extra == per_pair * (80 - 52)


def test_trace_counts_the_window(pair):
    _, model = pair
    trace = Trace()
    cache = _cache(model, rolling=True)
    prefill(model, _ids(20), cache, trace=trace)
    decode_step(model, 5, cache, trace=trace)
    decode = trace.events[-1]
    assert decode["kind"] == "decode" and decode["kv_read_bytes"] == kv_bytes_per_token(model.config, 4) * W
    assert decode["kv_bytes"] == cache.bytes_used == kv_bytes_per_token(model.config, 4) * W


def test_speculative_refuses_a_rolling_cache_before_the_first_token(pair):
    """A rejected draft is truncated away, which a rolling buffer cannot undo: refused up front,
    not at the first rejection (a draft that is always wrong would hit it mid-answer)."""
    from minillm.speculative import Draft, SpeculativeConfig

    class AlwaysWrong(Draft):
        def propose(self, token_ids, k):
            return [7] * k

    _, model = pair
    steps = generate(model, _ids(20)[0], SamplingParams(max_new_tokens=8, temperature=0), cache=_cache(model, True),
                     speculative=SpeculativeConfig("custom", 3, draft=AlwaysWrong()))
    with pytest.raises(ValueError, match=r"rolling buffers.*KVCache.for_model\(model, rolling=False\)"):
        next(steps)


@pytest.mark.compile
def test_compiled_decode_refuses_a_window(pair):
    """The static view of torch.compile'd decode masks causally only: refused, not wrong."""
    from minillm.fast.compile import compile_decode_step

    _, model = pair
    with pytest.raises(ValueError, match="compile_decode_step does not support sliding-window attention"):
        compile_decode_step()(model, 1, _cache(model, rolling=False))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_window_on_some_layers_only(pair, impl):
    """Per-layer windows (Qwen2's max_window_layers will need them): layer 1 windowed, layer 0 full.
    A rolling cache then holds layer 0 in k/v and layer 1 in k_roll/v_roll; cached decode equals the
    no-cache forward (which differs from windowing both layers)."""
    from dataclasses import replace

    from minillm.model import Transformer

    _, windowed = pair
    mixed = Transformer(replace(windowed.config, sliding_window_layers=(1,)), attn_impl=impl)
    mixed.load_state_dict(windowed.state_dict(), strict=False)
    ids = _ids(3 * W)
    with torch.no_grad():
        reference = mixed(ids)
        assert (reference - windowed(ids)).abs().max().item() > 1e-3
    cache = _cache(mixed, rolling=True)
    assert cache.rolling_layers == (1,) and cache.k.shape[0] == 1 and cache.k_roll.shape[0] == 1
    logits = [prefill(mixed, ids[:, : W + 3], cache)]
    logits += [decode_step(mixed, ids[:, i], cache) for i in range(W + 3, 3 * W)]
    assert (torch.stack(logits, dim=1) - reference[:, W + 2 :]).abs().max().item() <= TOL


def test_gguf_export_refuses_a_window(pair, tmp_path):
    """llama.cpp's llama architecture would attend to every position: refused, not written wrong."""
    from minillm.formats.gguf_export import write_f32_gguf

    _, model = pair
    with pytest.raises(ValueError, match=r"a sliding window \(W=8\) is not written to GGUF here"):
        write_f32_gguf(model, tmp_path / "unused.gguf", tmp_path / "out.gguf")


def test_the_compile_decode_path_falls_back_to_the_eager_step(pair):
    """On the "compile" decode paths (minillm/fast/choose.py) a window model decodes eagerly, not refused."""
    from minillm.fast.compile import CompiledDecodeStep

    class NeverRun:
        applies = CompiledDecodeStep.applies  # the real check: a window shorter than the cache is beyond it

        def __call__(self, *args):
            raise AssertionError("the static view was used for a window model")

    _, model = pair
    ids = _ids(W + 4)
    with torch.no_grad():
        reference = model(ids)
    before = getattr(model, "compiled_decode", None)
    model.compiled_decode = NeverRun()
    try:
        cache = _cache(model, rolling=False)
        prefill(model, ids[:, : W + 3], cache)
        got = decode_step(model, ids[:, W + 3], cache)
    finally:
        model.compiled_decode = before
    assert (got - reference[:, -1]).abs().max().item() <= TOL
