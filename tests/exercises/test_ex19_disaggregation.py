"""Exercise 19: disaggregation's price, the prompt's K/V transfer time against the prefill time, per link."""

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.cost_configs import SHIPPED_NAMES, shipped
from exercises.differential import CHECKS, agree
from exercises.models import tiny_config
from exercises.registry import EXERCISES, reference
from minillm.costs import LINKS_GBIT_S, prefill_cost
from minillm.hardware import PROFILES, HardwareProfile

pytestmark = pytest.mark.ex19
PRICE = "lessons/10-disaggregation.md#the-price-moving-the-kv-cache"
LESSON = "lessons/10-disaggregation.md#when-splitting-pays-off"
REF = reference(EXERCISES["ex19"])
TRANSFER = ("bytes = prompt_tokens · 2 (K and V) · n_layers · n_kv_heads · head_dim · dtype_bytes; "
            "seconds = bytes / (link_gbit_s · 1e9 / 8): link speeds are quoted in BITS per second")
RATIO = ("transfer seconds / prefill seconds, the prefill's floor being max(FLOPs / peak_flops, bytes / "
         "mem_bandwidth) of prefill_cost(config, prompt_tokens, dtype_bytes): whichever bound is larger")


def oracle_ratio(cfg, prompt_tokens, dtype_bytes, link_gbit_s, hw):
    transfer = prompt_tokens * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes / (link_gbit_s / 8 * 1e9)
    cost = prefill_cost(cfg, prompt_tokens, dtype_bytes)
    return transfer / max(cost.flops / hw.peak_flops, cost.bytes / hw.mem_bandwidth)


# -- kv_transfer_seconds ----------------------------------------------------------------------------


def test_llama_3_8b_over_infiniband(impl):
    c = Case("kv_transfer_seconds(llama-3-8b, 2000, dtype_bytes=2, link_gbit_s=400)",
             "a 2,000-token prompt of Llama-3-8B in bfloat16 (32 layers, 8 KV heads, head_dim 128) over one "
             "InfiniBand NDR port", shapes="seconds, a float", lesson=PRICE,
             hint="2,000 · 131,072 bytes = 262,144,000 bytes; 400 Gb/s = 50 GB/s; 262.144e6 / 50e9 = 5.24288e-3 s. "
                  + TRANSFER)
    c.close(c.call(impl.kv_transfer_seconds, shipped("llama-3-8b"), 2000, 2, 400.0), 5.24288e-3, rtol=1e-9, atol=0)


def test_every_link_of_the_lesson(impl):
    expected = {"NVLink 4": 0.58254222e-3, "InfiniBand NDR": 5.24288e-3, "100 GbE": 20.97152e-3, "10 GbE": 209.7152e-3}
    for link, seconds in expected.items():
        c = Case(f"kv_transfer_seconds(llama-3-8b, 2000, 2, LINKS_GBIT_S[{link!r}] = {LINKS_GBIT_S[link]:g})",
                 f"lesson 10's table: 262 MB of K/V over {link}", shapes="seconds, a float", lesson=PRICE,
                 hint=f"{TRANSFER}; NVLink 4's 3,600 Gb/s is 450 GB/s, one direction")
        c.close(c.call(impl.kv_transfer_seconds, shipped("llama-3-8b"), 2000, 2, LINKS_GBIT_S[link]), seconds,
                rtol=1e-7, atol=0)


def test_only_the_kv_heads_of_every_layer_cross(impl):
    cfg = dataclasses.replace(tiny_config("llama_head_dim"), n_layers=3, n_kv_heads=1)
    c = Case("kv_transfer_seconds(tiny Llama, 10, dtype_bytes=4, link_gbit_s=8)", "3 layers, 4 query heads but 1 KV "
             "head, head_dim 24 while d_model / n_heads = 16; 8 Gb/s = 1e9 bytes/s", shapes="seconds, a float",
             lesson=PRICE, hint="10 tokens · 2 (K, V) · 3 layers · 1 KV head · 24 · 4 bytes = 5,760 bytes; / 1e9 bytes/s "
                                "= 5.76e-6 s: K and V, every layer, the KV heads (not the query heads), config.head_dim")
    c.close(c.call(impl.kv_transfer_seconds, cfg, 10, 4, 8.0), 5.76e-6, rtol=1e-9, atol=0)


