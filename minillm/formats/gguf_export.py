"""Write a loaded Llama-family model as a float32 GGUF file, so llama.cpp runs the very same weights.

The inverse of :mod:`minillm.formats.gguf_convert`, used by the benchmark's llama.cpp engine
(minillm/bench/llama_cpp.py): llama.cpp reads only GGUF, and comparing speeds is fair
only on identical weights in the same dtype.

    model (float32, minillm names)  ──►  out.gguf
        llama.* hyperparameters           from model.config
        tokenizer.*, general.name ...     copied from the GGUF the model came from
        tensors, all F32                  renamed (blocks.3.attn.q_proj -> blk.3.attn_q), q and k
                                          rows permuted back to llama.cpp's rotary layout

Sources: llama.cpp ``convert_hf_to_gguf.py`` (LlamaModel: names, ``permute``, the keys);
the ``gguf`` package's GGUFWriter.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from ..errors import ModelNotFoundError, WeightsError
from .gguf_convert import open_reader
from ..model import Transformer

# minillm parameter names -> llama.cpp's (the reverse of gguf_convert's tables, via HF's names).
_GLOBAL = {"embed.weight": "token_embd.weight", "ln_final.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"ln1": "attn_norm", "ln2": "ffn_norm", "attn.q_proj": "attn_q", "attn.k_proj": "attn_k",
          "attn.v_proj": "attn_v", "attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# Metadata that describes the weights, not the model: rewritten, never copied from the source file.
_NOT_COPIED = ("GGUF.", "llama.", "general.architecture", "general.file_type", "general.quantization_version")


def write_f32_gguf(model: Transformer, metadata_gguf: str | Path, out_path: str | Path) -> Path:
    """Write ``model``'s weights as an all-F32 GGUF file at ``out_path``; returns the path.

    Args:
        model: a Llama-family float32 minillm model (RoPE, RMSNorm, SwiGLU, no biases).
        metadata_gguf: a GGUF file of the same model (e.g. the Q4_1 file the default model was
            converted from): its tokenizer and general.* keys are copied.
        out_path: the file to write (replaced if present).

    Raises ValueError (not a Llama-family float32 model, RoPE scaling, a sliding window, a tokenizer whose size
    differs from the model's vocabulary), ModelNotFoundError (metadata_gguf unreadable).
    """
    c = model.config
    _check_exportable(model)
    reader = open_reader(Path(metadata_gguf))
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    if n_tokens != c.vocab_size:
        raise ValueError(f"{metadata_gguf} has a tokenizer of {n_tokens} tokens but the model's vocabulary is "
                         f"{c.vocab_size}; pass the GGUF this model came from")
    out_path = Path(out_path)
    writer = gguf.GGUFWriter(str(out_path), "llama")
    for field in reader.fields.values():
        if not field.name.startswith(_NOT_COPIED):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    _add_hyperparameters(writer, model)
    for name, tensor in gguf_tensors(model).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def gguf_tensors(model: Transformer) -> dict[str, np.ndarray]:
    """Every weight under its llama.cpp name as a row-major float32 array ([out, in] for matrices),
    q and k permuted to llama.cpp's rotary layout; a tied LM head is not written (llama.cpp ties it)."""
    c = model.config
    heads = {"attn_q": c.n_heads, "attn_k": c.n_kv_heads}
    out = {}
    for name, param in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        gguf_name = _gguf_name(name)
        w = param.detach().float()
        kind = gguf_name.split(".")[-2]
        if kind in heads:
            w = permute_qk(w, heads[kind])
        out[gguf_name] = w.contiguous().numpy()
    return out


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's rotate-half row order of a Q or K projection -> llama.cpp's interleaved pairs
    (rows of one head, head_dim = 8: HF 0 1 2 3 4 5 6 7 -> GGUF 0 4 1 5 2 6 3 7).

    The inverse of :func:`minillm.formats.gguf_convert.unpermute_qk`; w: [n_heads * head_dim, d_model].
    Source: ``permute`` in llama.cpp convert_hf_to_gguf.py (LlamaModel).
    """
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _gguf_name(name: str) -> str:
    if name in _GLOBAL:
        return _GLOBAL[name]
    layer, rest = name.removeprefix("blocks.").split(".", 1)
    module, kind = rest.rsplit(".", 1)
    if not layer.isdigit() or module not in _LAYER:
        raise WeightsError(f"parameter {name!r} has no llama.cpp counterpart")
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def _add_hyperparameters(writer: gguf.GGUFWriter, model: Transformer) -> None:
    """The ``llama.*`` keys llama.cpp reads (the names convert_hf_to_gguf.py writes), from the config."""
    c = model.config
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(c.max_seq_len)
    writer.add_embedding_length(c.d_model)
    writer.add_feed_forward_length(c.d_mlp)
    writer.add_block_count(c.n_layers)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_vocab_size(c.vocab_size)


def _check_exportable(model: Transformer) -> None:
    c, param = model.config, next(model.parameters())
    if c.model_type != "llama" or c.qkv_bias or c.o_bias or c.mlp_bias or c.qk_norm:
        raise ValueError(f"only Llama-family models (RoPE, SwiGLU, no biases, no QK-norm) are written as GGUF "
                         f"here, got {c.model_type}")
    if c.rope_scaling is not None:
        raise ValueError("RoPE scaling is not written to GGUF here; use llama.cpp's convert_hf_to_gguf.py")
    if c.has_sliding_window:
        raise ValueError(f"a sliding window (W={c.sliding_window}) is not written to GGUF here: llama.cpp would "
                         "attend to every position; use llama.cpp's convert_hf_to_gguf.py")
    if param.dtype != torch.float32:
        raise ValueError(f"the model is {param.dtype}; load it in float32 to write an F32 GGUF")


def find_metadata_gguf(model: Transformer) -> Path:
    """The GGUF the model was converted from (its tokenizer is what llama.cpp needs); raises
    ModelNotFoundError naming the fix when it is not on disk."""
    from .weights import source_gguf

    source = getattr(model, "source", None)
    found = source_gguf(source.name, source.parent) if source is not None else None
    if found is None:
        raise ModelNotFoundError(f"no GGUF file of {source} on disk for its tokenizer metadata; the llama.cpp "
                                 "engine runs models converted from a GGUF (the default model is)")
    return found
