"""What-if predictions computed by hand, config lookup, and the whatif / calibrate CLI."""

import pytest

from minillm.cli import main
from minillm.costs import weights_bytes
from minillm.errors import ConfigError
from minillm.hardware import PROFILES
from minillm.whatif import example_configs, load_config, predict

H100 = PROFILES["h100"]
LLAMA3_PARAMS = 8_030_261_248
LLAMA3_KV = 131_072  # bf16 bytes per token


def test_tpot_floor_of_llama3_on_h100_is_weights_over_bandwidth():
    # One decode step at context 2: read 16.06 GB of bf16 weights + 2 KV positions, write 1.
    w = predict(load_config("llama-3-8b"), H100, prompt_tokens=1, output_tokens=2)
    by_hand = (2 * LLAMA3_PARAMS + 3 * LLAMA3_KV) / 3.35e12
    assert w.tpot_ms == pytest.approx(by_hand * 1e3, rel=1e-12)
    assert w.tpot_ms == pytest.approx(4.79, abs=0.01)
    assert w.decode_bound == "memory-bound"


def test_ttft_of_llama3_on_h100_by_hand():
    p = 2000
    layer_params = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    flops = 2 * p * layer_params + 2 * 4096 * 128256 + 4 * 32 * 32 * 128 * p * (p + 1) / 2
    w = predict(load_config("llama-3-8b"), H100, prompt_tokens=p, output_tokens=200)
    assert w.ttft_ms == pytest.approx(flops / 989.4e12 * 1e3, rel=1e-12)  # ≈ 29.3 ms
    assert w.prefill_bound == "compute-bound"
    assert w.e2e_ms == pytest.approx(w.ttft_ms + w.tpot_ms * 199)


def test_kv_and_weights_bytes_of_the_request():
    w = predict(load_config("llama-2-7b"), PROFILES["a100"], 1000, 24, dtype_bytes=2, batch_size=4)
    assert w.kv_bytes_per_token == 524_288
    assert w.kv_bytes_per_request == 1024 * 524_288
    assert w.weights_bytes == 2 * 6_738_415_616
    assert w.memory_bytes_needed == w.weights_bytes + 4 * w.kv_bytes_per_request
    assert w.fits_in_memory is True
    assert w.output_throughput_tok_s == pytest.approx(4 / (w.tpot_ms / 1e3))


def test_batching_amortises_weights():
    config = load_config("llama-3-8b")
    one = predict(config, H100, 100, 50)
    many = predict(config, H100, 100, 50, batch_size=64)
    assert many.tpot_ms < 2 * one.tpot_ms  # 64x the tokens for < 2x the step time
    assert many.output_throughput_tok_s > 30 * one.output_throughput_tok_s


def test_single_output_token_has_no_decode():
    w = predict(load_config("llama-3-8b"), H100, 10, 1)
    assert w.tpot_ms is None and w.decode_bound is None and w.e2e_ms == w.ttft_ms


def test_load_config_by_name_path_and_folder(tmp_path):
    assert {"llama-2-7b", "llama-3-8b"} <= set(example_configs())
    by_name = load_config("llama-3-8b")
    assert (by_name.n_kv_heads, by_name.d_mlp, by_name.vocab_size, by_name.rope_theta) == (8, 14336, 128256, 5e5)
    assert by_name.max_seq_len == 8192
    text = '{"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 10, "n_positions": 8}'
    (tmp_path / "config.json").write_text(text)
    assert load_config(str(tmp_path)) == load_config(str(tmp_path / "config.json"))
    assert weights_bytes(load_config(str(tmp_path)), 1) > 0
    with pytest.raises(ConfigError, match="llama-3-8b"):
        load_config("no-such-config")


def test_lessons_default_model_whatif_needs_no_download(tmp_path, monkeypatch, capsys):
    """Lesson 10 runs `minillm whatif --config smollm2-135m-instruct` on a fresh checkout: the
    config ships, so an empty weights directory is enough (23,040 K/V bytes a token: 30 layers,
    3 KV heads of 64, K and V, 2 bytes)."""
    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path))
    assert "smollm2-135m-instruct" in example_configs()
    assert main(["whatif", "--config", "smollm2-135m-instruct", "--hardware", "h100"]) == 0
    assert "23,040" in capsys.readouterr().out


def test_cli_whatif_prints_kv_bytes(capsys):
    assert main(["whatif", "--config", "llama-3-8b", "--hardware", "h100",
                 "--prompt-tokens", "2000", "--output-tokens", "200"]) == 0
    out = capsys.readouterr().out
    assert "131,072" in out and "memory-bound" in out and "compute-bound" in out


def test_cli_whatif_unknown_hardware_lists_known(capsys):
    assert main(["whatif", "--config", "llama-3-8b", "--hardware", "tpu-v9"]) == 2
    err = capsys.readouterr().err
    assert "h100" in err and "this" in err and err.count("\n") == 1


def test_cli_calibrate_quick_then_whatif_this(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path))
    assert main(["calibrate", "--quick"]) == 0
    assert "GFLOP/s" in capsys.readouterr().out
    assert (tmp_path / "calibration.json").is_file()
    assert main(["whatif", "--config", "llama-2-7b", "--hardware", "this", "--dtype", "float32",
                 "--prompt-tokens", "10", "--output-tokens", "3"]) == 0
    assert "1,048,576" in capsys.readouterr().out  # fp32 KV bytes per token of Llama-2-7B
    # without --dtype: what the model runs in on this CPU (float32), so the calibration above is used
    assert main(["whatif", "--config", "llama-2-7b", "--hardware", "this",
                 "--prompt-tokens", "10", "--output-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert "float32" in out and "1,048,576" in out and "measuring" not in err
