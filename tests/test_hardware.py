"""Roofline verdicts on hand-made cases, the datasheet table, and calibration's cache."""

import json

import pytest
import torch

from minillm.cli import main
from minillm.costs import PhaseCost
from minillm.hardware import (
    OVERHEAD_FACTOR,
    PROFILES,
    HardwareProfile,
    calibrate,
    calibration_path,
    get_hardware,
    load_calibration,
    roofline,
)

# 100 GFLOP/s, 10 GB/s: ridge at 10 FLOP/byte.
HW = HardwareProfile("toy", peak_flops=100e9, mem_bandwidth=10e9)


def test_ridge_point():
    assert HW.ridge_point == 10.0
    assert PROFILES["h100"].ridge_point == pytest.approx(989.4e12 / 3.35e12)


def test_compute_bound():
    cost = PhaseCost(flops=100e9, bytes=1e9)  # floors: compute 1 s, memory 0.1 s
    r = roofline(cost, time_s=1.25, hw=HW)
    assert (r.compute_floor_s, r.memory_floor_s, r.floor_s) == (1.0, 0.1, 1.0)
    assert r.bound == "compute-bound"
    assert r.roofline_fraction == pytest.approx(0.8)
    assert r.attained_flops == pytest.approx(80e9)
    assert r.attained_bandwidth == pytest.approx(0.8e9)
    assert "arithmetic" in r.explanation


def test_memory_bound():
    cost = PhaseCost(flops=1e9, bytes=10e9)  # floors: compute 0.01 s, memory 1 s
    r = roofline(cost, time_s=2.0, hw=HW)
    assert r.bound == "memory-bound"
    assert r.roofline_fraction == pytest.approx(0.5)
    assert r.arithmetic_intensity == pytest.approx(0.1)
    assert "bytes" in r.explanation


def test_overhead_bound():
    cost = PhaseCost(flops=1e9, bytes=10e9)
    r = roofline(cost, time_s=(OVERHEAD_FACTOR + 1) * 1.0, hw=HW)
    assert r.bound == "overhead-bound"
    assert "overhead" in r.explanation
    assert roofline(cost, time_s=OVERHEAD_FACTOR * 1.0, hw=HW).bound == "memory-bound"


def test_faster_than_the_floor_is_flagged():
    r = roofline(PhaseCost(flops=1e9, bytes=10e9), time_s=0.5, hw=HW)
    assert r.roofline_fraction == 2.0 and "faster than the floor" in r.explanation


def test_bad_time_raises():
    with pytest.raises(ValueError):
        roofline(PhaseCost(1.0, 1.0), 0.0, HW)


def test_profiles_are_sane():
    for name, hw in PROFILES.items():
        assert hw.name == name and hw.peak_flops > 1e11 and hw.mem_bandwidth > 1e10 and hw.description
        assert 1 < hw.ridge_point < 1000


def test_quick_calibration_measures_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path))
    assert load_calibration("cpu", torch.float32) is None
    hw = calibrate("cpu", torch.float32, quick=True)
    assert hw.peak_flops > 1e8 and hw.mem_bandwidth > 1e8
    assert calibration_path() == tmp_path / "calibration.json"
    assert "cpu/float32" in json.loads(calibration_path().read_text())
    assert load_calibration("cpu", "float32") == hw
    assert get_hardware("cpu", "float32", calibrate_if_missing=False) == hw
    with pytest.raises(LookupError):
        get_hardware("cpu", "float16", calibrate_if_missing=False)


def test_calibrating_the_meta_device_is_one_line_and_stores_nothing(tmp_path, monkeypatch, capsys):
    """It timed nothing and stored peaks of millions of GFLOP/s under "meta/float32"."""
    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path))
    with pytest.raises(ValueError, match="the meta device does none; use cpu, cuda or mps"):
        calibrate("meta", torch.float32, quick=True)
    assert main(["calibrate", "--device", "meta", "--quick"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("minillm: error: calibrate times real work") and err.count("\n") == 1, err
    assert not (tmp_path / "calibration.json").exists()


def test_calibration_from_other_hardware_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path))
    entry = {"device_name": "some other CPU", "profile": {"name": "x", "peak_flops": 1.0, "mem_bandwidth": 1.0}}
    (tmp_path / "calibration.json").write_text(json.dumps({"cpu/float32": entry}))
    assert load_calibration("cpu", torch.float32) is None


@pytest.mark.parametrize("cache", [
    [],                                                          # not an object at all
    {"cpu/float32": 7},                                          # an entry that is not an object
    {"cpu/float32": {"device_name": "HERE", "profile": 3}},      # a profile that is not an object
    {"cpu/float32": {"device_name": "HERE", "profile": {"name": "x", "peak_flops": "fast", "mem_bandwidth": 1.0}}},
    {"cpu/float32": {"device_name": "HERE", "profile": {"peak_flops": 1.0, "mem_bandwidth": 1.0}}},  # no name
])
def test_malformed_calibration_reads_as_never_measured(cache, tmp_path, monkeypatch):
    """A hand-edited calibration.json is measured again, as a missing one is, never an AttributeError."""
    from minillm.hardware import _device, device_name, load_measurement

    monkeypatch.setenv("MINILLM_WEIGHTS", str(tmp_path))
    text = json.dumps(cache).replace("HERE", device_name(_device("cpu")))
    (tmp_path / "calibration.json").write_text(text)
    assert load_calibration("cpu", torch.float32) is None
    assert load_measurement("decode_path/some-model", "cpu") is None
