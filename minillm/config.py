"""ModelConfig: the handful of numbers that define a decoder-only transformer.

Read from a Hugging Face ``config.json``. Two families are supported:

- ``gpt2``: learned position embeddings, LayerNorm, GELU(tanh) MLP, biases everywhere.
- ``llama`` and ``mistral`` (same shape): RoPE, RMSNorm, SwiGLU MLP, grouped-query attention.

Field names follow the HF configs (``n_embd`` for GPT-2, ``hidden_size`` for Llama, ...).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import ConfigError

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# HF activation names: "gelu_new" / "gelu_pytorch_tanh" are GELU with the tanh approximation.
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for long context (HF ``rope_scaling``).

    ``linear``: every frequency divided by ``factor`` (positions interpolated).
    ``llama3``: Llama 3.1's scheme: low frequencies divided by ``factor``, high ones
    kept, a smooth blend between (see ``rope.py``).
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of one checkpoint.

    Attributes:
        model_type: "gpt2" or "llama" (mistral is read as llama).
        n_layers, d_model, n_heads, n_kv_heads, head_dim, d_mlp, vocab_size: sizes.
            n_kv_heads < n_heads is grouped-query attention (GQA), 1 is multi-query (MQA).
        max_seq_len: longest context the model supports (``max_position_embeddings``,
            capped by Mistral's ``sliding_window`` so full attention stays exact).
        norm_eps: epsilon of LayerNorm / RMSNorm.
        rope_theta: RoPE base (None for GPT-2, which learns its positions).
        rope_scaling: long-context RoPE scaling, or None.
        tie_word_embeddings: the LM head reuses the token embedding matrix.
        activation: "gelu_tanh" (GPT-2 MLP) or "silu" (SwiGLU MLP).
        attention_bias, mlp_bias: whether those projections have biases.
        bos_token_id, eos_token_ids: from config.json; eos may be several ids.
    """

    model_type: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_mlp: int
    vocab_size: int
    max_seq_len: int
    norm_eps: float
    activation: str
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope_theta: float | None = None
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def uses_rope(self) -> bool:
        return self.model_type == "llama"

    @property
    def n_rep(self) -> int:
        """Query heads that share one K/V head (1 = plain multi-head attention)."""
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes one token takes: 2 (K and V) · layers · KV heads · head_dim · dtype bytes."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        """Read a HF ``config.json`` file (or the folder holding it).

        Raises ConfigError for a missing file, bad JSON or an unsupported field.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}; point to a Hugging Face model folder")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"{path} must hold a JSON object of config fields, got {type(hf).__name__}")
        return cls.from_hf(hf)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a HF config dict. Raises ConfigError naming the bad field."""
        model_type = hf.get("model_type")
        if model_type == "gpt2":
            return _from_gpt2(hf)
        if model_type in ("llama", "mistral"):
            return _from_llama(hf)
        raise ConfigError(
            f"config.json: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def _require(hf: dict, key: str):
    if key not in hf:
        raise ConfigError(f"config.json: missing field {key!r} for model_type {hf.get('model_type')!r}")
    return hf[key]


def _activation(hf: dict, key: str, default: str) -> str:
    name = hf.get(key, default)
    if name not in ACTIVATIONS:
        raise ConfigError(f"config.json: {key} {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _eos_ids(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def _from_gpt2(hf: dict) -> ModelConfig:
    d_model = _require(hf, "n_embd")
    n_heads = _require(hf, "n_head")
    return ModelConfig(
        model_type="gpt2",
        n_layers=_require(hf, "n_layer"),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=d_model // n_heads,
        d_mlp=hf.get("n_inner") or 4 * d_model,
        vocab_size=_require(hf, "vocab_size"),
        max_seq_len=_require(hf, "n_positions"),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=_activation(hf, "activation_function", "gelu_new"),
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
        attention_bias=True,
        mlp_bias=True,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf),
    )


def _from_llama(hf: dict) -> ModelConfig:
    d_model = _require(hf, "hidden_size")
    n_heads = _require(hf, "num_attention_heads")
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        raise ConfigError(
            f"config.json: num_attention_heads ({n_heads}) must be a multiple of num_key_value_heads ({n_kv_heads})"
        )
    max_seq_len = _require(hf, "max_position_embeddings")
    if hf.get("sliding_window"):
        max_seq_len = min(max_seq_len, hf["sliding_window"])
    rope_theta, rope_scaling = _rope(hf)
    return ModelConfig(
        model_type="llama",
        n_layers=_require(hf, "num_hidden_layers"),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=hf.get("head_dim") or d_model // n_heads,
        d_mlp=_require(hf, "intermediate_size"),
        vocab_size=_require(hf, "vocab_size"),
        max_seq_len=max_seq_len,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation=_activation(hf, "hidden_act", "silu"),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf),
    )


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling, from either spelling found in the wild.

    The hub's configs keep ``rope_theta`` and ``rope_scaling`` at top level;
    transformers 5 writes ``rope_parameters`` holding ``rope_theta`` and the scaling fields.
    """
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"config.json: rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), RopeScaling(rope_type, **{k: scaling[k] for k in fields if k in scaling})
