"""Every config.json field that changes the computation: computed like transformers, or refused by name.

The table walks transformers' GPT2Config, LlamaConfig, MistralConfig, Qwen2Config and Qwen3Config (and fields of other
families that turn up in Llama-type configs). A "match" row builds a random-weight transformers
model with that field set and compares its logits with minillm's on the same weights; a
"refuse" row writes the field into config.json and expects a one-line ConfigError naming it.
Fields with no effect in eval mode (dropouts, initializer_range, use_cache, summary_*) need no row.
"""

import json

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import ModelConfig, load_model
from minillm.errors import ConfigError

pytest.importorskip("transformers")

TOL = 1e-4
GPT2 = CONFIGS["gpt2"][1]
LLAMA = CONFIGS["llama_gqa"][1]
MISTRAL = CONFIGS["mistral"][1]
QWEN2, QWEN3 = CONFIGS["qwen2"][1], CONFIGS["qwen3"][1]

# (family, base kwargs, the field(s) set): transformers computes something different from the
# base config, and minillm must compute the same.
MATCH = {
    "gpt2 scale_attn_by_inverse_layer_idx": ("gpt2", GPT2, {"scale_attn_by_inverse_layer_idx": True}),
    "gpt2 scale_attn_weights off": ("gpt2", GPT2, {"scale_attn_weights": False}),
    "gpt2 both scale flags": ("gpt2", GPT2, {"scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True}),
    "gpt2 reorder_and_upcast_attn": ("gpt2", GPT2, {"reorder_and_upcast_attn": True}),
    "gpt2 activation gelu": ("gpt2", GPT2, {"activation_function": "gelu"}),
    "gpt2 activation relu": ("gpt2", GPT2, {"activation_function": "relu"}),
    "gpt2 activation gelu_pytorch_tanh": ("gpt2", GPT2, {"activation_function": "gelu_pytorch_tanh"}),
    "gpt2 n_inner": ("gpt2", GPT2, {"n_inner": 96}),
    "gpt2 untied": ("gpt2", GPT2, {"tie_word_embeddings": False}),
    "gpt2 layer_norm_epsilon": ("gpt2", GPT2, {"layer_norm_epsilon": 1e-2}),
    "qwen2 rms_norm_eps": ("qwen2", QWEN2, {"rms_norm_eps": 1e-2}),
    "qwen2 rope_theta": ("qwen2", QWEN2, {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    "qwen2 window fields without use_sliding_window": ("qwen2", QWEN2, {"sliding_window": 4, "max_window_layers": 0}),
    "qwen2 use_sliding_window (layers from max_window_layers on)": (
        "qwen2", QWEN2, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen2 use_sliding_window (layer_types)": (
        "qwen2", QWEN2, {"use_sliding_window": True, "sliding_window": 8,
                         "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen3 use_sliding_window (every layer)": (
        "qwen3", QWEN3, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    "qwen3 attention_bias": ("qwen3", QWEN3, {"attention_bias": True}),
    "qwen3 rms_norm_eps (also QK-norm's)": ("qwen3", QWEN3, {"rms_norm_eps": 1e-1}),
    "llama attention_bias": ("llama", LLAMA, {"attention_bias": True}),
    "llama mlp_bias": ("llama", LLAMA, {"mlp_bias": True}),
    "llama pretraining_tp": ("llama", LLAMA, {"pretraining_tp": 2}),
    "llama hidden_act swish": ("llama", LLAMA, {"hidden_act": "swish"}),
    "llama rms_norm_eps": ("llama", LLAMA, {"rms_norm_eps": 1e-2}),
    "llama tied": ("llama", LLAMA, {"tie_word_embeddings": True}),
    "llama head_dim": ("llama", LLAMA, {"head_dim": 8}),
    "llama rope_theta": ("llama", LLAMA, {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
    "llama rope linear": ("llama", LLAMA, {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                               "factor": 4.0}}),
    "llama rope yarn": ("llama", LLAMA, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                             "original_max_position_embeddings": 32}}),
    "llama rope dynamic": ("llama", LLAMA, {"max_position_embeddings": 32, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}),  # 40 positions: past the 32 it grows from
    "mistral sliding_window": ("mistral", MISTRAL, {"sliding_window": 64}),
    "mistral sliding_window 8": ("mistral", MISTRAL, {"sliding_window": 8}),
    "mistral attention_bias (not a Mistral field)": ("mistral", MISTRAL, {"attention_bias": True, "mlp_bias": True}),
}

# (family, the field(s) written into config.json, the name the error must say).
REFUSE = {
    "gpt2 activation quick_gelu": ("gpt2", {"activation_function": "quick_gelu"}, "activation_function 'quick_gelu'"),
    "gpt2 add_cross_attention": ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
    "llama hidden_act gelu": ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    "llama partial_rotary_factor": ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "llama partial_rotary_factor in rope_parameters": (
        "llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        "partial_rotary_factor"),
    "llama rope longrope": ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
    "llama attn_logit_softcapping": ("llama", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    "llama final_logit_softcapping": ("llama", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    "llama query_pre_attn_scalar": ("llama", {"query_pre_attn_scalar": 16}, "query_pre_attn_scalar"),
    "llama logits_scaling": ("llama", {"logits_scaling": 8.0}, "logits_scaling"),
    "qwen2 layer_types not a layer each": ("qwen2", {"use_sliding_window": True, "sliding_window": 8,
                                                     "layer_types": ["sliding_attention"]}, "layer_types must list"),
    "qwen2 hidden_act gelu": ("qwen2", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    "qwen3 partial_rotary_factor": ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "qwen3 rope longrope": ("qwen3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
}


# Rows whose field changes nothing in transformers' float32 eval-mode logits (rounding, no-op fields),
# or only names what the checkpoint's tensors already show (their shapes).
SAME_AS_BASE = {"gpt2 reorder_and_upcast_attn", "gpt2 activation gelu_pytorch_tanh", "llama pretraining_tp",
                "llama hidden_act swish", "llama tied", "qwen2 window fields without use_sliding_window",
                "mistral attention_bias (not a Mistral field)", "mistral sliding_window"}
AMPLIFY = 4  # the random matrices ×4: peaky attention, so a wrong scale moves the logits by ~0.2, not ~0.004


def _build(family: str, kwargs: dict):
    hf = build_hf(family, kwargs)
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                p.mul_(AMPLIFY)
    return hf


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("case", sorted(MATCH))
def test_field_matches_transformers(case, tmp_path):
    family, base, change = MATCH[case]
    kwargs = {**base, **change}
    hf = _build(family, kwargs)
    ids = torch.randint(0, kwargs["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    expected = _logits(hf, ids)
    model = load_model(save_hf(hf, tmp_path), device="cpu", dtype="float32")
    for impl in ("eager", "sdpa"):
        model.attn_impl = impl
        with torch.no_grad():
            assert (model(ids) - expected).abs().max().item() <= TOL, impl
    # The row can fail: with the field left at its default, the same weights give other logits.
    # (Rows that change tensor shapes or names cannot be ignored silently: the loader's check fails.)
    without = build_hf(family, base)
    if case not in SAME_AS_BASE and without.state_dict().keys() == hf.state_dict().keys():
        if all(without.state_dict()[k].shape == t.shape for k, t in hf.state_dict().items()):
            without.load_state_dict(hf.state_dict())
            assert (_logits(without, ids) - expected).abs().max().item() > 5 * TOL  # e.g. exact vs tanh GELU: 9e-4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saved base checkpoint per family, whose config.json the refuse rows edit."""
    return {
        family: save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp(family))
        for family, kwargs in (("gpt2", GPT2), ("llama", LLAMA), ("qwen2", QWEN2), ("qwen3", QWEN3))
    }


@pytest.mark.parametrize("case", sorted(REFUSE))
def test_field_is_refused_by_name(case, saved, tmp_path):
    family, change, named = REFUSE[case]
    hf = json.loads((saved[family] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, **change}))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_json(tmp_path)
    assert named in str(info.value) and "\n" not in str(info.value)


# -- types and ranges (issue #12, kind 8) -------------------------------------------------

LLAMA_JSON = dict(LLAMA, model_type="llama")
GPT2_JSON = dict(GPT2, model_type="gpt2")


@pytest.mark.parametrize(
    ("base", "change", "named"),
    [
        (LLAMA_JSON, {"hidden_size": "64"}, "hidden_size must be an integer >= 1, got '64'"),
        (LLAMA_JSON, {"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
        (LLAMA_JSON, {"num_key_value_heads": 0}, "num_key_value_heads must be an integer >= 1"),
        (LLAMA_JSON, {"num_hidden_layers": 2.5}, "num_hidden_layers must be an integer"),
        (LLAMA_JSON, {"intermediate_size": -1}, "intermediate_size must be an integer >= 1"),
        (LLAMA_JSON, {"vocab_size": True}, "vocab_size must be an integer"),
        (LLAMA_JSON, {"num_attention_heads": 3, "num_key_value_heads": 1},
         "hidden_size (64) must be a multiple of num_attention_heads (3)"),
        (LLAMA_JSON, {"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads"),
        (LLAMA_JSON, {"head_dim": 0}, "head_dim must be an integer >= 1"),
        (LLAMA_JSON, {"rms_norm_eps": -1e-5}, "rms_norm_eps must be a positive number"),
        (LLAMA_JSON, {"rope_theta": "big"}, "rope_theta must be a positive number"),
        (LLAMA_JSON, {"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor must be a positive number"),
        (LLAMA_JSON, {"rope_scaling": "linear"}, "rope_scaling must be an object"),
        (LLAMA_JSON, {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                       "high_freq_factor": 4.0}}, "high_freq_factor must be greater"),
        (LLAMA_JSON, {"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        (LLAMA_JSON, {"eos_token_id": [2, "3"]}, "eos_token_id must be a token id"),
        (LLAMA_JSON, {"max_position_embeddings": 0}, "max_position_embeddings must be an integer >= 1"),
        (dict(QWEN2, model_type="qwen2"), {"use_sliding_window": "no"}, "use_sliding_window must be true or false"),
        (dict(QWEN3, model_type="qwen3"), {"attention_bias": 1}, "attention_bias must be true or false"),
        (dict(QWEN3, model_type="qwen3"), {"head_dim": 0}, "head_dim must be an integer >= 1"),
        (dict(QWEN3, model_type="qwen3"), {"head_dim": 31}, "head_dim must be even for RoPE"),
        (LLAMA_JSON, {"hidden_size": 60}, "head_dim must be even for RoPE (it rotates pairs of dimensions), got 15"),
        (GPT2_JSON, {"n_head": 3}, "n_embd (64) must be a multiple of n_head (3)"),
        (GPT2_JSON, {"n_inner": "128"}, "n_inner must be an integer"),
        (GPT2_JSON, {"scale_attn_weights": 1}, "scale_attn_weights must be true or false"),
    ],
)
def test_bad_field_type_or_range_is_one_line(base, change, named):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf({**base, **change})
    assert named in str(info.value) and "\n" not in str(info.value)


def test_null_fields_take_their_defaults():
    """transformers writes null for unset optional fields (head_dim, n_inner, num_key_value_heads)."""
    llama = ModelConfig.from_hf({**LLAMA_JSON, "head_dim": None, "num_key_value_heads": None})
    assert (llama.head_dim, llama.n_kv_heads) == (64 // 4, 4)
    assert ModelConfig.from_hf({**GPT2_JSON, "n_inner": None}).d_mlp == 4 * 64


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_defaults_are_transformers_defaults(family):
    """A config.json with the sizes only: head_dim (Qwen3: 128, not hidden / heads), eps, RoPE base
    and tying as transformers' Qwen2Config / Qwen3Config default them."""
    from transformers import AutoConfig

    sizes = {k: v for k, v in CONFIGS[family][1].items() if k not in ("head_dim", "rms_norm_eps")}
    ours = ModelConfig.from_hf({**sizes, "model_type": family})
    theirs = AutoConfig.for_model(family, **sizes)
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert (ours.head_dim, ours.norm_eps, ours.rope_theta, ours.tie_word_embeddings) == (
        head_dim, theirs.rms_norm_eps, theirs.rope_parameters["rope_theta"], theirs.tie_word_embeddings)
    assert ours.head_dim == (128 if family == "qwen3" else 16)


@pytest.mark.parametrize(("field", "value"), [("n_heads", 0), ("d_model", "64"), ("n_kv_heads", 3),
                                              ("activation", "gelu_new")])
def test_config_built_in_code_is_checked(field, value):
    fields = dict(model_type="llama", n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_mlp=8,
                  vocab_size=8, max_seq_len=16, norm_eps=1e-5, activation="silu", tie_word_embeddings=False,
                  qkv_bias=False, o_bias=False, mlp_bias=False, rope_theta=1e4)
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**fields, field: value})


@pytest.mark.parametrize(("scale_weights", "by_layer", "layer", "expected"),
                         [(True, False, 3, 0.25), (True, True, 3, 0.0625), (False, True, 1, 0.5),
                          (False, False, 5, 1.0)])
def test_attn_scale_formula(scale_weights, by_layer, layer, expected):
    """head_dim 16: 1/√16 = 0.25, divided by layer + 1 with the inverse-layer flag."""
    config = ModelConfig.from_hf({**GPT2_JSON, "scale_attn_weights": scale_weights,
                                  "scale_attn_by_inverse_layer_idx": by_layer})
    assert config.attn_scale(layer) == expected


@pytest.mark.parametrize("index", ["{not json", '{"metadata": {}}', '{"weight_map": {"a.weight": 3}}', "[1]"])
def test_damaged_shard_index_is_one_line(tmp_path, index):
    """A sharded checkpoint's index is read at the same boundary: a damaged one is named, not a KeyError."""
    from minillm.formats import weights
    from minillm.errors import WeightsError

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_JSON))
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(WeightsError, match="model.safetensors.index.json is not a safetensors index") as info:
        load_model(tmp_path, device="cpu")
    assert "\n" not in str(info.value)
    assert not weights.is_complete(tmp_path)  # and a named model with it counts as not downloaded


@pytest.mark.parametrize(("change", "says"), [({"hidden_size": "4096"}, "hidden_size must be an integer"),
                                              ({"num_attention_heads": 0}, "num_attention_heads must be an integer")])
def test_whatif_config_with_bad_field_is_one_line(tmp_path, change, says):
    """``minillm whatif --config FILE`` reads through the same checks."""
    from minillm.whatif import load_config

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_JSON, **change}))
    with pytest.raises(ConfigError, match=says):
        load_config(str(tmp_path / "config.json"))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_per_layer_attention_scale_holds_through_the_kv_cache(impl, tmp_path):
    """Prefill then decode (the sdpa paths with and without a mask) use the same per-layer scale."""
    from minillm import KVCache, decode_step, prefill

    hf = _build("gpt2", {**GPT2, "scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True})
    model = load_model(save_hf(hf, tmp_path), device="cpu", dtype="float32", attn_impl=impl)
    ids = torch.randint(0, GPT2["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(2))
    expected = _logits(hf, ids)[0, 9:]  # what positions 9..15 predict
    cache = KVCache.for_model(model, max_seq_len=16)
    steps = [prefill(model, ids[:, :7], cache), prefill(model, ids[:, 7:10], cache)]  # a suffix: the masked path
    steps += [decode_step(model, ids[:, i], cache) for i in range(10, 16)]
    got = torch.cat([steps[1][:, None], *[s[:, None] for s in steps[2:]]], dim=1)[0]
    assert (got - expected).abs().max().item() <= TOL
