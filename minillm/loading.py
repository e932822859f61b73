"""Load a Hugging Face checkpoint (config.json + safetensors) into a :class:`Transformer`.

The model is built on the ``meta`` device (shapes only, no memory), then every
parameter is *assigned* a tensor from the checkpoint. A name that is missing, left
over, or of the wrong shape is an error: nothing is ever left at random initialisation.

Tensor names are mapped from HF's to ours:

    GPT-2 (``transformer.`` prefix optional)   Llama, Mistral, Qwen2, Qwen3 (``model.`` prefix)
    wte / wpe                 -> embed / pos_embed      embed_tokens -> embed
    h.{i}.ln_1 / ln_2         -> blocks.{i}.ln1 / ln2   layers.{i}.input_layernorm / post_attention_layernorm
    h.{i}.attn.c_attn  (q|k|v fused, Conv1D)            layers.{i}.self_attn.{q,k,v,o}_proj (.bias: Qwen2's q, k, v)
    h.{i}.attn.c_proj         -> attn.o_proj            layers.{i}.self_attn.{q,k}_norm (Qwen3's QK-norm)
    h.{i}.mlp.c_fc / c_proj   -> mlp.up_proj / down_proj layers.{i}.mlp.{gate,up,down}_proj
    ln_f                      -> ln_final               norm -> ln_final

GPT-2's Conv1D stores weights as [in, out], the transpose of ``nn.Linear``'s [out, in].
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .device import resolve_device, resolve_dtype
from .errors import ModelNotFoundError, WeightsError
from .fast.choose import choose_decode_path
from .formats.weights import resolve_model, shard_names
from .generation_config import GenerationConfig
from .model import Transformer
from .quantize import check_quantize_args, quantize_model

# Buffers some checkpoints carry that are not weights (causal masks, RoPE tables): recomputed, so skipped.
IGNORED = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")


def load_model(name_or_path, device=None, dtype=None, attn_impl: str = "sdpa", weights_dir=None,
               quantize: str | None = None, fast: bool = True) -> Transformer:
    """Load a GPT-2, Llama, Mistral, Qwen2/Qwen2.5 or Qwen3 checkpoint.

    Args:
        name_or_path: a model folder (config.json + model.safetensors or a sharded
            model.safetensors.index.json), a .gguf file, or a model name known to
            :mod:`minillm.formats.weights` (e.g. "smollm2-135m-instruct"), downloaded if absent.
        device: "cpu", "cuda", "mps" or a torch.device; default cuda when available, else cpu.
        dtype: "float32", "bfloat16", "float16", "float64" or a torch.dtype; default float32
            (bfloat16 on cuda).
        attn_impl: "sdpa" (fused) or "eager" (the math written out).
        weights_dir: where named models are stored (default: see :func:`minillm.paths.weights_dir`).
        quantize: None (float weights), "int8" or "int4": the matrices are quantised from the
            float weights after loading (:mod:`minillm.quantize`); embedding and norms stay float.
        fast: True (default): the speed layer swaps in faster modules with the same parameters
            (:mod:`minillm.fast`: stacked and C products, attention in C, a compiled decode step),
            chosen by rule for this machine, never by timing; False: the lesson's plain PyTorch.

    Returns the model in eval mode, with ``model.config`` (:class:`ModelConfig`),
    ``model.source`` (the folder it came from) and ``model.generation_config``
    (:class:`~minillm.generation_config.GenerationConfig`: generation_config.json's eos ids and defaults),
    and, with ``fast``, ``model.decode_path``: the decode path chosen for this machine
    (:mod:`minillm.fast.choose`: forced by MINILLM_DECODE_PATH, cached by ``minillm calibrate
    --decode-path``, or the rule); None without.

    Raises ModelNotFoundError (no such model), ConfigError (unsupported config.json),
    WeightsError (missing, unexpected or mis-shaped tensors), ValueError (bad dtype/device),
    QuantizationError (an unknown quantize format, or one this dtype/device cannot run).
    """
    if not isinstance(fast, bool):
        raise ValueError(f"fast must be True or False, got {fast!r}")
    check_quantize_args(quantize, device, dtype)  # before the (slow) load

    folder = resolve_model(name_or_path, weights_dir, download=True)
    config = ModelConfig.from_json(folder)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    with torch.device("meta"), _no_random_init():
        model = Transformer(config, attn_impl=attn_impl)
    state = to_minillm_names(read_safetensors(folder), config)
    _check_names_and_shapes(model, state, folder)
    model.load_state_dict({k: t.to(dtype) for k, t in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model.source = folder
    model.generation_config = GenerationConfig.from_folder(folder, config.eos_token_ids)  # stop ids, sampling defaults
    model = model.to(device).eval().requires_grad_(False)
    model.decode_path = None
    if quantize:
        quantize_model(model, quantize)
    if fast:
        choose_decode_path(model)  # the same weights, faster modules swapped in (minillm/fast: skip at first)
    return model


@contextmanager
def _no_random_init():
    """Skip nn.Embedding's random init while building: the checkpoint replaces every weight, and
    ``normal_`` on the meta device imports torch's symbolic-shapes stack (+70 MB of RSS for good)."""
    normal_ = torch.nn.init.normal_
    torch.nn.init.normal_ = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        torch.nn.init.normal_ = normal_


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: model.safetensors, or the shards its index lists."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = shard_names(index)
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ModelNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {folder}; "
            "minillm reads safetensors checkpoints (or .gguf files via 'minillm convert')"
        )
    tensors = {}
    for name in files:
        if not (folder / name).is_file():
            raise ModelNotFoundError(f"shard {name} listed in {index.name} is missing from {folder}")
        try:
            with safe_open(folder / name, framework="pt") as f:
                tensors.update({key: f.get_tensor(key) for key in f.keys()})
        except Exception as e:  # safetensors raises its own SafetensorError for a damaged file
            raise WeightsError(f"cannot read {folder / name} ({e}); download or convert it again") from None
    return tensors


