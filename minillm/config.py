"""ModelConfig: the handful of numbers that define a decoder-only transformer.

Read from a Hugging Face ``config.json``. Two layer shapes, five families:

- ``gpt2``: learned position embeddings, LayerNorm, GELU(tanh) MLP, biases everywhere.
- ``llama`` and ``mistral`` (same shape): RoPE, RMSNorm, SwiGLU MLP, grouped-query attention;
  Mistral's ``sliding_window`` limits each query to the last W keys.
- ``qwen2`` (Qwen2, Qwen2.5): Llama's layer with biases on the q, k, v projections (not on o).
- ``qwen3``: Llama's layer with QK-norm (RMSNorm on each head of q and k, before RoPE) and an
  explicit ``head_dim``.

Field names follow the HF configs (``n_embd`` for GPT-2, ``hidden_size`` for Llama, ...).
Every field of transformers' GPT2Config, LlamaConfig, MistralConfig, Qwen2Config and Qwen3Config
that changes the logits is either implemented or refused by name (``NOT_IMPLEMENTED``); types and
ranges are checked here, at the boundary, so a bad file fails with one line naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .errors import ConfigError

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
# HF activation names (transformers' ACT2FN) -> ours. "gelu_new" / "gelu_pytorch_tanh" are GELU with
# the tanh approximation, "gelu" the exact (erf) one. Llama's gated MLP is SwiGLU: silu only.
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
LLAMA_ACTIVATIONS = {"silu": "silu", "swish": "silu"}

# Fields that would change the logits but that minillm does not compute, with the value that
# means "off". A config.json that sets one to anything else is refused by name. (transformers'
# gpt2/llama classes ignore the last four; a checkpoint carrying them was trained with them.)
NOT_IMPLEMENTED = {
    "add_cross_attention": False,  # GPT-2 as the decoder of an encoder-decoder model
    "partial_rotary_factor": 1.0,  # RoPE on only part of each head (top level or in rope_parameters)
    "attn_logit_softcapping": None,  # Gemma 2: tanh cap on attention scores
    "final_logit_softcapping": None,  # Gemma 2: tanh cap on the logits
    "query_pre_attn_scalar": None,  # Gemma 2: attention scale other than 1/sqrt(head_dim)
    "logits_scaling": 1.0,  # Granite: logits divided by this
}


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE frequencies are stretched for long context (HF ``rope_scaling``).

    ``linear``: every frequency divided by ``factor`` (positions interpolated).
    ``llama3``: Llama 3.1's scheme: low frequencies divided by ``factor``, high ones
    kept, a smooth blend between (see ``rope.py``).
    ``yarn``: YaRN's blend by rotations per original context (``beta_fast``, ``beta_slow``),
    and cos/sin multiplied by ``attention_factor`` (from ``factor``, ``mscale`` and
    ``mscale_all_dim`` when not given).
    ``dynamic``: NTK-aware base growth once the sequence is longer than
    ``original_max_position_embeddings`` (transformers takes ``max_position_embeddings`` for it).

    ``original_max_position_embeddings`` defaults to the config's ``max_position_embeddings``,
    as transformers' ``standardize_rope_params`` fills it in.
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of one checkpoint.

    Attributes:
        model_type: "gpt2", "llama" (mistral is read as llama), "qwen2" or "qwen3"; every type but
            gpt2 has Llama's layer (RoPE, RMSNorm, SwiGLU), with the parts below switched on.
        n_layers, d_model, n_heads, n_kv_heads, head_dim, d_mlp, vocab_size: sizes.
            n_kv_heads < n_heads is grouped-query attention (GQA), 1 is multi-query (MQA).
        max_seq_len: longest context the model supports: ``max_position_embeddings``, or
            longer where the RoPE scaling names a longer one (``yarn``: factor · original
            context; ``dynamic``: factor · max_position_embeddings).
        norm_eps: epsilon of LayerNorm / RMSNorm.
        activation: "gelu_tanh", "gelu" or "relu" (GPT-2 MLP), "silu" (SwiGLU MLP).
        rope_theta: RoPE base (None for GPT-2, which learns its positions).
        rope_scaling: long-context RoPE scaling, or None.
        tie_word_embeddings: the LM head reuses the token embedding matrix.
        qkv_bias: the q, k and v projections have biases (GPT-2; Qwen2 always, HF Qwen2Attention;
            Llama and Qwen3 with ``attention_bias``).
        o_bias: the output projection has a bias (GPT-2; Llama and Qwen3 with ``attention_bias``;
            never Qwen2).
        mlp_bias: the MLP projections have biases.
        qk_norm: RMSNorm over head_dim on each head of q and k after their projections, before
            RoPE (Qwen3; Dehghani et al. 2023, "Scaling Vision Transformers to 22B Parameters").
        bos_token_id, eos_token_ids: from config.json; eos may be several ids.
        scale_attn_weights: divide attention scores by √head_dim (GPT-2's flag; always on for Llama).
        scale_attn_by_inverse_layer_idx: also divide layer i's scores by i + 1 (GPT-2's flag,
            from Mistral-GPT2 / Megatron stability tricks).
        sliding_window: W, or None: a windowed layer's query at position i attends only to
            keys j with i - W < j <= i (Mistral's ``sliding_window``; Beltagy et al. 2020).
        sliding_window_layers: the layers that have the window; None: every layer
            (Mistral). See :meth:`window`.

    Raises ConfigError when a size is not a positive int, or heads do not divide evenly.
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
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_theta: float | None = None
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None

    def __post_init__(self):
        # A second guard for configs built in code (exercises, notebooks); from_hf has already
        # checked these under their config.json names.
        sizes = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_mlp", "vocab_size", "max_seq_len")
        for name in sizes:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        allowed = LLAMA_ACTIVATIONS if self.gated_mlp else GPT2_ACTIVATIONS
        if self.activation not in allowed.values():
            raise ConfigError(f"ModelConfig.activation must be one of {sorted(set(allowed.values()))} for "
                              f"model_type {self.model_type!r}, got {self.activation!r}")
        if self.uses_rope and self.head_dim % 2:
            # RoPE rotates pairs of dimensions (cos/sin tables of head_dim / 2 frequencies, twice).
            raise ConfigError(f"ModelConfig.head_dim must be even for RoPE (it rotates pairs of dimensions), got "
                              f"{self.head_dim}; fix head_dim (or hidden_size / num_attention_heads) in config.json")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )

        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ConfigError(f"ModelConfig.sliding_window must be a positive integer or None, got {w!r}")
        if any(not 0 <= layer < self.n_layers for layer in self.sliding_window_layers or ()):
            raise ConfigError(f"ModelConfig.sliding_window_layers must be layers in [0, {self.n_layers}), "
                              f"got {self.sliding_window_layers}")

    def window(self, layer: int) -> int | None:
        """W for a sliding-window layer (its queries see the last W positions), None for full attention."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or layer in self.sliding_window_layers:
            return self.sliding_window
        return None

    @property
    def has_sliding_window(self) -> bool:
        """True when some layer's window is shorter than the context (so it changes the attention)."""
        return any((self.window(layer) or self.max_seq_len) < self.max_seq_len for layer in range(self.n_layers))

    @property
    def uses_rope(self) -> bool:
        return self.model_type != "gpt2"

    @property
    def gated_mlp(self) -> bool:
        """True for Llama's SwiGLU MLP (gate, up, down), False for GPT-2's (up, down)."""
        return self.model_type != "gpt2"

    @property
    def n_rep(self) -> int:
        """Query heads that share one K/V head (1 = plain multi-head attention)."""
        return self.n_heads // self.n_kv_heads

    def attn_scale(self, layer: int) -> float:
        """The factor attention scores q·k are multiplied by in ``layer`` (0-based).

        1/√head_dim (Vaswani et al. 2017), or 1 without ``scale_attn_weights``, then divided by
        layer + 1 with ``scale_attn_by_inverse_layer_idx``: transformers' GPT2Attention.scaling.
        """
        scale = self.head_dim**-0.5 if self.scale_attn_weights else 1.0
        return scale / (layer + 1) if self.scale_attn_by_inverse_layer_idx else scale

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
        except UnicodeDecodeError:
            raise ConfigError(f"{path} is not a UTF-8 text file; point to a Hugging Face config.json") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"{path} must hold a JSON object of config fields, got {type(hf).__name__}")
        return cls.from_hf(hf)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a HF config dict.

        Raises ConfigError naming the field: missing, of the wrong type or range, a value
        minillm does not compute (``NOT_IMPLEMENTED``, unsupported activations or RoPE types),
        or heads that do not divide the hidden size.
        """
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _refuse_not_implemented(hf)
        if model_type == "gpt2":
            return _from_gpt2(hf)
        return _from_qwen(hf) if model_type in ("qwen2", "qwen3") else _from_llama(hf)


# -- reading one field, checked ---------------------------------------------------------

_REQUIRED = object()


def _get(hf: dict, key: str, default):
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is _REQUIRED:
        raise ConfigError(f"config.json: missing field {key!r} for model_type {hf.get('model_type')!r}")
    return default


def _int(hf: dict, key: str, default=_REQUIRED, minimum: int = 1) -> int:
    value = _get(hf, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"config.json: {key} must be an integer >= {minimum}, got {value!r}; fix that field")
    return value


def _positive_float(hf: dict, key: str, default=_REQUIRED) -> float:
    value = _get(hf, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config.json: {key} must be a positive number, got {value!r}; fix that field")
    return float(value)


def _bool(hf: dict, key: str, default: bool) -> bool:
    value = _get(hf, key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"config.json: {key} must be true or false, got {value!r}; fix that field")
    return value


def _token_id(hf: dict, key: str) -> tuple[int, ...]:
    """``bos_token_id`` / ``eos_token_id``: null, one id or a list of ids (all ints >= 0)."""
    value = hf.get(key)
    ids = () if value is None else tuple(value) if isinstance(value, list) else (value,)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ConfigError(f"config.json: {key} must be a token id (an integer >= 0) or a list of them, got {value!r}")
    return ids


def _activation(hf: dict, key: str, default: str, table: dict[str, str]) -> str:
    name = _get(hf, key, default)
    if name not in table:
        raise ConfigError(f"config.json: {key} {name!r} is not supported; supported: {', '.join(table)}")
    return table[name]


def _refuse_not_implemented(hf: dict) -> None:
    rope_parameters = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    for key, off in NOT_IMPLEMENTED.items():
        value = hf.get(key, rope_parameters.get(key, off))
        if value is not None and value != off:
            raise ConfigError(
                f"config.json: {key} = {value!r} changes the computation and minillm does not implement it; "
                f"use a checkpoint without it ({key} = {off!r})"
            )


def _divides(hf: dict, whole: str, part: str) -> None:
    if hf[whole] % hf[part]:
        raise ConfigError(f"config.json: {whole} ({hf[whole]}) must be a multiple of {part} ({hf[part]})")


# -- the two families -------------------------------------------------------------------


def _from_gpt2(hf: dict) -> ModelConfig:
    d_model, n_heads = _int(hf, "n_embd"), _int(hf, "n_head")
    _divides(hf, "n_embd", "n_head")
    bos = _token_id(hf, "bos_token_id")
    # reorder_and_upcast_attn is not read: it only upcasts attention scores to float32 (and scales
    # q before the product), which changes rounding in 16-bit dtypes, not the math.
    return ModelConfig(
        model_type="gpt2",
        n_layers=_int(hf, "n_layer"),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=d_model // n_heads,
        d_mlp=_int(hf, "n_inner", 4 * d_model),
        vocab_size=_int(hf, "vocab_size"),
        max_seq_len=_int(hf, "n_positions"),
        norm_eps=_positive_float(hf, "layer_norm_epsilon", 1e-5),
        activation=_activation(hf, "activation_function", "gelu_new", GPT2_ACTIVATIONS),
        tie_word_embeddings=_bool(hf, "tie_word_embeddings", True),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=_token_id(hf, "eos_token_id"),
        scale_attn_weights=_bool(hf, "scale_attn_weights", True),
        scale_attn_by_inverse_layer_idx=_bool(hf, "scale_attn_by_inverse_layer_idx", False),
    )


def _from_llama(hf: dict) -> ModelConfig:
    d_model, n_heads = _int(hf, "hidden_size"), _int(hf, "num_attention_heads")
    n_kv_heads = _int(hf, "num_key_value_heads", n_heads)
    _divides({**hf, "num_key_value_heads": n_kv_heads}, "num_attention_heads", "num_key_value_heads")
    if "head_dim" not in hf or hf["head_dim"] is None:
        _divides(hf, "hidden_size", "num_attention_heads")
    max_position_embeddings = _int(hf, "max_position_embeddings")
    # MistralConfig has no bias fields: transformers' Mistral layers never have biases.
    has_bias_fields = hf["model_type"] == "llama"
    rope_theta, rope_scaling = _rope(hf, max_position_embeddings)
    bos = _token_id(hf, "bos_token_id")
    # pretraining_tp is not read: transformers 5 ignores it, and 4.x only split the same products
    # into slices (Llama 2's tensor-parallel layout), which changes rounding, not the math.
    return ModelConfig(
        model_type="llama",
        n_layers=_int(hf, "num_hidden_layers"),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=_int(hf, "head_dim", d_model // n_heads),
        d_mlp=_int(hf, "intermediate_size"),
        vocab_size=_int(hf, "vocab_size"),
        max_seq_len=_context_length(max_position_embeddings, rope_scaling),
        norm_eps=_positive_float(hf, "rms_norm_eps", 1e-6),
        activation=_activation(hf, "hidden_act", "silu", LLAMA_ACTIVATIONS),
        tie_word_embeddings=_bool(hf, "tie_word_embeddings", False),
        qkv_bias=has_bias_fields and _bool(hf, "attention_bias", False),
        o_bias=has_bias_fields and _bool(hf, "attention_bias", False),
        mlp_bias=has_bias_fields and _bool(hf, "mlp_bias", False),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=_token_id(hf, "eos_token_id"),
        sliding_window=_sliding_window(hf),
    )


def _from_qwen(hf: dict) -> ModelConfig:
    """Qwen2/Qwen2.5 and Qwen3: Llama's config read as transformers' Qwen2Config/Qwen3Config reads it.

    Qwen2: q, k, v biases always, none on o (HF Qwen2Attention has no bias field).
    Qwen3: ``attention_bias`` (default false) on all four projections, QK-norm, and a
    ``head_dim`` that defaults to 128 (Qwen3Config), not hidden_size / heads.
    With ``use_sliding_window`` (false in the released Qwen2.5 and Qwen3 configs), the layers
    from ``max_window_layers`` on, or those ``layer_types`` names "sliding_attention", attend
    to the last ``sliding_window`` positions, as transformers builds ``layer_types``; without
    it, the window fields are ignored.
    """
    llama = {k: v for k, v in hf.items() if k not in ("sliding_window", "max_window_layers", "layer_types")}
    if hf["model_type"] == "qwen2":
        config = replace(_from_llama(llama), model_type="qwen2", qkv_bias=True, o_bias=False)
    else:
        bias = _bool(hf, "attention_bias", False)
        config = replace(_from_llama({**llama, "head_dim": _int(hf, "head_dim", 128)}), model_type="qwen3",
                         qkv_bias=bias, o_bias=bias, qk_norm=True)
    return replace(config, **_qwen_window(hf, config.n_layers))


def _qwen_window(hf: dict, n_layers: int) -> dict:
    """``sliding_window`` and ``sliding_window_layers`` of a Qwen config (Qwen2Config's ``layer_types``)."""
    if not _bool(hf, "use_sliding_window", False) or hf.get("sliding_window", 4096) is None:
        return {"sliding_window": None, "sliding_window_layers": None}
    window = _int(hf, "sliding_window", 4096)
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = _int(hf, "max_window_layers", 28, minimum=0)
        layers = tuple(range(first, n_layers))
    elif (not isinstance(layer_types, list) or len(layer_types) != n_layers
          or not set(layer_types) <= {"sliding_attention", "full_attention"}):
        raise ConfigError(f"config.json: layer_types must list 'sliding_attention' or 'full_attention' for each of "
                          f"the {n_layers} layers, got {layer_types!r}; fix the config")
    else:
        layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    return {"sliding_window": window if layers else None, "sliding_window_layers": layers or None}


def _sliding_window(hf: dict) -> int | None:
    """Mistral's W; absent means transformers' MistralConfig default, 4096, and null means none.

    (LlamaConfig has no such field: transformers ignores one in a Llama config, and so do we.)
    """
    if hf["model_type"] != "mistral" or ("sliding_window" in hf and hf["sliding_window"] is None):
        return None
    return _int(hf, "sliding_window", 4096)


def _context_length(max_position_embeddings: int, scaling: RopeScaling | None) -> int:
    """The longest context: ``max_position_embeddings``, or what the RoPE scaling was made for.

    transformers sets no limit at all; minillm refuses positions beyond this one. YaRN configs
    often keep the original length in ``max_position_embeddings`` (Qwen2.5's instructions add
    only ``rope_scaling``) and mean factor · original; dynamic NTK keeps growing its base with
    the length, and its ``factor`` names how far (transformers' docs: "max_position_embeddings
    · factor").
    """
    if scaling is None or scaling.rope_type not in ("yarn", "dynamic"):
        return max_position_embeddings
    return max(max_position_embeddings, int(scaling.factor * scaling.original_max_position_embeddings))


def _rope(hf: dict, max_position_embeddings: int) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling, from either spelling found in the wild.

    The hub's configs keep ``rope_theta`` and ``rope_scaling`` at top level;
    transformers 5 writes ``rope_parameters`` holding ``rope_theta`` and the scaling fields.
    """
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ConfigError(f"config.json: {key} must be an object of RoPE fields, got {value!r}")
    theta = _positive_float(params, "rope_theta", _positive_float(hf, "rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"config.json: rope_scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    if rope_type in ("yarn", "dynamic") and scaling.get("factor") is None:
        raise ConfigError(f"config.json: rope_scaling of type {rope_type!r} needs a factor; add rope_scaling.factor")
    fields = {"factor": _positive_float, "low_freq_factor": _positive_float, "high_freq_factor": _positive_float,
              "original_max_position_embeddings": _int, "attention_factor": _positive_float,
              "beta_fast": _positive_float, "beta_slow": _positive_float, "mscale": _positive_float,
              "mscale_all_dim": _positive_float, "truncate": lambda d, key: _bool(d, key, True)}
    values = {key: read(scaling, key) for key, read in fields.items() if scaling.get(key) is not None}
    # transformers' standardize_rope_params: the pre-scaling context defaults to max_position_embeddings;
    # dynamic NTK always takes max_position_embeddings as that context (_compute_dynamic_ntk_parameters).
    if rope_type == "dynamic" or "original_max_position_embeddings" not in values:
        values["original_max_position_embeddings"] = max_position_embeddings
    if rope_type == "llama3" and values.get("high_freq_factor", 4.0) <= values.get("low_freq_factor", 1.0):
        raise ConfigError("config.json: rope_scaling high_freq_factor must be greater than low_freq_factor")
    if rope_type == "yarn" and values.get("beta_fast", 32.0) < values.get("beta_slow", 1.0):
        raise ConfigError("config.json: rope_scaling beta_fast must be >= beta_slow (YaRN's ramp runs from beta_slow "
                          "to beta_fast rotations)")
    return theta, RopeScaling(rope_type, **values)
