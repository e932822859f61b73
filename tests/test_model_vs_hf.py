"""minillm's logits and greedy tokens against Hugging Face transformers on the same weights."""

import json
from importlib import resources

import pytest
import torch
from tiny_models import CONFIGS, GPT2_124M, build_hf, save_hf

import minillm
from minillm import KVCache, SamplingParams, decode_step, generate, load_model, prefill
from minillm.loading import to_minillm_names
from minillm import model as model_module
from minillm.model import Transformer
from minillm.whatif import example_configs, load_config

pytest.importorskip("transformers")

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(hf_model, minillm_model) with identical weights, one per tiny config."""
    family, kwargs = CONFIGS[request.param]
    hf = build_hf(family, kwargs)
    folder = save_hf(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(folder, device="cpu", dtype="float32")


def _ids(vocab, shape, seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_full_sequence_logits_match_transformers(pair, impl):
    hf, model = pair
    model.attn_impl = impl
    ids = _ids(model.config.vocab_size, (2, 40))
    with torch.no_grad():
        expected = hf(ids).logits
        got = model(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL


def test_gpt2_124m_shape_matches_transformers(tmp_path):
    hf = build_hf(*GPT2_124M)
    model = load_model(save_hf(hf, tmp_path), device="cpu", dtype="float32")
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())
    ids = _ids(50257, (1, 24))
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert diff <= TOL


def _shipped_hf_fields(name: str) -> dict:
    """A shipped example config (minillm/configs/NAME.json) as transformers' config kwargs."""
    hf = json.loads((resources.files("minillm") / "configs" / f"{name}.json").read_text())
    return {k: v for k, v in hf.items() if not k.startswith("_") and k not in ("architectures", "torch_dtype")}


@pytest.mark.parametrize("name", example_configs())
def test_real_config_builds_transformers_shapes(name):
    """Each family at its published shape, on the meta device (no memory): transformers' model
    from the same config.json has, after renaming, exactly minillm's tensor names and shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config, fields = load_config(name), _shipped_hf_fields(name)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
        ours = Transformer(config)
    theirs = {k: tuple(t.shape) for k, t in to_minillm_names(hf.state_dict(), config).items()}
    expected = {k: tuple(t.shape) for k, t in ours.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert theirs == expected
    assert ours.num_parameters() == hf.num_parameters()


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-0.6b"])
def test_real_shape_one_layer_matches_transformers(name, tmp_path):
    """Qwen2.5-0.5B's and Qwen3-0.6B's real widths, heads, head_dim and 151,936-token vocabulary,
    one layer of random weights: logits, and the KV cache's prefill + decode, as transformers'."""
    fields = _shipped_hf_fields(name)
    hf = build_hf(fields.pop("model_type"), dict(fields, num_hidden_layers=1))
    model = load_model(save_hf(hf, tmp_path), device="cpu", dtype="float32")
    ids = _ids(model.config.vocab_size, (1, 12))
    with torch.no_grad():
        expected = hf(ids).logits
        assert (model(ids) - expected).abs().max().item() <= TOL
    cache = KVCache.for_model(model, max_seq_len=12)
    prefill(model, ids[:, :11], cache)
    assert (decode_step(model, ids[:, 11], cache) - expected[:, 11]).abs().max().item() <= TOL


def test_sharded_checkpoint_loads(tmp_path):
    family, kwargs = CONFIGS["llama_gqa"]
    hf = build_hf(family, kwargs)
    folder = save_hf(hf, tmp_path, max_shard_size="50KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    model = load_model(folder, device="cpu")
    ids = _ids(kwargs["vocab_size"], (1, 16))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_then_decode_equals_full_forward(pair, impl, batch):
    """The KV cache changes nothing: cached logits = recomputing everything."""
    _, model = pair
    model.attn_impl = impl
    T, N = 12, 6
    ids = _ids(model.config.vocab_size, (batch, T + N))
    with torch.no_grad():
        reference = model(ids).float()  # [B, T+N, vocab], no cache
    cache = KVCache.for_model(model, batch_size=batch, max_seq_len=T + N)
    step_logits = [prefill(model, ids[:, :T], cache)]
    for i in range(T, T + N - 1):
        step_logits.append(decode_step(model, ids[:, i], cache))
    got = torch.stack(step_logits, dim=1)  # logits predicting positions T..T+N-1
    assert cache.length == T + N - 1
    assert (got - reference[:, T - 1 : T + N - 1]).abs().max().item() <= TOL


def test_decode_on_the_c_kernels_matches_transformers(pair):
    """The "matvec" products: decode's products and attention in C (minillm.matvec_kernels), against
    transformers' full forward. (head_dim 16 and 24 configs: attention stays SDPA, the products C.)"""
    hf, model = pair
    ids = _ids(model.config.vocab_size, (2, 15))
    cache = KVCache.for_model(model, batch_size=2, max_seq_len=15)
    model_module.use_products("matvec")
    try:
        step_logits = [prefill(model, ids[:, :10], cache)]
        step_logits += [decode_step(model, ids[:, i], cache) for i in range(10, 14)]
    finally:
        model_module.use_products("split")
    with torch.no_grad():
        expected = hf(ids).logits[:, 9:14]
    assert (torch.stack(step_logits, dim=1) - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_suffix_prefill_equals_whole_prefill(pair, impl):
    _, model = pair
    model.attn_impl = impl
    ids = _ids(model.config.vocab_size, (1, 30))
    whole = prefill(model, ids, KVCache.for_model(model, max_seq_len=64))
    cache = KVCache.for_model(model, max_seq_len=64)
    prefill(model, ids[:, :17], cache)
    suffix = prefill(model, ids[:, 17:], cache)
    assert cache.length == 30
    assert (whole - suffix).abs().max().item() <= TOL


def test_greedy_generate_matches_transformers(pair):
    hf, model = pair
    prompt = _ids(model.config.vocab_size, (1, 8), seed=3)
    with torch.no_grad():
        hf_out = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    expected = hf_out[0, 8:].tolist()
    steps = list(generate(model, prompt[0], SamplingParams(max_new_tokens=32), eos_token_ids=()))
    assert [s.token_id for s in steps] == expected
    assert [s.phase for s in steps[:2]] == ["prefill", "decode"]
    assert steps[-1].finish_reason == "length"
    assert steps[-1].cache_length == 8 + 31


def test_everything_public_is_importable():
    for name in ("load_model", "KVCache", "prefill", "decode_step", "generate", "SamplingParams", "ModelConfig"):
        assert hasattr(minillm, name)
