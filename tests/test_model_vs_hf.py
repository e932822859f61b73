"""minillm's logits and greedy tokens against Hugging Face transformers on the same weights.

Both ways a model runs are checked against transformers: the lesson's plain modules
(``load_model(..., fast=False)``) and the speed layer's (``fast=True``, the tests' decode path,
tests/conftest.py; the C path too). The speed layer must also give the plain modules' logits
within float32 rounding, on every tiny config, float or quantised. All of it in float32: bfloat16 and
float16, module by module and the real model's logits, are tests/test_dtypes_vs_hf.py's.
"""

import json
from importlib import resources

import pytest
import torch
from tiny_models import CONFIGS, GPT2_124M, build_hf, save_hf

import minillm
from minillm import KVCache, SamplingParams, decode_step, generate, load_model, prefill
from minillm.fast import kernels
from minillm.fast.choose import apply_decode_path
from minillm.loading import to_minillm_names
from minillm.model import Transformer
from minillm.whatif import example_configs, load_config

pytest.importorskip("transformers")

TOL = 1e-4
FAST_TOL = 1e-5  # the speed layer against the plain modules, float32: the same sums in another order
FAST = pytest.mark.parametrize("fast", [False, True], ids=["pure", "fast"])


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(hf_model, folder): a tiny random transformers model and its saved checkpoint, one per config."""
    family, kwargs = CONFIGS[request.param]
    hf = build_hf(family, kwargs)
    return hf, save_hf(hf, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module", params=[False, True], ids=["pure", "fast"])
def pair(request, checkpoint):
    """(hf_model, minillm_model) with identical weights, per config, on the plain modules and on the fast ones."""
    hf, folder = checkpoint
    return hf, load_model(folder, device="cpu", dtype="float32", fast=request.param)


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


@pytest.mark.large
def test_gpt2_124m_shape_matches_transformers(tmp_path):
    hf = build_hf(*GPT2_124M)
    folder = save_hf(hf, tmp_path)
    ids = _ids(50257, (1, 24))
    with torch.no_grad():
        expected = hf(ids).logits
    for fast in (False, True):
        model = load_model(folder, device="cpu", dtype="float32", fast=fast)
        assert model.num_parameters() == sum(p.numel() for p in hf.parameters())
        with torch.no_grad():
            assert (model(ids) - expected).abs().max().item() <= TOL, f"fast={fast}"
        del model


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


@pytest.mark.large
@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-0.6b"])
def test_real_shape_one_layer_matches_transformers(name, tmp_path):
    """Qwen2.5-0.5B's and Qwen3-0.6B's real widths, heads, head_dim and 151,936-token vocabulary,
    one layer of random weights: logits, and the KV cache's prefill + decode, as transformers'."""
    fields = _shipped_hf_fields(name)
    hf = build_hf(fields.pop("model_type"), dict(fields, num_hidden_layers=1))
    folder = save_hf(hf, tmp_path)
    for fast in (False, True):
        model = load_model(folder, device="cpu", dtype="float32", fast=fast)
        ids = _ids(model.config.vocab_size, (1, 12))
        with torch.no_grad():
            expected = hf(ids).logits
            assert (model(ids) - expected).abs().max().item() <= TOL, f"fast={fast}"
        cache = KVCache.for_model(model, max_seq_len=12)
        prefill(model, ids[:, :11], cache)
        assert (decode_step(model, ids[:, 11], cache) - expected[:, 11]).abs().max().item() <= TOL, f"fast={fast}"
        del model, cache


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


def _prefill_then_decode(model, ids, n_prefill):
    """Prefill's logits for ids[:, :n_prefill], then a decode step's for each later token but the
    last (teacher-forced): [B, T - n_prefill, vocab], predicting positions n_prefill..T-1."""
    cache = KVCache.for_model(model, batch_size=ids.shape[0], max_seq_len=ids.shape[1])
    logits = [prefill(model, ids[:, :n_prefill], cache)]
    logits += [decode_step(model, ids[:, i], cache) for i in range(n_prefill, ids.shape[1] - 1)]
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("path, batch", [("matvec", 2), ("replay", 1), ("long-rows", 2)])
def test_decode_on_each_path_matches_transformers(checkpoint, path, batch):
    """"matvec" (decode's products and attention in C, minillm/fast/kernels.py; head_dim 24 configs keep SDPA),
    "replay" (the rule's path where a C compiler is: one sequence's step replays those C calls,
    minillm/fast/replay.py) and "long-rows" (F.linear on transposed weights) against transformers' full forward."""
    if path != "long-rows" and not kernels.available():
        pytest.skip("needs the C kernels")
    hf, folder = checkpoint
    model = apply_decode_path(load_model(folder, device="cpu", fast=False), path)
    ids = _ids(model.config.vocab_size, (batch, 15))
    with torch.no_grad():
        expected = hf(ids).logits[:, 9:14]
    assert (_prefill_then_decode(model, ids, 10) - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("path", ["matvec", "long-rows+split", "row-major"])
@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_the_fast_paths_logits_are_the_pure_models(checkpoint, path, quantize):
    """Prefill and decode steps (batch 2) on a decode path's modules against the same weights on the
    plain modules (quantised: the C kernels against dequantise-then-F.linear), within float32 rounding."""
    _, folder = checkpoint
    pure = load_model(folder, device="cpu", fast=False, quantize=quantize)
    fast = apply_decode_path(load_model(folder, device="cpu", fast=False, quantize=quantize), path)
    ids = _ids(pure.config.vocab_size, (2, 14), seed=2)
    expected = _prefill_then_decode(pure, ids, 9)
    got = _prefill_then_decode(fast, ids, 9)
    assert got.shape == expected.shape == (2, 5, pure.config.vocab_size)
    torch.testing.assert_close(got, expected, atol=FAST_TOL, rtol=0)
    with torch.no_grad():  # the full forward too (no cache, all positions)
        torch.testing.assert_close(fast(ids), pure(ids), atol=FAST_TOL, rtol=0)


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