def test_an_empty_prompt_sends_nothing(impl):
    c = Case("kv_transfer_seconds(llama-3-8b, 0, 2, 400)", "0 prompt tokens: nothing crosses", lesson=PRICE,
             shapes="seconds, a float", hint="0 bytes take 0.0 seconds (a float, not the int 0)")
    c.equal(c.call(impl.kv_transfer_seconds, shipped("llama-3-8b"), 0, 2, 400.0), 0.0)


def test_kv_transfer_errors(impl):
    cfg = shipped("llama-3-8b")
    for args, case in [((cfg, -1, 2, 400.0), "prompt_tokens = -1"), ((cfg, 10, 0, 400.0), "dtype_bytes = 0"),
                       ((cfg, 10, 2, 0.0), "link_gbit_s = 0"), ((cfg, 10, 2, -100.0), "link_gbit_s = -100"),
                       ((cfg, 10, 2, math.nan), "link_gbit_s = NaN")]:
        c = Case(f"kv_transfer_seconds(llama-3-8b, {', '.join(map(str, args[1:]))})", case, lesson=PRICE,
                 hint="the docstring promises a ValueError for prompt_tokens < 0, dtype_bytes < 1 or link_gbit_s "
                      "not > 0; NaN is not > 0 (write `not link_gbit_s > 0`, not `link_gbit_s <= 0`)")
        c.raises(ValueError, impl.kv_transfer_seconds, *args)


# -- transfer_vs_prefill ----------------------------------------------------------------------------


def test_ratio_llama_3_8b_on_an_h100(impl):
    for link, percent in {"NVLink 4": 1.99, "InfiniBand NDR": 17.91, "100 GbE": 71.63, "10 GbE": 716.29}.items():
        c = Case(f"transfer_vs_prefill(llama-3-8b, 2000, 2, {LINKS_GBIT_S[link]:g}, PROFILES['h100'])",
                 f"lesson 10's table: a 2,000-token prompt's K/V over {link} against its 29.3 ms prefill floor "
                 "(compute-bound)", shapes="a ratio, a float", lesson=LESSON, hint=RATIO)
        c.close(c.call(impl.transfer_vs_prefill, shipped("llama-3-8b"), 2000, 2, LINKS_GBIT_S[link], PROFILES["h100"]),
                percent / 100, rtol=1e-3, atol=0)


def test_ratio_of_a_short_memory_bound_prefill(impl):
    cfg, hw = shipped("llama-3-8b"), PROFILES["h100"]
    c = Case("transfer_vs_prefill(llama-3-8b, 16, 2, 400, PROFILES['h100'])", "a 16-token prompt: its prefill reads "
             "16 GB of weights for little arithmetic, so it is memory-bound (4.8 ms, not 0.23 ms of FLOPs)",
             shapes="a ratio, a float", lesson=LESSON, hint=RATIO)
    c.close(c.call(impl.transfer_vs_prefill, cfg, 16, 2, 400.0, hw), oracle_ratio(cfg, 16, 2, 400.0, hw),
            rtol=1e-9, atol=0)


def test_a_small_model_is_not_worth_splitting(impl):
    cfg, hw = shipped("smollm2-135m-instruct"), PROFILES["h100"]
    c = Case("transfer_vs_prefill(smollm2-135m-instruct, 2000, 2, 400, PROFILES['h100'])", "a small model has few "
             "FLOPs per byte of K/V: sending it over InfiniBand takes longer than recomputing it", lesson=LESSON,
             shapes="a ratio, a float", hint=RATIO + "; above 1: the transfer is slower than the prefill")
    got = c.call(impl.transfer_vs_prefill, cfg, 2000, 2, 400.0, hw)
    c.close(got, oracle_ratio(cfg, 2000, 2, 400.0, hw), rtol=1e-9, atol=0)
    c.true(got > 1, "the ratio should be above 1 (lesson 10: 162 %)", expected="about 1.6", got=got)


