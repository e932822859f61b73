"""KVCache arithmetic and errors, config parsing, weight-loading errors, sampling rules."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import (
    CacheFullError, ConfigError, KVCache, ModelConfig, SamplingParams, WeightsError, decode_step, generate,
    load_model, prefill, sample,
)
from minillm.sampling import filter_logits


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    return save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def model(llama_dir):
    return load_model(llama_dir, device="cpu")


# -- KV cache --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, nbytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_kv_bytes_follow_the_formula(dtype, nbytes):
    cache = KVCache(n_layers=3, batch_size=2, n_kv_heads=4, max_seq_len=10, head_dim=8, dtype=dtype)
    per_token = 2 * 3 * 4 * 8 * nbytes
    assert cache.bytes_per_token == per_token
    assert cache.bytes_capacity == per_token * 2 * 10
    cache.advance(7)
    assert cache.bytes_used == per_token * 2 * 7
    assert cache.k.shape == (3, 2, 4, 10, 8)
    assert "length=7/10" in repr(cache) and "KVCache" in cache._repr_html_()


def test_cache_for_model_uses_model_shape(model):
    cache = KVCache.for_model(model, batch_size=2, max_seq_len=50)
    c = model.config
    assert cache.k.shape == (c.n_layers, 2, c.n_kv_heads, 50, c.head_dim)
    assert cache.bytes_per_token == c.kv_bytes_per_token(4)
    with pytest.raises(ValueError, match="max_seq_len"):
        KVCache.for_model(model, max_seq_len=c.max_seq_len + 1)


def test_prefill_writes_exactly_the_prompt_positions(model):
    cache = KVCache.for_model(model, max_seq_len=16)
    prefill(model, [1, 2, 3, 4, 5], cache)
    assert cache.length == 5
    assert cache.keys(0).shape == (1, model.config.n_kv_heads, 5, model.config.head_dim)
    assert cache.k[:, :, :, :5].abs().sum() > 0 and cache.k[:, :, :, 5:].abs().sum() == 0
    decode_step(model, 7, cache)
    assert cache.length == 6


def test_full_cache_raises_and_keeps_its_state(model):
    cache = KVCache.for_model(model, max_seq_len=6)
    prefill(model, [1, 2, 3, 4, 5, 6], cache)
    with pytest.raises(CacheFullError, match="KV cache full"):
        decode_step(model, 1, cache)
    assert cache.length == 6
    with pytest.raises(CacheFullError):
        prefill(model, list(range(7)), KVCache.for_model(model, max_seq_len=6))


def test_generate_stops_at_a_full_cache(model):
    cache = KVCache.for_model(model, max_seq_len=8)
    steps = list(generate(model, [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=20), cache=cache, eos_token_ids=()))
    assert len(steps) == 4 and steps[-1].finish_reason == "cache_full"
    assert cache.length == 8


def test_truncate_and_reset(model):
    cache = KVCache.for_model(model, max_seq_len=16)
    prefill(model, [1, 2, 3, 4], cache)
    cache.truncate(2)
    assert cache.length == 2
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="truncate"):
            cache.truncate(bad)
    cache.reset()
    assert cache.length == 0


@pytest.mark.parametrize(
    "ids, match",
    [([], "empty"), ([1, 10_000], "vocabulary"), ([[[1]]], "dimensions"), ([1.5, 2.0], "integer")],
)
def test_bad_prompts_raise_one_clear_error(model, ids, match):
    with pytest.raises(ValueError, match=match):
        prefill(model, ids, KVCache.for_model(model, max_seq_len=8))


# -- config ----------------------------------------------------------------------------


def test_hub_and_transformers5_rope_spellings_agree():
    base = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                intermediate_size=128, vocab_size=10, max_position_embeddings=128)
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    hub = ModelConfig.from_hf(dict(base, rope_theta=5e5, rope_scaling=dict(scaling, rope_type="llama3")))
    v5 = ModelConfig.from_hf(dict(base, rope_parameters=dict(scaling, rope_type="llama3", rope_theta=5e5)))
    assert hub == v5 and hub.rope_theta == 5e5 and hub.rope_scaling.factor == 8.0


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "bert"}, "model_type 'bert' is not supported; supported: gpt2, llama, mistral"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling type 'longrope'"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling of type 'yarn' needs a factor"),
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ],
)
def test_bad_config_names_the_field(llama_dir, tmp_path, change, match):
    hf = json.loads((llama_dir / "config.json").read_text())
    hf.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**hf, **change}))
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_json(tmp_path)


def test_config_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        ModelConfig.from_json(tmp_path)


def test_missing_config_field_is_named():
    with pytest.raises(ConfigError, match="missing field 'hidden_size'"):
        ModelConfig.from_hf({"model_type": "llama"})


# -- weight loading errors --------------------------------------------------------------


def _copy_with(llama_dir, tmp_path, edit):
    tensors = load_file(llama_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    return tmp_path


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"missing tensors: blocks\.1\.mlp\.up_proj\.weight"),
        (lambda t: t.update(extra=torch.zeros(2)), "unexpected tensors: extra"),
        (lambda t: t.update({"model.norm.weight": torch.ones(3)}), r"wrong shape tensors: ln_final\.weight \(3,\)"),
    ],
)
def test_bad_checkpoints_list_the_tensors(llama_dir, tmp_path, edit, match):
    with pytest.raises(WeightsError, match=match):
        load_model(_copy_with(llama_dir, tmp_path, edit), device="cpu")


def test_truncated_safetensors_is_named(llama_dir, tmp_path):
    data = (llama_dir / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(WeightsError, match="cannot read .*model.safetensors"):
        load_model(tmp_path, device="cpu")


def test_prompt_longer_than_the_context_says_so(model):
    too_long = [1] * (model.config.max_seq_len + 1)
    with pytest.raises(CacheFullError, match="the prompt is 129 tokens but the model's context is 128"):
        next(generate(model, too_long))


def test_no_parameter_is_left_uninitialised(model):
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_stays_close(llama_dir, dtype):
    ref = load_model(llama_dir, device="cpu")
    half = load_model(llama_dir, device="cpu", dtype=dtype)
    assert next(half.parameters()).dtype == getattr(torch, dtype)
    ids = torch.arange(10)[None]
    assert (half(ids).float() - ref(ids)).abs().max() < 0.05


def test_bad_dtype_and_device(llama_dir):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(llama_dir, dtype="int8")
    for bad in ("tpu", ""):
        with pytest.raises(ValueError, match="device must be cpu, cuda, cuda:N or mps"):
            load_model(llama_dir, device=bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda' is not available"):
            load_model(llama_dir, device="cuda")


# -- sampling ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
        ({"seed": "abc"}, r"seed must be an integer in \[0, 2\*\*63\)"),
        ({"seed": 2**70}, r"seed must be an integer in \[0, 2\*\*63\)"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be an integer >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def _kept(params):
    return (filter_logits(PROBS.log(), params) > float("-inf")).squeeze(0).tolist()


@pytest.mark.parametrize(
    "params, kept",
    [
        (SamplingParams(temperature=1.0, top_k=2), [True, True, False, False]),
        (SamplingParams(temperature=1.0, top_p=0.5), [True, False, False, False]),  # 0.5 reached by token 0
        (SamplingParams(temperature=1.0, top_p=0.6), [True, True, False, False]),  # token 1 crosses 0.6: kept
        (SamplingParams(temperature=1.0, top_p=0.9), [True, True, True, False]),
        (SamplingParams(temperature=1.0, top_p=0.1), [True, False, False, False]),  # top token always kept
    ],
)
def test_top_k_and_top_p_keep_the_hand_computed_sets(params, kept):
    assert _kept(params) == kept


def test_temperature_scales_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    filtered = filter_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(torch.softmax(filtered, -1), torch.softmax(logits * 2, -1))


def test_greedy_is_argmax_and_logprob_is_the_models():
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]])
    tokens, logprobs = sample(logits, SamplingParams())
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_sampling_frequencies_follow_the_filtered_distribution():
    logits = PROBS.log().expand(20000, -1)
    params = SamplingParams(temperature=1.0, top_p=0.6, seed=0)
    tokens, _ = sample(logits, params, params.make_generator("cpu"))
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015)


def test_same_seed_same_output(model):
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=123, max_new_tokens=12)
    runs = [[s.token_id for s in generate(model, [1, 2, 3], params, eos_token_ids=())] for _ in range(2)]
    other = [s.token_id for s in generate(model, [1, 2, 3], SamplingParams(**{**params.__dict__, "seed": 7}),
                                          eos_token_ids=())]
    assert runs[0] == runs[1] and runs[0] != other


def test_stop_ids_and_eos_end_generation(model):
    greedy = [s.token_id for s in generate(model, [1, 2, 3], SamplingParams(max_new_tokens=8), eos_token_ids=())]
    first_new = next(i for i, t in enumerate(greedy) if t != greedy[0])  # a token not produced before
    stop = list(generate(model, [1, 2, 3], SamplingParams(max_new_tokens=8, stop_token_ids=[greedy[first_new]]),
                         eos_token_ids=()))
    assert [s.token_id for s in stop] == greedy[: first_new + 1] and stop[-1].finish_reason == "stop"
    eos = list(generate(model, [1, 2, 3], SamplingParams(max_new_tokens=5), eos_token_ids=[greedy[0]]))
    assert len(eos) == 1 and eos[0].finish_reason == "eos"
