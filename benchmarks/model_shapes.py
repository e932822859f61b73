"""SmolLM2's larger shapes as model folders with random weights, for timing (not for text):

    python benchmarks/model_shapes.py 360m 1.7b      # -> <weights_dir>/random-shapes/smollm2-360m-shape, ...

Each folder holds a config.json with SmolLM2-360M's or SmolLM2-1.7B's public configuration
(huggingface.co/HuggingFaceTB/SmolLM2-360M and -1.7B, config.json), model.safetensors with random
bfloat16 weights (N(0, 0.02), norms 1: no denormals to slow a kernel; loading converts them to the
dtype asked for), and the 135M model's tokenizer (the three share SmolLM2's 49,152-token vocabulary).
A decode step reads every weight whatever its value, so its time is the real model's; the text is noise.
``minillm generate --model <folder>`` and ``load_model(<folder>)`` take them like any checkpoint.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from minillm.formats.weights import resolve_model
from minillm.paths import weights_dir

SHAPES = {  # the public configs' fields that decide the shape; the rest is 135M's (rope, eps, ids)
    "360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                 num_key_value_heads=5, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
}


def shape_folder(shape: str) -> Path:
    """Where :func:`make_shape` writes the folder of ``shape`` (a key of SHAPES)."""
    return weights_dir() / "random-shapes" / f"smollm2-{shape}-shape"


def make_shape(shape: str, seed: int = 0) -> Path:
    """Write (once) the folder of ``shape`` and return it. Raises ValueError for an unknown shape."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; use one of {', '.join(SHAPES)}")
    folder = shape_folder(shape)
    if (folder / "model.safetensors").is_file():
        return folder
    base = resolve_model("smollm2-135m-instruct", None, download=True)
    config = {**json.loads((base / "config.json").read_text()), **SHAPES[shape], "torch_dtype": "bfloat16"}
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, folder / name)
    save_file(_random_weights(config, seed), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # last: a folder with it is whole
    return folder


def _random_weights(c: dict, seed: int) -> dict[str, torch.Tensor]:
    """Llama's tensor names (HF), random bfloat16 matrices and unit norms; the LM head tied to the embedding."""
    g = torch.Generator().manual_seed(seed)
    d, head_dim = c["hidden_size"], c["head_dim"]
    q, kv, mlp = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim, c["intermediate_size"]

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * 0.02).bfloat16()

    weights = {"model.embed_tokens.weight": matrix(c["vocab_size"], d), "model.norm.weight": torch.ones(d).bfloat16()}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({p + "self_attn.q_proj.weight": matrix(q, d), p + "self_attn.k_proj.weight": matrix(kv, d),
                        p + "self_attn.v_proj.weight": matrix(kv, d), p + "self_attn.o_proj.weight": matrix(d, q),
                        p + "mlp.gate_proj.weight": matrix(mlp, d), p + "mlp.up_proj.weight": matrix(mlp, d),
                        p + "mlp.down_proj.weight": matrix(d, mlp),
                        p + "input_layernorm.weight": torch.ones(d).bfloat16(),
                        p + "post_attention_layernorm.weight": torch.ones(d).bfloat16()})
    return weights


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shapes", nargs="+", choices=list(SHAPES))
    for made in parser.parse_args().shapes:
        print(make_shape(made))
