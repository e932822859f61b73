"""`minillm whatif --tier-bandwidth`: load or recompute for the --prompt-tokens prefix, its printed numbers
against the formula (minillm/whatif.py's docstring)::

    bytes      = prefix · kv bytes per token     (2 · n_layers · n_kv_heads · head_dim · dtype bytes, from the
                                                  shipped config.json's own fields, computed here)
    load       = bytes / the tier's bandwidth
    recompute  = whatif.prefill_floor_s(prefix)  (one device's roofline floor)
    break-even = bytes / recompute

Printed with 4 significant digits, so compared within 1e-3 relative.
"""

import json
import re
from importlib import resources

import pytest

from minillm.cli import main
from minillm.hardware import PROFILES
from minillm.whatif import TIER_GB_S, load_config, prefill_floor_s


def kv_bytes_per_token(name: str, dtype_bytes: int) -> int:
    hf = json.loads((resources.files("minillm") / "configs" / f"{name}.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * dtype_bytes


def number(text: str) -> float:
    return float(text.replace(",", ""))


def whatif_rows(capsys, monkeypatch, *argv) -> dict[str, str]:
    """The load-or-recompute table's rows, {key: value}."""
    monkeypatch.setenv("COLUMNS", "250")  # one table row a line
    assert main(["whatif", *argv]) == 0
    out = capsys.readouterr().out
    table = out[out.index("load or recompute"):]
    return {m[1].strip(): m[2].strip() for m in re.finditer(r"│ ([^│]+?) +│ (.+?) +│", table)}


@pytest.mark.parametrize("name, hardware, dtype, dtype_bytes, prompt", [
    ("llama-3-8b", "h100", "bfloat16", 2, 2000),  # 131,072 B a token (2 · 32 · 8 · 128 · 2)
    ("smollm2-135m-instruct", "laptop-cpu", "float32", 4, 1500),  # 46,080 B a token (2 · 30 · 3 · 64 · 4)
])
def test_the_printed_numbers_are_the_formulas(capsys, monkeypatch, name, hardware, dtype, dtype_bytes, prompt):
    tiers = {"nvme": 5e9, "sata-ssd": 0.5e9, "pcie5": 64e9, "10gbe": 1.25e9, "lab": 3.2e9, "7 GB/s": 7e9,
             f"host ({hardware}'s memory)": PROFILES[hardware].mem_bandwidth / 2}
    rows = whatif_rows(capsys, monkeypatch, "--model", name, "--hardware", hardware, "--dtype", dtype,
                       "--prompt-tokens", str(prompt), "--tier-bandwidth", "nvme", "sata-ssd", "pcie5",
                       "--tier-bandwidth", "10gbe", "lab=3.2", "7", "host")
    kv_bytes = prompt * kv_bytes_per_token(name, dtype_bytes)
    recompute_s = prefill_floor_s(load_config(name), PROFILES[hardware], prompt, dtype_bytes)
    assert rows["KV bytes"].startswith(f"{kv_bytes:,} (")
    assert number(rows["recompute"].split(" ms")[0]) == pytest.approx(recompute_s * 1e3, rel=1e-3)
    assert number(rows["break-even"].split(" GB/s")[0]) == pytest.approx(kv_bytes / recompute_s / 1e9, rel=1e-3)
    assert [key for key in rows if key.startswith("load from")] == [f"load from {t}" for t in tiers]
    for tier, bytes_per_s in tiers.items():
        load_ms, gb_s, verdict = re.fullmatch(r"([\d,.]+) ms at ([\d,.]+) GB/s: (\w+), .*", rows[f"load from {tier}"]).groups()
        assert number(load_ms) == pytest.approx(kv_bytes / bytes_per_s * 1e3, rel=1e-3)
        assert number(gb_s) == pytest.approx(bytes_per_s / 1e9, rel=1e-3)
        assert verdict == ("load" if kv_bytes / bytes_per_s < recompute_s else "recompute")


def test_the_presets_are_the_documented_bandwidths():
    assert TIER_GB_S == {"pcie4": 32.0, "pcie5": 64.0, "nvme": 5.0, "sata-ssd": 0.5, "10gbe": 1.25, "100gbe": 12.5}


def test_an_h100_recomputes_rather_than_read_an_nvme_and_loads_from_pcie(capsys, monkeypatch):
    """The hand check: llama-3-8b, 2,000 tokens in bf16 = 262,144,000 B: 52.4 ms from NVMe at 5 GB/s, 4.1 ms over
    PCIe 5 at 64 GB/s, against a prefill floor of 2,000 · ~14.5 GFLOP / 989.4 TFLOP/s ≈ 29 ms."""
    rows = whatif_rows(capsys, monkeypatch, "--model", "llama-3-8b", "--tier-bandwidth", "nvme", "pcie5")
    assert rows["load from nvme"].startswith("52.43 ms at 5.000 GB/s: recompute")
    assert rows["load from pcie5"].startswith("4.096 ms at 64.00 GB/s: load")


@pytest.mark.parametrize("spec, message", [
    ("floppy", "--tier-bandwidth: unknown tier 'floppy'; give host, pcie4, pcie5, nvme, sata-ssd, 10gbe, 100gbe, a "
               "number of GB/s or NAME=GB/S"),
    ("0", "--tier-bandwidth: '0' is not a bandwidth > 0 GB/s"),
    ("disk=-1", "--tier-bandwidth: 'disk=-1' is not a bandwidth > 0 GB/s"),
    ("inf", "--tier-bandwidth: 'inf' is not a bandwidth > 0 GB/s"),
    ("nan", "--tier-bandwidth: 'nan' is not a bandwidth > 0 GB/s"),
    ("=5", "--tier-bandwidth: '=5' has no name before '='; give NAME=GB/S, e.g. nas=1.2"),
    ("fast=abc", "--tier-bandwidth: 'abc' is not a number of GB/s; give host, pcie4, pcie5, nvme, sata-ssd, 10gbe, "
                 "100gbe, a number of GB/s or NAME=GB/S"),
    ("x=1 x=2", "--tier-bandwidth: a tier is named twice (x); give each a name of its own"),
    ("nvme nvme", "--tier-bandwidth: a tier is named twice (nvme); give each a name of its own"),
])
def test_bad_tiers_are_one_line_usage_errors(capsys, spec, message):
    assert main(["whatif", "--model", "llama-3-8b", "--tier-bandwidth", *spec.split()]) == 2
    assert capsys.readouterr().err == f"minillm: error: {message}\n"
