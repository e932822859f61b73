"""whatif with tensor parallelism: the ring all-reduce's α-β cost, and what N devices do to TTFT and TPOT."""

import pytest

from minillm.cli import main
from minillm.costs import all_reduce_seconds, tensor_parallel_comm_seconds, weights_bytes
from minillm.hardware import PROFILES
from minillm.whatif import load_config, predict

H100 = PROFILES["h100"]


def test_ring_all_reduce_by_hand():
    # 4 ranks: 2·3 = 6 steps of 5 µs, and 2·3/4 = 1.5 × 1 MB over 100 GB/s = 15 µs
    assert all_reduce_seconds(1e6, 4, 100.0, latency_s=5e-6) == pytest.approx(6 * 5e-6 + 1.5e6 / 100e9)
    assert all_reduce_seconds(1e6, 1, 100.0, latency_s=5e-6) == 0.0  # one rank sends nothing
    with pytest.raises(ValueError, match="interconnect_gb_s must be > 0"):
        all_reduce_seconds(1e6, 2, 0.0)


def test_a_pass_pays_two_all_reduces_a_layer():
    config = load_config("llama-3-8b")  # 32 layers, d_model 4096
    want = 2 * 32 * (2 * 1 / 2) * (100 * 4096 * 2) / 50e9  # N = 2: each rank sends half of 2 · the bytes
    assert tensor_parallel_comm_seconds(config, 100, 2, 2, 50.0) == pytest.approx(want)


def test_a_fast_link_halves_the_floors_and_a_slow_one_loses():
    config = load_config("llama-3-8b")
    one = predict(config, H100, 2000, 50)
    fast = predict(config, H100, 2000, 50, tensor_parallel_size=2, interconnect_gb_s=1e9)  # comm ≈ 0
    assert fast.ttft_ms == pytest.approx(one.ttft_ms / 2, rel=1e-6)
    assert fast.tpot_ms == pytest.approx(one.tpot_ms / 2, rel=1e-6)
    slow = predict(config, H100, 2000, 50, tensor_parallel_size=2, interconnect_gb_s=12.5)  # 100 GbE
    comm_ms = 2 * 32 * (2000 * 4096 * 2) / 12.5e9 * 1e3
    assert slow.prefill_comm_ms == pytest.approx(comm_ms)
    assert slow.ttft_ms == pytest.approx(one.ttft_ms / 2 + comm_ms) and slow.ttft_ms > one.ttft_ms
    step_ms = 2 * 32 * (4096 * 2) / 12.5e9 * 1e3
    assert slow.decode_comm_ms == pytest.approx(step_ms)
    assert slow.tpot_ms == pytest.approx(one.tpot_ms / 2 + step_ms)


def test_each_device_holds_its_share_and_the_whole_embedding():
    config = load_config("llama-3-8b")
    w = predict(config, H100, 1000, 1000, tensor_parallel_size=4, interconnect_gb_s=450.0)
    embed = 128256 * 4096 * 2
    kv = 2000 * 2 * 32 * 8 * 128 * 2
    assert w.memory_bytes_needed == int((weights_bytes(config, 2) - embed + kv) / 4 + embed)


def test_cli_whatif_tensor_parallel(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one table row a line
    assert main(["whatif", "--model", "llama-3-8b", "--hardware", "h100", "--tensor-parallel-size", "2",
                 "--interconnect-gb-s", "12.5"]) == 0
    out = capsys.readouterr().out
    assert "all-reduces" in out and "the all-reduces cost more than the split saves" in out


@pytest.mark.parametrize("argv, message", [
    (["--tp", "2"], "--tensor-parallel-size > 1 needs --interconnect-gb-s > 0"),
    (["--tp", "3", "--interconnect-gb-s", "450"], "tensor-parallel size 3 does not divide this model's n_heads = 32"),
    (["--tp", "0"], "minillm: error: --tensor-parallel-size must be >= 1, got 0\n"),  # the one wrong flag only
    (["--tp", "2", "--interconnect-gb-s", "inf"], "minillm: error: --interconnect-gb-s must be a finite number, got inf"),
    (["--tp", "2", "--interconnect-gb-s", "450", "--interconnect-latency-us", "nan"],
     "minillm: error: --interconnect-latency-us must be a finite number, got nan"),
])
def test_cli_whatif_tensor_parallel_refusals(capsys, argv, message):
    assert main(["whatif", "--model", "llama-3-8b", *argv]) in (1, 2)
    assert message in capsys.readouterr().err
