"""The fast paged decode attention (minillm/fast/paged_attention.py) against the reference path.

The kernel: random pools with shuffled block tables, lengths that end inside a block, GQA, block sizes
below, at and above the kernel's 32 keys a task, and sliding windows, against the reference's gather
and masked SDPA. The engine: the same requests through the reference batch and the fast one give the
same greedy tokens and the same logits within float32 rounding, on tiny models and SmolLM2-135M; in
bfloat16, within one bfloat16 unit of float64 attention, and the engine's tokens the reference's. A bfloat16
prefill chunk reaches SDPA padded to a few shapes, with float64 attention's values.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minillm.serving.engine as engine_module
from minillm import LLMEngine, SamplingParams
from minillm.fast import kernels
from minillm.fast.attention import prefill_in_bf16, prefill_pays
from minillm.fast.paged_attention import CHUNK_PAD_ROWS, FastPagedBatch
from minillm.model import sdpa_attention
from minillm.serving.model_runner import run_model
from minillm.serving.paged_cache import PagedKVCache

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C kernels need a C compiler")


def reference(q, cache, layer, tables, lens, window):
    """The reference path: gather, mask past each length (and before the window), SDPA."""
    keys, values = cache.gather(layer, tables)
    positions = torch.arange(keys.shape[2])
    mask = positions[None] < lens[:, None]
    if window is not None:
        mask &= positions[None] >= lens[:, None] - window
    return sdpa_attention(q.unsqueeze(2), keys, values, mask[:, None, None]).squeeze(2)


@pytest.mark.parametrize("block_size", [4, 16, 48])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(6, 2, 16), (9, 3, 64), (8, 2, 128), (4, 1, 96), (4, 4, 8),
                                                       (4, 2, 80)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_kernel_equals_gather_and_sdpa(block_size, heads, kv_heads, head_dim, window, portable):
    """Both builds: the native one and the portable one (no -march=native: the scalar exp, no AVX2 sums). With
    AVX-512, head_dim 64 and 128 take the loop built for them, 96 the general one, the rest the 8-lane one."""
    g = torch.Generator().manual_seed(block_size + heads + head_dim)
    num_blocks, max_blocks, layer = 40, 6, 1
    cache = PagedKVCache(2, kv_heads, head_dim, num_blocks, block_size)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    lens = torch.tensor([1, block_size, block_size + 1, max_blocks * block_size, 2 * block_size - 1])
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * max_blocks].reshape(len(lens), max_blocks)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
    got = kernels.paged_decode_attention(q, cache.k[layer], cache.v[layer], tables, first, lens, 0.3,
                                         lib=kernels.kernels(portable))
    want = reference(q * 0.3 * head_dim**0.5, cache, layer, tables, lens, window)  # SDPA scales by 1/√D
    # (each score a float32 sum of head_dim products, in another order than SDPA's, each addition off by up to 2^-24
    # of the running sum: the outputs' difference grows with head_dim, ~3e-8 a term here)
    torch.testing.assert_close(got, want, atol=max(2e-6, 5e-8 * head_dim), rtol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (9, 3, 64, 16), (8, 2, 128, 16), (4, 1, 96, 48), (6, 3, 32, 5), (4, 2, 80, 48), (6, 2, 16, 4)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_bfloat16_kernel_is_float64_attention_rounded_once(heads, kv_heads, head_dim, block_size, window, portable):
    """A bfloat16 pool and q: the kernel's float32 sums rounded to bfloat16 once are within one bfloat16 unit
    (2^-8 of the value) of the attention computed in float64 on the same bfloat16 numbers. Where the CPU has
    AVX512-BF16, head_dim 64 and 128 take the loop built for them, 32 and 96 the general one (pieces of 16 keys
    inside blocks of 48, or whole blocks of 5), 80 and 16 the widening one."""
    g = torch.Generator().manual_seed(heads + head_dim + block_size)
    num_blocks, max_blocks, layer = 40, 6, 1
    cache = PagedKVCache(2, kv_heads, head_dim, num_blocks, block_size, dtype=torch.bfloat16)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    lens = torch.tensor([1, block_size, block_size + 1, max_blocks * block_size, 2 * block_size - 1])
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * max_blocks].reshape(len(lens), max_blocks)
    q = torch.randn(len(lens), heads, head_dim, generator=g).bfloat16()
    first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
    got = kernels.paged_decode_attention(q, cache.k[layer], cache.v[layer], tables, first, lens, 0.3,
                                         lib=kernels.kernels(portable))
    assert got.dtype == torch.bfloat16
    wide = PagedKVCache(2, kv_heads, head_dim, num_blocks, block_size, dtype=torch.float64)
    wide.k.copy_(cache.k)
    wide.v.copy_(cache.v)
    want = reference(q.double() * 0.3 * head_dim**0.5, wide, layer, tables, lens, window)
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_a_first_block_of_masked_keys_gets_no_weight(dtype, block_size, portable):
    """A sequence whose first block's keys all score -inf: they weigh 0 as in float64 attention; the online
    softmax's first step was exp(-inf - -inf), NaN, and every later step kept it (as decode_attention's chunks,
    tests/fast/test_matvec_kernels.py)."""
    g = torch.Generator().manual_seed(block_size)
    cache = PagedKVCache(1, 2, 64, 8, block_size, dtype=dtype)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    tables, lens = torch.tensor([[3, 5, 1]]), torch.tensor([2 * block_size + 7])
    cache.k[0, 3, :, :, 0] = float("-inf")
    q = torch.zeros(1, 4, 64, dtype=dtype)
    q[..., 0] = 1.0  # a key's score is its first element
    got = kernels.paged_decode_attention(q, cache.k[0], cache.v[0], tables, lens * 0, lens, 1.0,
                                         lib=kernels.kernels(portable))
    wide = PagedKVCache(1, 2, 64, 8, block_size, dtype=torch.float64)
    wide.k.copy_(cache.k)
    wide.v.copy_(cache.v)
    want = reference(q.double() * 64**0.5, wide, 0, tables, lens, None)
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-5).all()


def test_kernel_refuses_tables_outside_the_pool():
    cache = PagedKVCache(1, 2, 16, 8, 4)
    q, lens = torch.randn(1, 2, 16), torch.tensor([5])
    with pytest.raises(ValueError, match=r"every block id in \[0, 8\).*block ids 0..8"):  # block 8 of an 8-block pool
        kernels.paged_decode_attention(q, cache.k[0], cache.v[0], torch.tensor([[0, 8]]), lens * 0, lens, 1.0)
    with pytest.raises(ValueError, match=r"last <= max_blocks · block_size.*last \[9\]"):  # 9 positions, 2 blocks of 4
        kernels.paged_decode_attention(q, cache.k[0], cache.v[0], torch.tensor([[0, 1]]), lens * 0, lens + 4, 1.0)


@pytest.mark.parametrize("change, error, message", [
    ("q None", TypeError, "paged_decode_attention takes tensors, got q NoneType"),
    ("scale None", ValueError, "scale must be a Python int or float"),
    ("requires grad", ValueError, "no backward pass"),
    ("int32 tables", ValueError, "block_tables must be int64"),
    ("first == last", ValueError, "0 <= first < last"),
    ("float16", ValueError, "all float32 or all bfloat16"),
    ("head_dim 12", ValueError, "head_dim a multiple of 8"),
    ("too many heads", ValueError, r"heads · head_dim must be at most 65,536"),
])
def test_kernel_names_the_rule_an_input_breaks(change, error, message):
    """One line naming what is wrong (a new user's trial: a grad-requiring q lost its graph silently, and every other
    mistake gave one message listing all the rules, or a ctypes or attribute error)."""
    cache = PagedKVCache(1, 2, 16, 8, 4)
    q, lens, tables, scale = torch.randn(1, 2, 16), torch.tensor([5]), torch.tensor([[0, 1]]), 1.0
    k_pool, v_pool = cache.k[0], cache.v[0]
    if change == "q None":
        q = None
    elif change == "scale None":
        scale = None
    elif change == "requires grad":
        q.requires_grad_()
    elif change == "int32 tables":
        tables = tables.int()
    elif change == "first == last":
        lens = lens * 0
    elif change == "float16":
        q, k_pool, v_pool = q.half(), k_pool.half(), v_pool.half()
    elif change == "head_dim 12":
        q, k_pool, v_pool = q[..., :12], k_pool[..., :12].contiguous(), v_pool[..., :12].contiguous()
    else:
        q, k_pool = torch.randn(1, 512, 256), torch.zeros(8, 4, 2, 256)
        v_pool = k_pool
    with pytest.raises(error, match=message):
        kernels.paged_decode_attention(q, k_pool, v_pool, tables, lens * 0, lens, scale)


def run(model, prompts, paged_batch, monkeypatch, max_new_tokens, **knobs):
    """Greedy tokens and every sampled logits row, with ``model.paged_batch`` set for this run."""
    monkeypatch.setattr(model, "paged_batch", paged_batch, raising=False)
    rows = []

    def recording_run_model(model, cache, scheduled):
        sampling, logits = run_model(model, cache, scheduled)
        rows.append(logits.clone())
        return sampling, logits

    monkeypatch.setattr(engine_module, "run_model", recording_run_model)
    engine = LLMEngine(model, eos_token_ids=(), **knobs)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    monkeypatch.undo()
    return [o.token_ids for o in outputs], torch.cat(rows)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3", "gpt2", "llama_mqa_tied"])
def test_engine_fast_equals_reference_on_tiny_models(tiny_model, monkeypatch, name):
    model = tiny_model(name)
    assert model.paged_batch.func is FastPagedBatch
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 4, 30, 9)]
    knobs = dict(num_blocks=64, block_size=4, max_num_batched_tokens=16)  # chunks beside decodes
    fast_tokens, fast_logits = run(model, prompts, model.paged_batch, monkeypatch, 10, **knobs)
    ref_tokens, ref_logits = run(model, prompts, None, monkeypatch, 10, **knobs)
    assert fast_tokens == ref_tokens
    torch.testing.assert_close(fast_logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_engine_fast_equals_reference_on_smollm2(smollm2, monkeypatch):
    model, _ = smollm2
    assert model.paged_batch is not None and model.paged_batch.func is FastPagedBatch
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 21)]
    knobs = dict(num_blocks=16, max_num_batched_tokens=32)  # the 40-token prompt in two chunks, beside decodes
    fast_tokens, fast_logits = run(model, prompts, model.paged_batch, monkeypatch, 4, **knobs)
    ref_tokens, ref_logits = run(model, prompts, None, monkeypatch, 4, **knobs)
    assert fast_tokens == ref_tokens
    torch.testing.assert_close(fast_logits, ref_logits, atol=1e-3, rtol=1e-4)


def test_engine_fast_equals_reference_in_bfloat16(tmp_path, monkeypatch):
    """A bfloat16 model's serving decodes attend in C over its bfloat16 pool: the same greedy tokens as the
    reference's gather and SDPA, the logits within bfloat16's rounding of them."""
    from tiny_models import CONFIGS, build_hf, save_hf

    import minillm

    family, kwargs = CONFIGS["llama_gqa"]
    model = minillm.load_model(save_hf(build_hf(family, kwargs), tmp_path), device="cpu", dtype=torch.bfloat16)
    assert model.paged_batch.func is FastPagedBatch
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 17, 30)]
    knobs = dict(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    fast_tokens, fast_logits = run(model, prompts, model.paged_batch, monkeypatch, 6, **knobs)
    ref_tokens, ref_logits = run(model, prompts, None, monkeypatch, 6, **knobs)
    assert fast_tokens == ref_tokens
    torch.testing.assert_close(fast_logits.float(), ref_logits.float(), atol=0.05, rtol=2**-7)


def test_no_fast_model_runs_the_reference(tmp_path):
    from tiny_models import CONFIGS, build_hf, save_hf

    import minillm

    family, kwargs = CONFIGS["llama_gqa"]
    folder = save_hf(build_hf(family, kwargs), tmp_path)
    assert getattr(minillm.load_model(folder, device="cpu", fast=False), "paged_batch", None) is None
    assert minillm.load_model(folder, device="cpu").paged_batch.func is FastPagedBatch
    assert minillm.load_model(folder, device="cpu", dtype=torch.float16).paged_batch is None  # no float16 kernel


@pytest.mark.parametrize("c_prefill", [False, True])
@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 150), cached=st.one_of(st.just(0), st.integers(1, 150)), seed=st.integers(0, 2**16))
def test_bfloat16_chunks_reach_sdpa_in_a_few_shapes_with_the_same_values(c_prefill, T, cached, seed):
    """A bfloat16 prefill chunk (a first one, or one after ``cached`` positions) reaches SDPA padded to multiples of
    CHUNK_PAD_ROWS (its per-shape AMX kernels are kept without limit), or as it is where the module's own kernels
    take it (on pairs of bfloat16s: prefill_in_bf16; the C loop, where the model runs it: a chunk that prefill_pays
    for), and its output is float64 attention's over the same bfloat16 numbers: within 2^-6 of the values' largest magnitude (the output is a convex combination of value rows; the flash
    kernel rounds its softmax weights to bfloat16, 2^-8 each relative, and the output once)."""
    g = torch.Generator().manual_seed(seed)
    S = T + cached
    q = torch.randn(1, 9, T, 64, generator=g).bfloat16()
    k, v = torch.randn(1, 3, S, 64, generator=g).bfloat16(), torch.randn(1, 3, S, 64, generator=g).bfloat16()
    shapes = []

    def attention(q, keys, values, mask):
        shapes.append((q.shape[2], keys.shape[2]))
        return sdpa_attention(q, keys, values, mask, 0.125, None)

    batch = FastPagedBatch.__new__(FastPagedBatch)
    batch.c_prefill = c_prefill
    out = batch.attend_chunk(q, k, v, attention, None)
    exact = sdpa_attention(q.double(), k.double(), v.double(), None, 0.125, None)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    if prefill_in_bf16(q, k, v) or (c_prefill and prefill_pays(T, S)):
        assert shapes == [(T, S)]
    else:
        assert all(t % CHUNK_PAD_ROWS == 0 and s % CHUNK_PAD_ROWS == 0 for t, s in shapes)
    assert (out.double() - exact).abs().max() <= 2.0 ** -6 * v.double().abs().max()


@pytest.mark.parametrize("dtype, window", [(torch.float32, None), (torch.bfloat16, 8)])
def test_float32_chunks_and_windows_reach_sdpa_as_they_are(dtype, window):
    """float32 SDPA keeps no per-shape kernels, and a sliding window's band is the reference's to draw."""
    q, k = torch.randn(1, 4, 5, 16).to(dtype), torch.randn(1, 2, 9, 16).to(dtype)
    seen = []
    FastPagedBatch.__new__(FastPagedBatch).attend_chunk(q, k, k, lambda *a: seen.append(a) or a[0], window)
    assert seen[0][0] is q and seen[0][3] is None
