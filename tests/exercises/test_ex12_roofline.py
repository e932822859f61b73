"""Exercise 12: the cost of a prefill (FLOPs, bytes) and the roofline verdict (which bound applies)."""

import dataclasses
from importlib.resources import files

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.cost_configs import configs, shipped
from exercises.differential import CHECKS, agree
from exercises.models import tiny_config
from exercises.registry import EXERCISES, reference
from minillm import ModelConfig
from minillm.costs import PhaseCost, attention_params, decode_cost, lm_head_params, mlp_params, weights_bytes
from minillm.hardware import OVERHEAD_FACTOR, PROFILES, HardwareProfile, Roofline

pytestmark = pytest.mark.ex12
COST_LESSON = "lessons/05-compute-vs-memory-bound.md#arithmetic-intensity"
LESSON = "lessons/05-compute-vs-memory-bound.md#the-roofline"
PREFILL = ("per sequence: FLOPs = 2 · n_layers · (attention + MLP params) · n_tokens + 2 · lm_head params · "
           "(1 if last_only else n_tokens) + 4 · n_layers · n_heads · head_dim · (query-key pairs: "
           "n_tokens · cached_tokens + n_tokens · (n_tokens + 1) / 2, causal); times batch_size. Bytes: the weights "
           "ONCE for the whole batch, KV read of cached_tokens + n_tokens positions and KV written for n_tokens, "
           "both per sequence")
VERDICT = ("compute floor = flops / peak_flops, memory floor = bytes / mem_bandwidth, floor = the LARGER one "
           "(no implementation beats it) and it names the bound; a measured time above OVERHEAD_FACTOR (5) × floor "
           "is 'overhead-bound'; roofline_fraction = floor / time (1 = at the roof)")
TOY = HardwareProfile("toy", peak_flops=100e12, mem_bandwidth=1e12)  # ridge point 100 FLOP/byte


def llama3_8b() -> ModelConfig:
    return ModelConfig.from_json(files("minillm") / "configs" / "llama-3-8b.json")


def expected_prefill(cfg, n, dtype_bytes, cached=0, batch=1, last_only=True) -> dict:
    """The docstring's formula, term by term."""
    pairs = n * cached + n * (n + 1) / 2
    flops = (2 * cfg.n_layers * (attention_params(cfg) + mlp_params(cfg)) * n
             + 2 * lm_head_params(cfg) * (1 if last_only else n)
             + 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * pairs)
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    w = weights_bytes(cfg, dtype_bytes)
    read, written = kv * (cached + n) * batch, kv * n * batch
    return dict(flops=batch * flops, weights_bytes=w, kv_read_bytes=read, kv_written_bytes=written,
                bytes=w + read + written)


def check_cost(c, cost, expected):
    for field, value in expected.items():
        c.close(getattr(cost, field, None), float(value), hint=f"PhaseCost.{field}: {PREFILL}")


def test_prefill_of_a_long_prompt(impl):
    cfg = llama3_8b()
    c = Case("prefill_cost(llama-3-8b, n_tokens=4096, dtype_bytes=2)", "a 4096-token prompt in bfloat16, batch 1, "
             "empty cache", shapes="PhaseCost(flops, bytes, weights_bytes, kv_read_bytes, kv_written_bytes)",
             hint=PREFILL, lesson=COST_LESSON)
    cost = c.call(impl.prefill_cost, cfg, 4096, 2)
    check_cost(c, cost, expected_prefill(cfg, 4096, 2))
    c.true(cost.arithmetic_intensity > 1000, "a long prefill should do thousands of FLOPs per byte",
           expected="> 1000 FLOP/byte (every weight byte serves 4096 tokens)", got=cost.arithmetic_intensity)


def test_prefill_onto_a_long_cache_for_a_batch(impl):
    cfg = llama3_8b()
    c = Case("prefill_cost(llama-3-8b, n_tokens=100, dtype_bytes=2, cached_tokens=3000, batch_size=4)",
             "4 sequences each add 100 tokens after 3000 cached ones (a prefix-cache hit, or a chat's next turn)",
             shapes="PhaseCost", hint=PREFILL, lesson=COST_LESSON)
    check_cost(c, c.call(impl.prefill_cost, cfg, 100, 2, 3000, 4), expected_prefill(cfg, 100, 2, 3000, 4))


def test_prefill_every_position_with_an_explicit_head_dim(impl):
    cfg = tiny_config("llama_head_dim")
    c = Case("prefill_cost(tiny Llama, n_tokens=7, dtype_bytes=4, cached_tokens=5, batch_size=2, last_only=False)",
             "head_dim 24 while d_model / n_heads = 16 (like Gemma); the LM head on all 7 positions (as when "
             "scoring a prompt), float32", shapes="PhaseCost", lesson=COST_LESSON,
             hint="use config.head_dim, never d_model // n_heads; last_only=False runs the LM head on every "
                  "new token; " + PREFILL)
    check_cost(c, c.call(impl.prefill_cost, cfg, 7, 4, 5, 2, False), expected_prefill(cfg, 7, 4, 5, 2, False))


