"""What `minillm info` says about where the default weights come from: the GGUF's tensor types,
checked against the shapes the model's config implies."""

import re

import pytest

from minillm.formats import weights
from minillm.cli import main
from minillm.config import ModelConfig
from minillm.units import fmt_bytes


def expected_types(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """{type: (tensors, parameters)} of SmolLM2-135M-Instruct.Q4_1.gguf, from the config's shapes:
    the 7 attention/MLP matrices of each layer in Q4_1, the (tied) embedding in Q8_0, the norms in F32."""
    d, f, kv, L = config.d_model, config.d_mlp, config.n_kv_heads * config.head_dim, config.n_layers
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f  # q, o; k, v; gate, up, down
    return {"Q4_1": (7 * L, L * per_layer), "Q8_0": (1, config.vocab_size * d), "F32": (2 * L + 1, (2 * L + 1) * d)}


@pytest.mark.large
def test_gguf_tensor_types_of_the_default_model(smollm2_gguf, smollm2_dir):
    types = weights.gguf_tensor_types(smollm2_gguf)
    config = ModelConfig.from_json(smollm2_dir / "config.json")
    assert {t.type: (t.n_tensors, t.n_params) for t in types} == expected_types(config)
    assert [t.type for t in types] == ["Q4_1", "Q8_0", "F32"]  # most parameters first
    assert types[1].kinds == ("token_embd",) and types[2].kinds == ("attn_norm", "ffn_norm", "output_norm")


@pytest.mark.large
def test_source_gguf(smollm2_gguf, tmp_path):
    assert weights.source_gguf(smollm2_gguf) == smollm2_gguf  # a .gguf path is its own source
    assert weights.source_gguf(weights.DEFAULT_MODEL, smollm2_gguf.parent.parent) == smollm2_gguf
    assert weights.source_gguf(weights.DEFAULT_MODEL, tmp_path) is None  # not downloaded there
    assert weights.source_gguf("gpt2", smollm2_gguf.parent.parent) is None  # a hub model: safetensors


def test_gguf_tensor_types_of_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(weights.ModelNotFoundError, match="cannot read .* as GGUF"):
        weights.gguf_tensor_types(bad)


@pytest.mark.large
def test_info_names_the_quantisation_of_the_default_weights(smollm2_dir, smollm2_gguf, capsys):
    assert main(["info", "--weights-dir", str(smollm2_dir.parent)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    config = ModelConfig.from_json(smollm2_dir / "config.json")
    for name, (n, params) in expected_types(config).items():
        assert re.search(rf"│ {name} │ {n} │ {params:,} │", out), name
    assert f"converted from {smollm2_gguf.name} ({fmt_bytes(smollm2_gguf.stat().st_size)})" in out
    float32_bytes = 4 * sum(params for _, params in expected_types(config).values())  # 4 bytes a parameter
    printed_mib = float(re.search(r"dequantised to float32 \(([\d.]+) MiB\)", out).group(1))
    assert abs(printed_mib - float32_bytes / 2**20) < 0.1  # the file: the tensors plus a small JSON header
    assert "logits equal transformers loading this GGUF, not the original bf16 checkpoint's" in out


@pytest.mark.parametrize(("name", "rows"), [
    ("gpt2", {"positions": "learned", "biases": "q, k, v, o, MLP", "QK-norm": "no"}),
    ("llama3_scaling", {"positions": "RoPE theta=500000, llama3 scaling x8", "biases": "none", "QK-norm": "no"}),
    ("qwen2", {"positions": "RoPE theta=10000", "biases": "q, k, v", "QK-norm": "no"}),
    ("qwen3", {"biases": "none", "QK-norm": "RMSNorm on each q and k head, before RoPE"}),
    ("qwen3_bias", {"biases": "q, k, v, o", "QK-norm": "RMSNorm on each q and k head, before RoPE"}),
])  # fmt: skip
def test_info_shows_the_family_features(name, rows, tmp_path, capsys):
    """transformers' module list of the same config is the oracle for the biases and the norms."""
    from tiny_models import CONFIGS, build_hf, save_hf

    hf = build_hf(*CONFIGS[name])
    assert main(["info", "--model", str(save_hf(hf, tmp_path))]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for key, value in rows.items():
        assert f"│ {key} │ {value} " in out, key
    attn = hf.model.layers[0].self_attn if name != "gpt2" else None
    if attn is not None:  # what transformers built: biases and QK-norm modules
        assert (attn.q_proj.bias is not None, attn.o_proj.bias is not None) == (
            "q, k, v" in rows["biases"], "o" in rows["biases"].split(", "))
        assert hasattr(attn, "q_norm") == (rows["QK-norm"] != "no")


@pytest.mark.parametrize("fast", [True, False])
def test_info_prints_the_swap_table(fast, tmp_path, capsys, monkeypatch):
    """Every row of minillm.fast.SWAPS, and the decode path the model got (none with --no-fast)."""
    from tiny_models import CONFIGS, build_hf, save_hf

    from minillm.fast import SWAPS

    monkeypatch.setenv("COLUMNS", "400")  # one line a row (the longest "when" is ~230 characters)
    monkeypatch.setenv("MINILLM_DECODE_PATH", "row-major+split")
    folder = save_hf(build_hf(*CONFIGS["llama_gqa"]), tmp_path)
    assert main(["info", "--model", str(folder), "--fast" if fast else "--no-fast"]) == 0
    out = capsys.readouterr().out
    got = "decode path row-major+split" if fast else "none, --no-fast"
    assert f"the speed layer's swaps (this model: {got})" in out
    rows = [" ".join(line.replace("│", " ").split()) for line in out.splitlines()]
    for swap in SWAPS:
        course = swap.course.removeprefix("torch.") if swap.course.startswith("torch.") else swap.course.rpartition(".")[2]
        assert f"{course} {swap.fast.rpartition('.')[2]} {swap.when}" in rows, swap