def to_minillm_names(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename (and for GPT-2, transpose and split) HF tensors into this package's names.

    Unknown names are kept as they are, so the shape check can report them.
    """
    rename = _gpt2_name if config.model_type == "gpt2" else _llama_name
    out = {}
    for name, tensor in hf.items():
        if IGNORED.search(name):
            continue
        if config.tie_word_embeddings and name.endswith("lm_head.weight"):
            continue  # tied: the LM head *is* the embedding, stored once
        out.update(rename(name, tensor, config))
    return out


def _gpt2_name(name: str, t: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    name = name.removeprefix("transformer.")
    simple = {"wte.weight": "embed.weight", "wpe.weight": "pos_embed.weight", "lm_head.weight": "lm_head.weight"}
    if name in simple:
        return {simple[name]: t}
    if name.startswith("ln_f."):
        return {"ln_final." + name.removeprefix("ln_f."): t}
    m = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", name)
    if not m:
        return {name: t}
    layer, module, kind = m.groups()
    prefix = f"blocks.{layer}."
    if kind == "weight" and module in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        t = t.t()  # Conv1D [in, out] -> Linear [out, in]
    if module == "attn.c_attn":  # fused q, k, v along the output dimension
        q, k, v = t.split(config.d_model, dim=0)
        return {f"{prefix}attn.{p}_proj.{kind}": x.contiguous() for p, x in zip("qkv", (q, k, v))}
    ours = {"ln_1": "ln1", "ln_2": "ln2", "attn.c_proj": "attn.o_proj", "mlp.c_fc": "mlp.up_proj",
            "mlp.c_proj": "mlp.down_proj"}.get(module, module)
    return {f"{prefix}{ours}.{kind}": t.contiguous()}


def _llama_name(name: str, t: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    if name == "lm_head.weight":
        return {name: t}
    name = name.removeprefix("model.")
    simple = {"embed_tokens.weight": "embed.weight", "norm.weight": "ln_final.weight"}
    if name in simple:
        return {simple[name]: t}
    name = re.sub(r"^layers\.(\d+)\.", r"blocks.\1.", name)
    for theirs, ours in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2"), ("self_attn", "attn")):
        name = name.replace(f".{theirs}.", f".{ours}.")
    return {name: t}


def _check_names_and_shapes(model: Transformer, state: dict[str, torch.Tensor], folder: Path) -> None:
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    wrong = sorted(
        f"{k} {tuple(state[k].shape)} != {tuple(expected[k])}"
        for k in expected.keys() & state.keys()
        if state[k].shape != expected[k]
    )
    problems = [(label, names) for label, names in
                (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if names]
    if problems:
        detail = "; ".join(f"{label} tensors: {_short_list(names)}" for label, names in problems)
        raise WeightsError(f"checkpoint {folder} does not fit its config.json: {detail}")


def _short_list(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")
