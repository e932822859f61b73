"""Hypothesis strategies for the cost exercises (ex10, ex12): model configs over their whole domain.

Head counts with GQA and MQA, an explicit head_dim, GPT-2's and Llama's layers, Qwen3's QK-norm,
sliding windows on every layer (Mistral) or on some (Qwen's ``sliding_window_layers``), and the
real configs minillm ships (Mistral-7B has a 4096-token window).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from importlib.resources import files

from hypothesis import strategies as st

from minillm import ModelConfig


class ShownConfig(ModelConfig):
    """A ModelConfig whose repr names what the costs depend on (a failure message shows it)."""

    name = ""

    def __repr__(self) -> str:
        return describe(self)


# the configs minillm ships (minillm/configs), drawn by the exercises' differential checks
SHIPPED_NAMES = ["llama-3-8b", "llama-2-7b", "mistral-7b", "qwen3-0.6b", "smollm2-135m-instruct", "gpt2-124m"]


@lru_cache(maxsize=None)
def shipped(name: str) -> ModelConfig:
    """A config of minillm/configs (llama-3-8b, mistral-7b, qwen3-0.6b, gpt2-124m, ...)."""
    c = ModelConfig.from_json(files("minillm") / "configs" / f"{name}.json")
    shown = ShownConfig(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})
    object.__setattr__(shown, "name", name)
    return shown


@st.composite
def small_configs(draw) -> ModelConfig:
    family = draw(st.sampled_from(["llama", "qwen3", "llama", "gpt2"]), label="model_type")
    n_layers = draw(st.integers(1, 4), label="n_layers")
    n_kv_heads = draw(st.integers(1, 4), label="n_kv_heads")
    n_heads = n_kv_heads * draw(st.sampled_from([1, 2, 4]), label="n_heads / n_kv_heads")
    head_dim = draw(st.sampled_from([8, 16, 24, 64]), label="head_dim")
    d_model = draw(st.sampled_from([32, 48, 64]), label="d_model")
    window, window_layers = None, None
    which = "none" if family == "gpt2" else draw(st.sampled_from(["some layers", "every layer", "none", "some layers"]),
                                                  label="sliding window")
    if which != "none":
        window = draw(st.integers(1, 48), label="sliding_window")
        if which == "some layers":
            window_layers = tuple(sorted(draw(st.sets(st.integers(0, n_layers - 1), max_size=n_layers),
                                              label="sliding_window_layers")))
    gpt2 = family == "gpt2"
    return ShownConfig(
        model_type=family, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
        head_dim=head_dim, d_mlp=draw(st.sampled_from([64, 96]), label="d_mlp"), vocab_size=128, max_seq_len=4096,
        norm_eps=1e-5, activation="gelu_tanh" if gpt2 else "silu",
        tie_word_embeddings=draw(st.booleans(), label="tied"), qkv_bias=gpt2, o_bias=gpt2, mlp_bias=gpt2,
        rope_theta=None if gpt2 else 10000.0, qk_norm=family == "qwen3", sliding_window=window,
        sliding_window_layers=window_layers)


def configs() -> st.SearchStrategy[ModelConfig]:
    """Small random configs, and the shipped ones (Mistral-7B's window, Llama-3's GQA, GPT-2, Qwen3)."""
    return st.one_of(small_configs(), small_configs(),
                     st.sampled_from(["mistral-7b", "llama-3-8b", "qwen3-0.6b", "gpt2-124m"]).map(shipped))


def describe(config: ModelConfig) -> str:
    c = config
    window = "" if c.sliding_window is None else (
        f", sliding_window={c.sliding_window}" + ("" if c.sliding_window_layers is None
                                                  else f" on layers {list(c.sliding_window_layers)}"))
    name = getattr(c, "name", "") or c.model_type
    return (f"{name}: {c.n_layers} layers, {c.n_heads} heads, {c.n_kv_heads} KV heads, head_dim "
            f"{c.head_dim}, d_model {c.d_model}{window}")
