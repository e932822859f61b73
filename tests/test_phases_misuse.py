"""Python API misuse at the KV cache / phase boundary: one ValueError naming the problem,
raised before any work, never an IndexError or a dtype error from inside torch."""

import pytest
import torch

from minillm import KVCache, decode_step, load_model, prefill

from tiny_models import CONFIGS, build_hf, save_hf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]  # 2 layers, 2 KV heads, head_dim 16, vocab 128
    return load_model(save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("m")), device="cpu")


@pytest.mark.parametrize("shape, dtype, message", [
    ((3, 1, 2, 16, 16), torch.float32, "n_layers 3 (the model's: 2)"),
    ((2, 1, 1, 16, 16), torch.float32, "n_kv_heads 1 (the model's: 2)"),
    ((2, 1, 2, 16, 8), torch.float32, "head_dim 8 (the model's: 16)"),
    ((2, 1, 2, 16, 16), torch.float16, "dtype torch.float16 (the model's: torch.float32)"),
    ((1, 1, 4, 16, 8), torch.float32, "n_layers 1 (the model's: 2), n_kv_heads 4 (the model's: 2), head_dim 8"),
])
@pytest.mark.parametrize("phase", ["prefill", "decode_step"])
def test_a_cache_shaped_for_another_model_is_named(model, shape, dtype, message, phase):
    cache = KVCache(*shape, dtype=dtype)
    run = prefill if phase == "prefill" else decode_step
    with pytest.raises(ValueError, match="this KV cache does not fit the model") as e:
        run(model, [5] if phase == "prefill" else 5, cache)
    assert message in str(e.value) and "KVCache.for_model" in str(e.value)
    assert cache.length == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_seq_len=256.0), "max_seq_len must be a positive int, got 256.0"),
    (dict(max_seq_len=0), "max_seq_len must be a positive int, got 0"),
    (dict(max_seq_len=-4), "max_seq_len must be a positive int, got -4"),
    (dict(max_seq_len=129), r"max_seq_len must be in \[1, 128\] \(the model's context\), got 129"),
    (dict(batch_size=2.0), "batch_size must be a positive int, got 2.0"),
    (dict(batch_size=0), "batch_size must be a positive int, got 0"),
    (dict(batch_size=True), "batch_size must be a positive int, got True"),
])
def test_for_model_checks_its_sizes(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCache.for_model(model, **kwargs)


@pytest.mark.parametrize("args, kwargs, message", [
    ((2, 1, 2, 16.0, 16), {}, "max_seq_len must be a positive int, got 16.0"),
    ((0, 1, 2, 16, 16), {}, "n_layers must be a positive int, got 0"),
    ((2, 1, -2, 16, 16), {}, "n_kv_heads must be a positive int, got -2"),
    ((2, 1, 2, 16, 16), dict(dtype="float32"), "dtype must be a floating torch.dtype"),
    ((2, 1, 2, 16, 16), dict(dtype=torch.int64), "dtype must be a floating torch.dtype"),
])
def test_the_constructor_checks_its_shape(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCache(*args, **kwargs)


def test_truncate_takes_an_int(model):
    cache = KVCache.for_model(model, max_seq_len=8)
    prefill(model, [1, 2, 3], cache)
    with pytest.raises(ValueError, match=r"n must be in \[0, 3\]"):
        cache.truncate(1.5)
    cache.truncate(1)
    assert cache.length == 1


@pytest.mark.parametrize("token, message", [
    ([5, 6, 7], "token_id has batch 3 but the KV cache was built for batch 1; decode_step takes one token"),
    (torch.tensor([[5, 6]]), "token_id must have at most 1 dimensions, got shape (1, 2); decode_step takes one"),
    (128, "token_id must be in [0, 128) (the vocabulary), got 128..128"),
    (-1, "token_id must be in [0, 128) (the vocabulary), got -1..-1"),
    ("hi", "token_id must be token ids, got a str; encode text with the tokenizer first"),
    (None, "token_id must be an int, a list of ints or an int tensor"),
])
def test_decode_step_names_a_bad_token(model, token, message):
    cache = KVCache.for_model(model, max_seq_len=8)
    prefill(model, [1, 2], cache)
    with pytest.raises(ValueError) as e:
        decode_step(model, token, cache)
    assert message in str(e.value)
    assert cache.length == 2


@pytest.mark.parametrize("ids, message", [
    ([[1, 2], [3]], "token_ids must be an int, a list of ints or an int tensor"),
    ([1.0, 2.0], "token_ids must hold integer token ids, got dtype torch.float32"),
    ([], "token_ids is empty"),
    ([3, 200], r"token_ids must be in \[0, 128\) \(the vocabulary\), got 3..200"),
])
def test_prefill_names_bad_ids(model, ids, message):
    with pytest.raises(ValueError, match=message):
        prefill(model, ids, KVCache.for_model(model, max_seq_len=8))


@pytest.mark.parametrize("cache, trace, message", [
    (None, None, "cache must be a KVCache, got NoneType"),
    ("cache", None, "cache must be a KVCache, got str"),
    ("ok", True, "trace must be a minillm Trace or None, got bool"),
])
def test_the_cache_and_trace_arguments_are_checked(model, cache, trace, message):
    cache = KVCache.for_model(model, max_seq_len=8) if cache == "ok" else cache
    with pytest.raises(ValueError, match=message):
        prefill(model, [1, 2], cache, trace=trace)


def test_the_prefix_cache_checks_the_cache_before_copying_into_it(model):
    from minillm import PrefixCache, SamplingParams, generate

    prefix_cache = PrefixCache(model, block_size=4)
    list(generate(model, list(range(12)), SamplingParams(max_new_tokens=1), prefix_cache=prefix_cache))
    with pytest.raises(ValueError, match=r"does not fit the model: head_dim 8 \(the model's: 16\)"):
        list(generate(model, list(range(12)), SamplingParams(max_new_tokens=1), cache=KVCache(2, 1, 2, 16, 8),
                      prefix_cache=prefix_cache))