def test_prefill_cost_errors(impl):
    cfg = tiny_config("llama_gqa")
    for args, case in [((cfg, 0, 2), "n_tokens = 0"), ((cfg, 4, 2, -1), "cached_tokens = -1"),
                       ((cfg, 4, 2, 0, 0), "batch_size = 0")]:
        c = Case(f"prefill_cost(config, {', '.join(map(str, args[1:]))})", case, shapes="", lesson=COST_LESSON,
                 hint="the docstring promises a ValueError for n_tokens < 1, cached_tokens < 0 or batch_size < 1")
        c.raises(ValueError, impl.prefill_cost, *args)


def check_roofline(c, r, cost, time_s, hw, bound):
    compute_s, memory_s = cost.flops / hw.peak_flops, cost.bytes / hw.mem_bandwidth
    floor_s = max(compute_s, memory_s)
    expected = dict(time_s=time_s, arithmetic_intensity=cost.flops / cost.bytes, compute_floor_s=compute_s,
                    memory_floor_s=memory_s, floor_s=floor_s, attained_flops=cost.flops / time_s,
                    attained_bandwidth=cost.bytes / time_s, roofline_fraction=floor_s / time_s)
    for field, value in expected.items():
        c.close(getattr(r, field, None), value, rtol=1e-9, atol=0.0, hint=f"Roofline.{field}: {VERDICT}")
    c.equal(getattr(r, "bound", None), bound)


def test_verdicts_by_hand(impl):
    cases = [  # flops, bytes, time_s, bound
        (1e12, 1e9, 0.012, "compute-bound", "1 TFLOP and 1 GB: compute floor 10 ms > memory floor 1 ms; took 12 ms"),
        (1e10, 1e10, 0.020, "memory-bound", "10 GFLOP and 10 GB: memory floor 10 ms > compute floor 0.1 ms; 20 ms"),
        (1e10, 1e10, 0.049, "memory-bound", "the same, 49 ms: 4.9 × the floor is still the hardware's doing"),
        (1e10, 1e10, 0.051, "overhead-bound", "the same, 51 ms: 5.1 × the floor, more than OVERHEAD_FACTOR"),
    ]
    for flops, n_bytes, time_s, bound, case in cases:
        cost = PhaseCost(flops, n_bytes)
        c = Case(f"roofline(PhaseCost(flops={flops:g}, bytes={n_bytes:g}), time_s={time_s}, hw)",
                 case, shapes="hw: 100 TFLOP/s, 1 TB/s (ridge point 100 FLOP/byte)", hint=VERDICT, lesson=LESSON)
        check_roofline(c, c.call(impl.roofline, cost, time_s, TOY), cost, time_s, TOY, bound)


def test_prefill_is_compute_bound_and_decode_memory_bound(impl):
    cfg, h100 = llama3_8b(), PROFILES["h100"]
    c = Case("roofline(prefill_cost(llama-3-8b, 4096, 2), time, h100), then the same for a decode step",
             "Llama-3-8B in bfloat16 on an H100 (989 TFLOP/s, 3.35 TB/s: ridge 295 FLOP/byte), each phase measured "
             "at 1.5 × its floor", shapes="two Roofline verdicts", lesson=LESSON,
             hint="prefill does thousands of FLOPs per weight byte (above the ridge: compute-bound); a decode step "
                  "about 1 (below it: memory-bound); " + VERDICT)
    prefill = c.call(impl.prefill_cost, cfg, 4096, 2)
    decode = decode_cost(cfg, 4097, 2)
    for cost, bound in [(prefill, "compute-bound"), (decode, "memory-bound")]:
        time_s = 1.5 * max(cost.flops / h100.peak_flops, cost.bytes / h100.mem_bandwidth)
        check_roofline(c, c.call(impl.roofline, cost, time_s, h100), cost, time_s, h100, bound)


def test_roofline_errors(impl):
    for time_s in (0.0, -0.01):
        c = Case(f"roofline(cost, time_s={time_s}, hw)", "a phase that took no time (or less)", shapes="",
                 lesson=LESSON, hint="the docstring promises a ValueError for time_s <= 0 (no division by 0)")
        c.raises(ValueError, impl.roofline, PhaseCost(1e9, 1e9), time_s, TOY)


# -- sliding windows and differential checks (issue 30) ----------------------------------------------

REF = reference(EXERCISES["ex12"])
WINDOW = ("a sliding-window layer (config.window(layer) = W; None: full attention) reads only the positions some "
          "query of the pass still sees: min(cached_tokens + n_tokens, n_tokens + W - 1) (kv_positions_read); "
          "a decode step (n_tokens = 1) min(context, W)")


