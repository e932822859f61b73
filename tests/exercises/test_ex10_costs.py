"""Exercise 10: KV cache bytes per token and the cost (FLOPs, bytes, intensity) of a decode step."""

from importlib.resources import files

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.cost_configs import configs
from exercises.differential import CHECKS, agree
from exercises.models import tiny_config
from exercises.registry import EXERCISES, reference
from minillm import ModelConfig
from minillm.costs import flops_per_token, weights_bytes

pytestmark = pytest.mark.ex10
LESSON = "lessons/05-compute-vs-memory-bound.md#arithmetic-intensity"
KV_LESSON = "lessons/03-kv-cache.md#how-big-is-the-kv-cache"
KV = "2 (K and V) · n_layers · n_kv_heads · head_dim · dtype_bytes"
DECODE = ("one step reads every weight once (shared by the whole batch), reads the cache's context_len "
          "positions and writes 1 new one, per sequence; FLOPs = flops_per_token(context_len) per sequence")


def llama3_8b() -> ModelConfig:
    return ModelConfig.from_json(files("minillm") / "configs" / "llama-3-8b.json")


def test_kv_bytes_llama_3_8b(impl):
    c = Case("kv_bytes_per_token(llama-3-8b, dtype_bytes=2)", "Llama-3-8B in bfloat16: 32 layers, 32 query heads, "
             "8 KV heads, head_dim 128", shapes="one token's K and V in every layer", lesson=KV_LESSON,
             hint=f"{KV} = 2 · 32 · 8 · 128 · 2 = 131,072 bytes (128 KiB per token)")
    c.equal(c.call(impl.kv_bytes_per_token, llama3_8b(), 2), 131072)


def test_kv_bytes_with_one_kv_head(impl):
    cfg = tiny_config("llama_mqa_tied")
    c = Case("kv_bytes_per_token(tiny MQA Llama, dtype_bytes=4)", "2 layers, 4 query heads, 1 KV head, head_dim 16",
             shapes="float32", hint=f"{KV} = 2 · 2 · 1 · 16 · 4 = 256: only the KV heads are cached",
             lesson=KV_LESSON)
    c.equal(c.call(impl.kv_bytes_per_token, cfg, 4), 256)


def expected_decode(cfg, context_len, dtype_bytes, batch_size):
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    w = weights_bytes(cfg, dtype_bytes)
    return dict(flops=batch_size * flops_per_token(cfg, context_len), weights_bytes=w,
                kv_read_bytes=kv * context_len * batch_size, kv_written_bytes=kv * batch_size,
                bytes=w + kv * (context_len + 1) * batch_size)


def check_decode(c, cost, expected):
    for field in ("flops", "weights_bytes", "kv_read_bytes", "kv_written_bytes", "bytes"):
        c.close(getattr(cost, field, None), float(expected[field]), hint=f"PhaseCost.{field}: {DECODE}")
    c.close(cost.arithmetic_intensity, expected["flops"] / expected["bytes"])


def test_decode_step_batch_1(impl):
    cfg = llama3_8b()
    c = Case("decode_cost(llama-3-8b, context_len=1000, dtype_bytes=2)", "one bfloat16 decode step, batch 1, "
             "1000 positions in the cache after the write", shapes="PhaseCost(flops, bytes, weights_bytes, "
             "kv_read_bytes, kv_written_bytes)", hint=DECODE, lesson=LESSON)
    cost = c.call(impl.decode_cost, cfg, 1000, 2)
    check_decode(c, cost, expected_decode(cfg, 1000, 2, 1))
    c.true(0.5 < cost.arithmetic_intensity < 2, "a batch-1 decode step should do about 1 FLOP per byte",
           expected="about 1 FLOP/byte (2 FLOPs per weight, 2 bytes per weight)", got=cost.arithmetic_intensity)


