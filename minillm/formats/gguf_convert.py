"""Unpack a llama.cpp GGUF file into a Hugging Face-style model folder.

A GGUF file keeps everything in one place: the config as metadata keys
(``llama.block_count``, ``llama.rope.freq_base``...), the tokenizer as arrays
(``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges``) and the weights, mostly
quantized (Q4_1, Q8_0, ...). minillm reads plain folders, so we unpack once:

    model.gguf ──► out_dir/
                    ├── model.safetensors       float32, HF tensor names (Llama, Qwen2, Qwen3)
                    ├── tokenizer.json          byte-level BPE for the `tokenizers` library
                    ├── tokenizer_config.json   chat template, special tokens
                    └── config.json             written last: it marks a complete folder

Sources: llama.cpp ``convert_hf_to_gguf.py`` (the forward direction); transformers
``modeling_gguf_pytorch_utils.py`` and ``integrations/gguf`` (the same inverse,
used as the oracle in tests/formats/test_gguf_convert.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from rich.console import Console
from rich.progress import track
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ..errors import ConfigError, ModelNotFoundError, OutputPathError, WeightsError, check_output_dir

# GGUF ``general.architecture`` -> the HF model_type and class its config.json names. The metadata
# keys of each sit under its name (``qwen2.block_count``...); the layers differ only in extra tensors.
HF_MODELS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(HF_MODELS)

# GGUF tensor names -> HF names. Per-layer names sit under blk.{i} / model.layers.{i}.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's QK-norm
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# GGUF token types (llama.cpp llama_token_type): which vocabulary entries are added tokens.
_CONTROL, _USER_DEFINED = 3, 4

# How each `tokenizer.ggml.pre` value tokenizes, as llama.cpp does (src/llama-vocab.cpp:
# llama_vocab::impl::load for the flags, llm_tokenizer_bpe for the regexes). The regexes run
# one after the other, each splitting the pieces the previous one made (matches and the
# text between them both become pieces), then BPE runs on each piece.
#   ignore_merges: a piece that is a whole vocabulary entry is that token, merges or not.
#   add_bos: the default when the file has no tokenizer.ggml.add_bos_token key.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2, Qwen2.5, Qwen3: every digit its own piece


@dataclass(frozen=True)
class PreTokenizerRules:
    """llama.cpp's per-vocabulary rules for one ``tokenizer.ggml.pre`` name."""

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = PreTokenizerRules((_GPT2_SPLIT,))
_LLAMA3 = PreTokenizerRules((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_DIGITS_THEN_GPT2 = PreTokenizerRules((r"\p{N}", _GPT2_SPLIT))  # every digit its own piece
PRE_TOKENIZERS = {
    # llama.cpp's fallback for files without a name: punctuation runs, then GPT-2, then digit groups of 3
    "default": PreTokenizerRules((r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]")),
    "gpt-2": _GPT2,
    "llama-bpe": _LLAMA3,  # Llama-3 family
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": PreTokenizerRules((_QWEN2_SPLIT,)),  # Qwen2, 2.5, 3 (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2): no BOS
    "falcon3": _LLAMA3,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
}


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Dequantize a Llama, Qwen2 or Qwen3 GGUF file to float32 and write an HF-style folder.

    Args:
        gguf_path: the ``.gguf`` file (any type ``gguf.quants.dequantize`` reads:
            F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ*).
        out_dir: folder to write (created if missing; files in it are replaced).
        progress: show a rich progress bar over the tensors.

    Returns:
        ``out_dir`` as a Path. It holds config.json only once every other file is written.

    Raises:
        ModelNotFoundError: the file is missing or is not a readable GGUF.
        OutputPathError: ``out_dir`` is a file or cannot be written (checked before dequantizing).
        ConfigError: an architecture other than llama, qwen2, qwen3, a tokenizer / RoPE variant or a
            metadata key that changes the math and is not supported (``NOT_IMPLEMENTED_KEYS``),
            or a size that is not a positive integer (``qwen2.attention.head_count`` 0, ...).
        WeightsError: a tensor is unknown, missing, of the wrong shape or of a type
            gguf cannot dequantize (checked before dequantizing).
        OutputPathError: a file could not be written (a full disk); no ``.partial`` file is left.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = open_reader(gguf_path)
    check_output_dir(out_dir)
    _check_supported(reader)
    config = _hf_config(reader)
    tensors = _hf_tensors(reader, config, progress)
    tokenizer = _build_tokenizer(reader)  # before writing: every failure but a write one leaves no files

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").unlink(missing_ok=True)  # folder reads as incomplete until the end
    _write_atomic(out_dir / "model.safetensors", lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    _write_atomic(out_dir / "tokenizer.json", lambda p: tokenizer.save(str(p)))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(reader))
    _write_json(out_dir / "config.json", config)
    return out_dir


def open_reader(path: Path) -> gguf.GGUFReader:
    """The GGUF file at ``path``, opened (its metadata and tensors read lazily, memory-mapped).

    Raises ModelNotFoundError when there is no file there or its bytes are not GGUF.
    """
    if not path.is_file():
        raise ModelNotFoundError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as error:  # gguf raises ValueError, struct.error, ... on bad bytes
        raise ModelNotFoundError(f"cannot read {path} as GGUF: {error}") from error


_REQUIRED = object()


def _meta(reader: gguf.GGUFReader, key: str, default=_REQUIRED):
    """One metadata value as a Python object (str, int, float, bool or list)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ConfigError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _meta_int(reader: gguf.GGUFReader, key: str, default=_REQUIRED) -> int:
    """A size key (``llama.block_count``...): a positive integer, or ConfigError naming the key."""
    value = _meta(reader, key, default)
    if isinstance(value, list):  # llama.cpp allows per-layer values (e.g. head_count_kv of DeciLM, OpenELM)
        raise ConfigError(f"GGUF metadata {key} has one value per layer; minillm supports one value for all layers")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"GGUF metadata {key} must be a positive integer, got {value!r}; the file is damaged")
    return value


def _meta_float(reader: gguf.GGUFReader, key: str, default=_REQUIRED) -> float:
    """A positive number (``llama.rope.freq_base``, an epsilon), or ConfigError naming the key."""
    value = _meta(reader, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ConfigError(f"GGUF metadata {key} must be a positive number, got {value!r}; the file is damaged")
    return float(value)


def _check_supported(reader: gguf.GGUFReader) -> None:
    """Fail before writing anything when the file needs a feature minillm lacks."""
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ConfigError(f"GGUF architecture {arch!r} is not supported; supported: {supported}")
    tokenizer_model = _meta(reader, "tokenizer.ggml.model")
    if tokenizer_model != "gpt2":
        raise ConfigError(f"GGUF tokenizer {tokenizer_model!r} is not supported; supported: 'gpt2' (byte-level BPE)")
    pre = _meta(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}")
    _check_special_tokens(reader)
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ConfigError("GGUF has rope_freqs.weight (Llama-3.1-style RoPE scaling), which is not supported")
    for key, off in NOT_IMPLEMENTED_KEYS.items():
        value = _meta(reader, f"{arch}.{key}", off)
        if value != off:
            raise ConfigError(f"GGUF {arch}.{key} = {value!r} changes the computation and is not supported "
                              "by minillm")


# {arch}.* keys (llama.*, qwen2.*, qwen3.*) that change the math and that minillm does not compute, with the
# value that means "off" (llama.cpp's default when the key is absent). A file that sets one otherwise is refused.
NOT_IMPLEMENTED_KEYS = {
    "expert_count": 0,  # mixture of experts (Mixtral is a "llama" GGUF)
    "use_parallel_residual": False,  # attention and MLP from the same input (GPT-NeoX)
    "attention.clamp_kqv": 0.0,  # q, k, v clamped to ±this
    "attention.max_alibi_bias": 0.0,  # ALiBi positions instead of RoPE
    "attention.causal": True,
    "attention.scale": 0.0,  # a fixed attention scale instead of 1/sqrt(head_dim) (0: unset)
    "attn_logit_softcapping": 0.0,
    "final_logit_softcapping": 0.0,
    "logit_scale": 1.0,
    "embedding_scale": 1.0,
    "residual_scale": 1.0,
    "rope.scaling.attn_factor": 1.0,  # YaRN's attention temperature
    "attention.sliding_window": 0,  # sliding-window attention (Mistral, Qwen2 with use_sliding_window)
}


# ---------------------------------------------------------------- config.json


def _hf_config(reader: gguf.GGUFReader) -> dict:
    """config.json for transformers' LlamaConfig, Qwen2Config or Qwen3Config, from the ``{arch}.*`` keys."""
    arch = _meta(reader, "general.architecture")
    key = lambda name, default=_REQUIRED: _meta_int(reader, f"{arch}.{name}", default)  # noqa: E731
    d_model, n_heads = key("embedding_length"), key("attention.head_count")
    n_kv_heads = key("attention.head_count_kv", n_heads)
    if n_heads % n_kv_heads:
        raise ConfigError(f"GGUF {arch}.attention.head_count ({n_heads}) must be a multiple of "
                          f"{arch}.attention.head_count_kv ({n_kv_heads}); the file is damaged")
    if f"{arch}.attention.key_length" not in reader.fields and d_model % n_heads:
        raise ConfigError(f"GGUF {arch}.embedding_length ({d_model}) must be a multiple of "
                          f"{arch}.attention.head_count ({n_heads}) when {arch}.attention.key_length is absent")
    head_dim = key("attention.key_length", d_model // n_heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise ConfigError(f"GGUF {arch}.attention.value_length differs from key_length; not supported")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ConfigError("GGUF rotates only part of each head (rope.dimension_count < head_dim); not supported")
    config = {
        "model_type": arch,
        "architectures": [HF_MODELS[arch]],
        "hidden_size": d_model,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length"),
        "rms_norm_eps": _meta_float(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": _meta_float(reader, f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": key("vocab_size", len(_meta(reader, "tokenizer.ggml.tokens"))),
        # llama.cpp writes output.weight only when it differs from the embedding
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": _meta(reader, "tokenizer.ggml.padding_token_id", None),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    rope_scaling = _rope_scaling(reader, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict | None:
    """HF ``rope_scaling`` from ``{arch}.rope.scaling.*`` (linear), None when absent.

    YaRN and LongRoPE are refused here, at convert time, as minillm's loader would refuse them.
    """
    kind = _meta(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _meta_float(reader, f"{arch}.rope.scaling.factor")}
    raise ConfigError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported; supported: none, linear")


# ---------------------------------------------------------------- model.safetensors


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    Raises WeightsError for a name with no HF counterpart.
    """
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise WeightsError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a Q or K projection.

    HF rotates pairs (x[i], x[i + head_dim/2]) ("rotate_half"); llama.cpp rotates
    adjacent pairs (x[2i], x[2i+1]). So llama.cpp's converter reorders each head's
    output rows, which we invert (rows of one head, head_dim = 8):

        GGUF: 0 4 1 5 2 6 3 7   --view [n_heads, head_dim/2, 2]--> swap the last two axes
        HF:   0 1 2 3 4 5 6 7

    Args:
        w: [n_heads * head_dim, d_model], as stored in the GGUF.
        n_heads: query heads for Q, key/value heads for K (GQA).

    Returns:
        [n_heads * head_dim, d_model], the HF layout.

    Source: ``permute`` in llama.cpp convert_hf_to_gguf.py (LlamaModel).
    """
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _dequantize(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as float32 in row-major HF order ([out, in] for matrices)."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise WeightsError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {error}") from error
    return torch.from_numpy(np.array(values, dtype=np.float32, order="C"))  # copy: F32 data is a read-only mmap


def _hf_tensors(reader: gguf.GGUFReader, config: dict, progress: bool) -> dict[str, torch.Tensor]:
    """Every tensor, dequantized, renamed, Q/K un-permuted (Llama), checked against the config's shapes.

    Only llama.cpp's Llama converter permutes Q and K: Qwen2 and Qwen3 run llama.cpp's NEOX RoPE,
    which rotates the same (i, i + head_dim/2) pairs as HF, so their rows are stored as they are.
    """
    llama = config["model_type"] == "llama"
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]} if llama else {}
    expected = _expected_shapes(config)
    shapes = {hf_tensor_name(t.name): tuple(reversed(t.shape.tolist())) for t in reader.tensors}
    _check_shapes(shapes, expected, config["model_type"])
    tensors = {}
    for tensor in track(reader.tensors, description="Dequantizing GGUF", disable=not progress,
                        console=Console(stderr=True)):
        w = _dequantize(tensor)
        kind = tensor.name.split(".")[-2]  # blk.3.attn_q.weight -> attn_q
        if kind in heads and tensor.name.endswith(".weight"):
            w = unpermute_qk(w, heads[kind])
        tensors[hf_tensor_name(tensor.name)] = w
    return tensors


def _expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for the whole model: Llama's layer, plus Qwen2's q, k, v biases or
    Qwen3's QK-norm weights."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    layer = {
        "input_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    if config["model_type"] == "qwen2":
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if config["model_type"] == "qwen3":
        layer.update({"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)})
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def _check_shapes(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], arch: str) -> None:
    """Names and shapes (GGUF's, read before dequantizing) against what the metadata implies."""
    missing = sorted(expected.keys() - shapes.keys())
    extra = sorted(shapes.keys() - expected.keys())
    if missing or extra:
        raise WeightsError(f"GGUF tensors do not match the config: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise WeightsError(
                f"GGUF tensor for {name} has shape {list(shapes[name])}, but the {arch}.* metadata (heads, head "
                f"size, lengths) gives {list(shape)}; the file is damaged"
            )


# ---------------------------------------------------------------- tokenizer.json


def _build_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """Byte-level BPE from ``tokenizer.ggml.tokens`` / ``merges``, for the `tokenizers` library.

    Pipeline, with llama.cpp's rules for the file's ``tokenizer.ggml.pre`` (:data:`PRE_TOKENIZERS`):
    added tokens matched whole -> the pre-tokenizer's regex splits -> byte alphabet
    (space = Ġ, newline = Ċ, ...) -> BPE (whole-word lookup first where llama.cpp does it)
    -> BOS/EOS as llama.cpp adds them. Decoding maps the byte alphabet back to UTF-8 bytes.
    """
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    rules = PRE_TOKENIZERS[_meta(reader, "tokenizer.ggml.pre", "default")]
    merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=rules.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in rules.splits]
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # the splits are done
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, to_bytes])
    tok.decoder = decoders.ByteLevel()
    types = _meta(reader, "tokenizer.ggml.token_type", [])
    # Both kinds are matched whole in the raw text (as llama.cpp does); only CONTROL
    # ones are special, i.e. dropped by decode(skip_special_tokens=True).
    tok.add_special_tokens([_added(t, True) for t, kind in zip(tokens, types) if kind == _CONTROL])
    tok.add_tokens([_added(t, False) for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    post = _post_processor(reader, tokens)
    if post is not None:
        tok.post_processor = post
    return tok


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)


def _adds(reader: gguf.GGUFReader, which: str) -> bool:
    """Whether encoding adds "bos" or "eos": ``tokenizer.ggml.add_{which}_token``, else llama.cpp's
    default for the pre-tokenizer (BOS for the Llama-3 family, nothing otherwise)."""
    rules = PRE_TOKENIZERS[_meta(reader, "tokenizer.ggml.pre", "default")]
    return bool(_meta(reader, f"tokenizer.ggml.add_{which}_token", rules.add_bos if which == "bos" else False))


def _check_special_tokens(reader: gguf.GGUFReader) -> None:
    """Special token ids must be vocabulary ids, and a BOS/EOS that is added must exist."""
    n_tokens = len(_meta(reader, "tokenizer.ggml.tokens"))
    for key in _SPECIAL_ID_KEYS.values():
        token_id = _meta(reader, f"tokenizer.ggml.{key}", None)
        if token_id is not None and not 0 <= token_id < n_tokens:
            raise ConfigError(f"GGUF tokenizer.ggml.{key} is {token_id}, outside the {n_tokens}-token vocabulary")
    for which in ("bos", "eos"):
        if _adds(reader, which) and _meta(reader, f"tokenizer.ggml.{which}_token_id", None) is None:
            raise ConfigError(f"GGUF adds a {which.upper()} token but has no tokenizer.ggml.{which}_token_id")


def _added_special(reader: gguf.GGUFReader, tokens: list[str], which: str) -> tuple[str, int] | None:
    """(token, id) of "bos" or "eos" when encoding adds it, else None."""
    token_id = _meta(reader, f"tokenizer.ggml.{which}_token_id", None)
    return (tokens[token_id], token_id) if token_id is not None and _adds(reader, which) else None


def _post_processor(reader: gguf.GGUFReader, tokens: list[str]) -> processors.TemplateProcessing | None:
    """Template that wraps each sequence in BOS and/or EOS, or None when neither is added."""
    bos, eos = _added_special(reader, tokens, "bos"), _added_special(reader, tokens, "eos")
    specials = [t for t in (bos, eos) if t is not None]
    if not specials:
        return None

    def template(seq: str, type_id: int) -> list[str]:
        around = lambda special: [f"{special[0]}:{type_id}"] if special else []  # noqa: E731
        return around(bos) + [f"${seq}:{type_id}"] + around(eos)

    return processors.TemplateProcessing(
        single=template("A", 0), pair=template("A", 0) + template("B", 1), special_tokens=specials
    )


# tokenizer_config.json's special token names -> the GGUF keys of their ids
_SPECIAL_ID_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
    "sep_token": "seperator_token_id",  # sic: llama.cpp's key name
    "mask_token": "mask_token_id",
}


def _tokenizer_config(reader: gguf.GGUFReader) -> dict:
    """tokenizer_config.json: special token strings, BOS/EOS flags and the chat template.

    A token or template the GGUF lacks is left out, never written as null (transformers then
    leaves it undefined; a null ``bos_token`` would render as "None" in older readers).
    """
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in _SPECIAL_ID_KEYS.items():
        token_id = _meta(reader, f"tokenizer.ggml.{key}", None)
        if token_id is not None:
            config[name] = tokens[token_id]
    config["add_bos_token"], config["add_eos_token"] = _adds(reader, "bos"), _adds(reader, "eos")
    config["model_max_length"] = _meta(reader, f"{_meta(reader, 'general.architecture')}.context_length")
    chat_template = _chat_template(reader)
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def _chat_template(reader: gguf.GGUFReader) -> str | list[dict] | None:
    """``tokenizer.chat_template``, or, when the file also names others (``tokenizer.chat_templates``
    lists names like "tool_use", each in ``tokenizer.chat_template.<name>``), transformers'
    list of ``{"name", "template"}`` with the unnamed one as "default"."""
    default = _meta(reader, "tokenizer.chat_template", None)
    names = _meta(reader, "tokenizer.chat_templates", [])
    if not names:
        return default
    named = [{"name": "default", "template": default}] if default is not None else []
    return named + [{"name": n, "template": _meta(reader, f"tokenizer.chat_template.{n}")} for n in names]


# ---------------------------------------------------------------- writing


def _write_atomic(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename, so ``path`` is never half-written.

    ``write`` only writes (everything it writes is computed before): any error it raises is a
    failed write, turned into OutputPathError with the temporary file removed.

    The file gets the mode of any new file (0o666 less the umask, usually 0o644):
    safetensors writes through a private temporary file, which leaves it 0o600.
    """
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # two `convert` runs into one folder: no clash
    try:
        write(partial)
        os.chmod(partial, 0o666 & ~_umask())
    except Exception as error:  # OSError, or safetensors' / tokenizers' own errors for a full disk
        partial.unlink(missing_ok=True)
        fix = "free some disk space or choose another folder"
        raise OutputPathError(f"cannot write {path} ({error}); {fix}") from error
    os.replace(partial, path)


def _umask() -> int:
    """The process umask. Reading it means setting it, so it is set straight back."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_json(path: Path, data: dict) -> None:
    _write_atomic(path, lambda p: p.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n"))