def test_ratio_errors(impl):
    cfg, hw = shipped("llama-3-8b"), PROFILES["h100"]
    for args, case in [((cfg, 0, 2, 400.0, hw), "prompt_tokens = 0: no prefill"),
                       ((cfg, -3, 2, 400.0, hw), "prompt_tokens = -3"),
                       ((cfg, 100, 2, 0.0, hw), "link_gbit_s = 0"), ((cfg, 100, 2, math.nan, hw), "link_gbit_s = NaN"),
                       ((cfg, 100, 0, 400.0, hw), "dtype_bytes = 0")]:
        c = Case(f"transfer_vs_prefill(llama-3-8b, {', '.join(map(str, args[1:4]))}, h100)", case, lesson=LESSON,
                 hint="the docstring promises a ValueError for prompt_tokens < 1, dtype_bytes < 1 or link_gbit_s "
                      "not > 0 (NaN included)")
        c.raises(ValueError, impl.transfer_vs_prefill, *args)


# -- differential: every config, prompt, dtype, link and GPU the docstrings allow, and every invalid one --

@st.composite
def configs(draw):
    """A shipped config, or a tiny one with any layers, heads, KV heads, head_dim and sliding window."""
    if draw(st.booleans(), label="shipped config"):
        return shipped(draw(st.sampled_from(SHIPPED_NAMES), label="config"))
    n_kv = draw(st.integers(1, 4), label="n_kv_heads")
    return dataclasses.replace(tiny_config("llama_gqa"), n_layers=draw(st.integers(1, 40), label="n_layers"),
                               n_heads=n_kv * draw(st.integers(1, 4), label="query heads per KV head"), n_kv_heads=n_kv,
                               head_dim=draw(st.sampled_from([8, 16, 24, 64, 128]), label="head_dim"),
                               sliding_window=draw(st.none() | st.integers(1, 64), label="sliding_window"))


VALID = {
    "prompt_tokens": lambda low: st.integers(low, 3) | st.integers(0, 200_000),
    "dtype_bytes": lambda low: st.sampled_from([1, 2, 4]),
    "link_gbit_s": lambda low: st.sampled_from(list(LINKS_GBIT_S.values())) | st.floats(1e-3, 1e5),
}
INVALID = {
    "prompt_tokens": lambda low: st.integers(-5, low - 1),
    "dtype_bytes": lambda low: st.sampled_from([0, -2]),
    "link_gbit_s": lambda low: st.sampled_from([0.0, -1.0, -400.0, math.nan]),
}


def arguments(data, low):
    """(prompt_tokens, dtype_bytes, link_gbit_s): all valid, or exactly one invalid (so each error is seen alone)."""
    broken = data.draw(st.sampled_from([None] * 3 + list(INVALID)), label="invalid argument")
    return tuple(data.draw((INVALID if name == broken else VALID)[name](low), label=name) for name in VALID)


@given(data=st.data())
@CHECKS
def test_transfer_agrees_with_the_reference(impl, data):
    cfg = data.draw(configs(), label="config")
    tokens, dtype_bytes, link = arguments(data, 0)
    agree(impl.kv_transfer_seconds, REF.kv_transfer_seconds, lambda: ((cfg, tokens, dtype_bytes, link), {}),
          what="kv_transfer_seconds", exercise="ex19", lesson=PRICE,
          hint=TRANSFER + "; a float (0.0 for no tokens); ValueError for prompt_tokens < 0, dtype_bytes < 1, "
                          "link_gbit_s not > 0 (NaN too)")


@given(data=st.data())
@CHECKS
def test_ratio_agrees_with_the_reference(impl, data):
    cfg = data.draw(configs(), label="config")
    tokens, dtype_bytes, link = arguments(data, 1)
    hw = data.draw(st.sampled_from(list(PROFILES.values())) | st.builds(
        HardwareProfile, st.just("made up"), st.floats(1e9, 2e15), st.floats(1e9, 1e13)), label="hw")
    agree(impl.transfer_vs_prefill, REF.transfer_vs_prefill, lambda: ((cfg, tokens, dtype_bytes, link, hw), {}),
          what="transfer_vs_prefill", exercise="ex19", lesson=LESSON,
          hint=RATIO + "; ValueError for prompt_tokens < 1, dtype_bytes < 1, link_gbit_s not > 0 (NaN too)")