def test_decode_step_batch_16_reads_the_weights_once(impl):
    cfg = llama3_8b()
    c = Case("decode_cost(llama-3-8b, context_len=1000, dtype_bytes=2, batch_size=16)",
             "16 sequences decoded together", shapes="PhaseCost", lesson=LESSON,
             hint="batching: FLOPs and KV traffic grow with the batch, the weights are read once for all "
                  "16 sequences, so the arithmetic intensity grows almost 16x; " + DECODE)
    cost = c.call(impl.decode_cost, cfg, 1000, 2, 16)
    check_decode(c, cost, expected_decode(cfg, 1000, 2, 16))


def test_decode_step_reads_the_whole_cache(impl):
    cfg = tiny_config("llama_gqa")
    c = Case("decode_cost(tiny Llama GQA, context_len=100, dtype_bytes=4, batch_size=2)",
             "a tiny model where the KV cache is a large part of the bytes", shapes="PhaseCost", lesson=LESSON,
             hint="every decode step re-reads all context_len cached positions of every layer: that is why "
                  "TPOT grows with the context; " + DECODE)
    check_decode(c, c.call(impl.decode_cost, cfg, 100, 4, 2), expected_decode(cfg, 100, 4, 2))


def test_kv_bytes_with_an_explicit_head_dim(impl):
    cfg = tiny_config("llama_head_dim")
    c = Case("kv_bytes_per_token(tiny Llama, dtype_bytes=4)", "2 layers, 2 KV heads, head_dim 24 while d_model / "
             "n_heads = 64 / 4 = 16 (models like Gemma and Qwen3 set head_dim explicitly)", shapes="float32",
             hint=f"{KV} with config.head_dim = 2 · 2 · 2 · 24 · 4 = 768; never d_model // n_heads",
             lesson=KV_LESSON)
    c.equal(c.call(impl.kv_bytes_per_token, cfg, 4), 768)


def test_decode_cost_errors(impl):
    cfg = tiny_config("llama_gqa")
    for args, case in [((cfg, 0, 2), "context_len = 0"), ((cfg, 10, 2, 0), "batch_size = 0"),
                       ((cfg, -5, 2), "context_len = -5")]:
        c = Case(f"decode_cost(config, {', '.join(map(str, args[1:]))})", case, shapes="", lesson=LESSON,
                 hint="the docstring promises a ValueError for context_len < 1 or batch_size < 1 (a decode step "
                      "always attends to at least its own token)")
        c.raises(ValueError, impl.decode_cost, *args)


# -- differential checks (issue 30): every config, dtype, context and batch against the reference --------

REF = reference(EXERCISES["ex10"])


@given(data=st.data())
@CHECKS
def test_kv_bytes_agree_with_the_reference_on_every_config(impl, data):
    cfg = data.draw(configs(), label="config")
    dtype_bytes = data.draw(st.sampled_from([1, 2, 4]), label="dtype_bytes")
    agree(impl.kv_bytes_per_token, REF.kv_bytes_per_token, lambda: ((cfg, dtype_bytes), {}),
          what="kv_bytes_per_token", exercise="ex10", lesson=KV_LESSON,
          hint=f"{KV}, an int: only the KV heads are cached (n_kv_heads, not n_heads), with config.head_dim")


@given(data=st.data())
@CHECKS
def test_decode_cost_agrees_with_the_reference_on_every_config(impl, data):
    cfg = data.draw(configs(), label="config")
    windows = {cfg.window(layer) for layer in range(cfg.n_layers)} - {None}
    near = [w + d for w in windows for d in (-1, 0, 1, 2)]
    context_len = data.draw(st.sampled_from([1, 2] + near) | st.integers(-2, 40_000), label="context_len")
    dtype_bytes = data.draw(st.sampled_from([1, 2, 4]), label="dtype_bytes")
    batch_size = data.draw(st.integers(-1, 33), label="batch_size")
    agree(impl.decode_cost, REF.decode_cost, lambda: ((cfg, context_len, dtype_bytes, batch_size), {}),
          what="decode_cost", exercise="ex10", lesson=LESSON,
          hint=DECODE + "; a sliding-window layer reads only min(context_len, W) positions (and attends to as many "
               "keys), a layer without one all of them (config.window(layer) says which); ValueError for "
               "context_len < 1 or batch_size < 1")