def test_mistral_decode_at_32k_reads_only_its_window(impl):
    cfg = shipped("mistral-7b")
    c = Case("prefill_cost(mistral-7b, n_tokens=1, dtype_bytes=2, cached_tokens=32767)",
             "a decode step of Mistral-7B at a 32k context: every layer has a 4096-token sliding window",
             shapes="PhaseCost", lesson=COST_LESSON,
             hint="each layer reads only the last 4096 positions, not all 32768: KV read = 32 layers · 4096 "
                  "positions · 4096 bytes (2 · 8 KV heads · 128 · 2 bytes) = 0.537 GB, so 15.0 GB a step with the "
                  "14.5 GB of weights, not 18.8 GB; " + WINDOW)
    cost = c.call(impl.prefill_cost, cfg, 1, 2, 32767)
    c.close(getattr(cost, "kv_read_bytes", None), 32 * 4096 * 4096.0)
    c.close(getattr(cost, "kv_written_bytes", None), 32 * 4096.0)
    c.close(getattr(cost, "bytes", None), 14483464192.0 + 32 * 4096 * 4096.0 + 32 * 4096.0)


@given(data=st.data())
@CHECKS
def test_prefill_cost_agrees_with_the_reference_on_every_config(impl, data):
    cfg = data.draw(configs(), label="config")
    windows = sorted({cfg.window(layer) for layer in range(cfg.n_layers)} - {None})
    near = [w + d for w in windows for d in (-1, 0, 1)]
    n_tokens = data.draw(st.sampled_from([1, 2] + near) | st.integers(-1, 300), label="n_tokens")
    cached = data.draw(st.sampled_from([0, 1, 32767] + near) | st.integers(-2, 40_000), label="cached_tokens")
    dtype_bytes = data.draw(st.sampled_from([1, 2, 4]), label="dtype_bytes")
    batch_size = data.draw(st.integers(-1, 9), label="batch_size")
    last_only = data.draw(st.booleans(), label="last_only")
    agree(impl.prefill_cost, REF.prefill_cost,
          lambda: ((cfg, n_tokens, dtype_bytes), {"cached_tokens": cached, "batch_size": batch_size,
                                                  "last_only": last_only}),
          what="prefill_cost", exercise="ex12", lesson=COST_LESSON,
          hint=PREFILL + "; " + WINDOW + "; the causal attention FLOPs count at most W keys a query there "
               "(attention_flops does); ValueError for n_tokens < 1, cached_tokens < 0 or batch_size < 1")


def _graded(fn):
    """fn with Roofline.explanation blanked: its words are free, the numbers and the bound are graded."""
    def call(*args, **kwargs):
        r = fn(*args, **kwargs)
        return dataclasses.replace(r, explanation="") if isinstance(r, Roofline) else r
    return call


@st.composite
def phases_on_hardware(draw):
    """A cost and a profile of powers of two times small ints: every floor, tie and 5 × floor is exact."""
    hw = HardwareProfile("toy", peak_flops=2.0 ** draw(st.integers(36, 50), label="log2 peak_flops"),
                         mem_bandwidth=2.0 ** draw(st.integers(30, 42), label="log2 mem_bandwidth"))
    n_bytes = draw(st.integers(1, 64), label="bytes / 2^k") * 2.0 ** draw(st.integers(20, 36), label="k")
    where = draw(st.sampled_from(["at the ridge", "just above", "just below", "anywhere"]), label="intensity")
    ridge_flops = n_bytes * hw.ridge_point
    flops = {"at the ridge": ridge_flops, "just above": ridge_flops * 65 / 64, "just below": ridge_flops * 63 / 64,
             "anywhere": draw(st.integers(1, 64), label="flops / 2^j") * 2.0 ** draw(st.integers(20, 56))}[where]
    return PhaseCost(flops, n_bytes), hw


@given(data=st.data())
@CHECKS
def test_roofline_agrees_with_the_reference_at_and_near_the_ridge(impl, data):
    cost, hw = data.draw(phases_on_hardware() | st.tuples(
        st.builds(PhaseCost, st.floats(1e6, 1e16), st.floats(1e6, 1e12)), st.sampled_from(list(PROFILES.values()))),
        label="(cost, hw)")
    floor_s = max(cost.flops / hw.peak_flops, cost.bytes / hw.mem_bandwidth)
    times = {"at the floor": floor_s, "OVERHEAD_FACTOR x floor": OVERHEAD_FACTOR * floor_s,
             "just above OVERHEAD_FACTOR x floor": OVERHEAD_FACTOR * floor_s * (1 + 1e-12),
             "just below OVERHEAD_FACTOR x floor": OVERHEAD_FACTOR * floor_s * (1 - 1e-12),
             "below the floor": floor_s / 3, "far above": floor_s * 40, "zero": 0.0, "negative": -floor_s}
    time_s = times[data.draw(st.sampled_from(list(times)), label="time_s")]
    agree(_graded(impl.roofline), _graded(REF.roofline), lambda: ((cost, time_s, hw), {}),
          what="roofline", exercise="ex12", lesson=LESSON,
          hint=VERDICT + "; at the ridge point the two floors are equal: compute-bound; exactly OVERHEAD_FACTOR × "
                         "floor is not yet overhead-bound (the time must EXCEED it); ValueError for time_s <= 0")
