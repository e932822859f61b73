"""Exercise 21: tensor parallelism, each rank's shards (whole heads, GQA groups) and the all-reduce bytes per layer.

The oracle for the shards is the unsplit layer: the ranks' partial outputs, computed with the
student's shards and added up (the all-reduce, here a plain sum in one process), must equal it.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.cost_configs import SHIPPED_NAMES, shipped
from exercises.differential import CHECKS, agree
from exercises.models import randn
from exercises.registry import EXERCISES, reference
from minillm.model import eager_attention

pytestmark = pytest.mark.ex21
SPLIT = "lessons/12-tensor-parallelism.md#the-megatron-split-of-one-layer"
COMM = "lessons/12-tensor-parallelism.md#the-communication-per-layer"
REF = reference(EXERCISES["ex21"])
COLUMN = ("a column-parallel layer keeps a block of whole ROWS of weight [out, in]: rank r of N holds rows "
          "r·out/N .. (r+1)·out/N - 1, i.e. units (heads of `unit` rows) r·U/N .. (r+1)·U/N - 1; ValueError "
          "when the units do not split N ways (a rank would hold part of a head), for a rank outside [0, N), "
          "world_size < 1, unit < 1 or out not a multiple of unit")
ROW = ("a row-parallel layer keeps a block of whole COLUMNS of weight [out, in]: weight[:, r·in/N : (r+1)·in/N], "
       "the same units (heads) the column-parallel layer before it produced on rank r; ValueError as for "
       "column_shard, and for a weight that is not 2-D")
HEADS = ("query heads r·H/N .. (r+1)·H/N - 1 and K/V heads r·Hkv/N .. (r+1)·Hkv/N - 1, each a contiguous "
         "block (as column_shard cuts q_proj and k_proj): with GQA, query head h reads K/V head h // (H/Hkv), "
         "which is then on the same rank; ValueError when N does not divide n_heads or n_kv_heads")
BYTES = ("per layer 2 all-reduces (after o_proj, after down_proj) of [n_tokens, d_model] in the model's dtype; "
         "a ring all-reduce sends 2(N-1)/N of the tensor from each rank: 2 · 2(N-1)/N · n_tokens · d_model · "
         "dtype_bytes, a float (0.0 for N = 1)")


def numbered(rows: int, cols: int) -> torch.Tensor:
    """weight[i, j] = 100·i + j: every row and column readable in a failure message."""
    return (100 * torch.arange(rows)[:, None] + torch.arange(cols)[None, :]).float()


# -- column_shard and row_shard: which rows and columns ---------------------------------------------


def test_q_proj_rows_of_each_rank(impl):
    w = numbered(12, 3)  # 4 heads of head_dim 3 (12 rows) reading d_model = 3
    for rank, rows in [(0, slice(0, 6)), (1, slice(6, 12))]:
        c = Case(f"column_shard(q_proj.weight [12, 3], rank={rank}, world_size=2, unit=3)",
                 "4 query heads of head_dim 3 split over 2 ranks: 2 whole heads each; weight[i, j] = 100·i + j",
                 shapes="weight [out = 4 heads x 3, in = 3] -> [6, 3]", hint=COLUMN, lesson=SPLIT)
        c.equal(c.call(impl.column_shard, w, rank, 2, 3), w[rows])


def test_gate_rows_of_the_last_of_four_ranks(impl):
    w = numbered(8, 2)
    c = Case("column_shard(gate_proj.weight [8, 2], rank=3, world_size=4)", "an MLP of 8 units over 4 ranks: rank 3 "
             "holds units 6 and 7; weight[i, j] = 100·i + j", shapes="[8, 2] -> [2, 2]", hint=COLUMN, lesson=SPLIT)
    c.equal(c.call(impl.column_shard, w, 3, 4), w[6:8])


def test_a_bias_is_split_like_its_rows(impl):
    b = torch.arange(12.0)
    c = Case("column_shard(q_proj.bias [12], rank=2, world_size=3, unit=4)", "a q/k/v bias (Qwen2, GPT-2): 3 heads "
             "of head_dim 4 over 3 ranks, one head each", shapes="[12] -> [4]", hint=COLUMN, lesson=SPLIT)
    c.equal(c.call(impl.column_shard, b, 2, 3, 4), b[8:12])


def test_o_proj_columns_of_each_rank(impl):
    w = numbered(3, 12)  # o_proj: d_model = 3 outputs, reading 4 heads x head_dim 3
    for rank, cols in [(0, slice(0, 6)), (1, slice(6, 12))]:
        c = Case(f"row_shard(o_proj.weight [3, 12], rank={rank}, world_size=2, unit=3)", "o_proj reads 4 heads of "
                 "head_dim 3; rank r holds the columns of its own 2 heads; weight[i, j] = 100·i + j",
                 shapes="weight [out = 3, in = 4 heads x 3] -> [3, 6]", hint=ROW, lesson=SPLIT)
        c.equal(c.call(impl.row_shard, w, rank, 2, 3), w[:, cols])


def test_heads_stay_whole(impl):
    w = numbered(6, 2)  # 2 heads of head_dim 3: 6 rows split 3 ways is 2 rows each, but 2 heads do not split 3 ways
    c = Case("column_shard(weight [6, 2], rank=0, world_size=3, unit=3)", "2 heads of head_dim 3 over 3 ranks: 6 rows "
             "would split into 2 each, cutting every head in pieces", hint=COLUMN, lesson=SPLIT)
    c.raises(ValueError, impl.column_shard, w, 0, 3, 3)
    c = Case("row_shard(weight [2, 6], rank=1, world_size=3, unit=3)", "o_proj reading 2 heads of head_dim 3, "
             "over 3 ranks", hint=ROW, lesson=SPLIT)
    c.raises(ValueError, impl.row_shard, w.T, 1, 3, 3)


def test_shard_errors(impl):
    w = numbered(8, 4)
    for args, case in [((w, 0, 0), "world_size = 0"), ((w, -1, 2), "rank = -1"), ((w, 2, 2), "rank = 2 of 2 ranks"),
                       ((w, 0, 3), "8 rows over 3 ranks"), ((w, 0, 2, 0), "unit = 0"),
                       ((w, 0, 1, 3), "8 rows are not whole units of 3")]:
        for fn, name, hint in [(impl.column_shard, "column_shard", COLUMN), (impl.row_shard, "row_shard", ROW)]:
            c = Case(f"{name}(weight [8, 4] or its transpose, {', '.join(map(str, args[1:]))})", case, hint=hint,
                     lesson=SPLIT)
            c.raises(ValueError, fn, w if name == "column_shard" else w.T.contiguous(), *args[1:])
    c = Case("row_shard(bias [8], rank=0, world_size=2)", "a 1-D bias has no columns: a row-parallel layer adds its "
             "bias once, after the all-reduce", hint=ROW, lesson=SPLIT)
    c.raises(ValueError, impl.row_shard, torch.arange(8.0), 0, 2)


# -- the shards compute the layer: partial outputs summed = the unsplit layer ----------------------


def swiglu_mlp_by_ranks(impl, x, gate, up, down, world_size):
    """Each rank's partial output of a SwiGLU MLP from the shards, and their sum (the all-reduce)."""
    partials = []
    for rank in range(world_size):
        g, u = impl.column_shard(gate, rank, world_size), impl.column_shard(up, rank, world_size)
        d = impl.row_shard(down, rank, world_size)
        partials.append(F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d))
    return partials, torch.stack(partials).sum(0)


def test_the_mlp_shards_add_up_to_the_mlp(impl):
    x, gate, up, down = randn(5, 8, seed=1), randn(12, 8, seed=2), randn(12, 8, seed=3), randn(8, 12, seed=4)
    want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    for n in (1, 2, 3, 4):
        c = Case(f"the MLP split over {n} ranks with column_shard (gate, up) and row_shard (down)",
                 "x [5 tokens, d_model 8], d_mlp 12: each rank computes down_r(silu(gate_r x) · up_r x), and the "
                 "all-reduce adds the ranks' partial sums", shapes="partial sums [5, 8] each; their sum [5, 8]",
                 hint="rank r's gate and up rows must be the units whose down_proj columns rank r holds: "
                      + COLUMN, lesson=SPLIT)
        _, got = c.call(swiglu_mlp_by_ranks, impl, x, gate, up, down, n)
        c.close(got, want, atol=1e-5, rtol=1e-5)


def gqa_attention_by_ranks(impl, x, wq, wk, wv, wo, n_heads, n_kv_heads, head_dim, world_size):
    """Each rank's attention output from its shards (its heads only), o_proj's partial sums added up."""
    total = 0
    for rank in range(world_size):
        q = F.linear(x, impl.column_shard(wq, rank, world_size, head_dim))
        k = F.linear(x, impl.column_shard(wk, rank, world_size, head_dim))
        v = F.linear(x, impl.column_shard(wv, rank, world_size, head_dim))
        heads = [t.view(1, x.shape[0], -1, head_dim).transpose(1, 2) for t in (q, k, v)]
        out = eager_attention(*heads).transpose(1, 2).reshape(x.shape[0], -1)
        total = total + F.linear(out, impl.row_shard(wo, rank, world_size, head_dim))
    return total


def test_the_attention_shards_add_up_to_attention(impl):
    H, Hkv, hd, d, T = 8, 4, 3, 10, 6  # GQA: 2 query heads per K/V head; head_dim 3, not d_model / n_heads
    x, wq, wo = randn(T, d, seed=5), randn(H * hd, d, seed=6), randn(d, H * hd, seed=9)
    wk, wv = randn(Hkv * hd, d, seed=7), randn(Hkv * hd, d, seed=8)
    full = [F.linear(x, w).view(1, T, -1, hd).transpose(1, 2) for w in (wq, wk, wv)]
    want = F.linear(eager_attention(*full).transpose(1, 2).reshape(T, H * hd), wo)
    for n in (1, 2, 4):
        c = Case(f"a GQA attention layer split over {n} ranks: q, k, v by column_shard(.., unit=head_dim), o by "
                 "row_shard(.., unit=head_dim)", f"{H} query heads, {Hkv} K/V heads (2 query heads per K/V head), "
                 f"head_dim {hd}, d_model {d}, {T} tokens, causal", shapes=f"x [{T}, {d}]; each rank: {H // n} query "
                 f"and {Hkv // n} K/V heads; o's partial sums [{T}, {d}] added up",
                 hint="each rank must hold whole heads, and the K/V heads its query heads read (their GQA group): "
                      "contiguous blocks of q_proj and of k_proj/v_proj rows do that; " + COLUMN, lesson=SPLIT)
        c.close(c.call(gqa_attention_by_ranks, impl, x, wq, wk, wv, wo, H, Hkv, hd, n), want, atol=1e-5, rtol=1e-5)


# -- heads_of_rank ---------------------------------------------------------------------------------


def test_heads_of_each_rank(impl):
    for name, n, rank, expected in [("smollm2-135m-instruct", 3, 1, (range(3, 6), range(1, 2))),
                                    ("llama-3-8b", 4, 3, (range(24, 32), range(6, 8))),
                                    ("llama-3-8b", 8, 0, (range(0, 4), range(0, 1))),
                                    ("gpt2-124m", 4, 2, (range(6, 9), range(6, 9)))]:
        cfg = shipped(name)
        c = Case(f"heads_of_rank({name}, rank={rank}, world_size={n})", f"{cfg.n_heads} query heads, {cfg.n_kv_heads} "
                 f"K/V heads over {n} ranks", shapes="(query heads, K/V heads): two ranges", hint=HEADS, lesson=SPLIT)
        c.equal(c.call(impl.heads_of_rank, cfg, rank, n), expected)


def test_every_query_head_finds_its_kv_head_on_its_rank(impl):
    cfg = dataclasses.replace(shipped("llama-3-8b"), n_heads=24, n_kv_heads=6)
    group = cfg.n_heads // cfg.n_kv_heads
    for n in (1, 2, 3, 6):
        seen = []
        for rank in range(n):
            c = Case(f"heads_of_rank(24 query heads, 6 K/V heads, rank={rank}, world_size={n})", "GQA groups of 4: "
                     "query head h reads K/V head h // 4, which must be on the same rank (attention needs no "
                     "communication)", shapes="(query heads, K/V heads): two ranges", hint=HEADS, lesson=SPLIT)
            q, kv = c.call(impl.heads_of_rank, cfg, rank, n)
            c.equal((q, kv), (range(rank * 24 // n, (rank + 1) * 24 // n), range(rank * 6 // n, (rank + 1) * 6 // n)))
            c.true(all(h // group in kv for h in q), "a query head's K/V head is on another rank", expected=kv, got=q)
            seen += list(q)
        c.equal(seen, list(range(24)), hint="the ranks together hold every query head once")


def test_heads_of_rank_errors(impl):
    cfg = shipped("smollm2-135m-instruct")
    for args, case in [((cfg, 0, 2), "9 query heads, 3 K/V heads over 2 ranks"),
                       ((cfg, 0, 9), "9 query heads over 9 ranks, but only 3 K/V heads"),
                       ((cfg, 3, 3), "rank 3 of 3 ranks"), ((cfg, -1, 3), "rank -1"), ((cfg, 0, 0), "world_size = 0")]:
        c = Case(f"heads_of_rank(smollm2-135m-instruct, rank={args[1]}, world_size={args[2]})", case, hint=HEADS,
                 lesson=SPLIT)
        c.raises(ValueError, impl.heads_of_rank, *args)


# -- all_reduce_bytes_per_layer --------------------------------------------------------------------


def test_bytes_of_a_decode_step(impl):
    c = Case("all_reduce_bytes_per_layer(smollm2-135m-instruct, n_tokens=1, world_size=2, dtype_bytes=2)",
             "one decode step of one sequence, bfloat16, 2 ranks: d_model 576", shapes="bytes, a float",
             hint="[1, 576] x 2 bytes = 1,152 bytes a tensor; 2(N-1)/N = 1 with N = 2; 2 all-reduces: 2,304. " + BYTES,
             lesson=COMM)
    c.close(c.call(impl.all_reduce_bytes_per_layer, shipped("smollm2-135m-instruct"), 1, 2, 2), 2304.0,
            rtol=1e-12, atol=0)


def test_bytes_of_a_long_prefill_over_8_ranks(impl):
    c = Case("all_reduce_bytes_per_layer(llama-3-8b, n_tokens=2000, world_size=8, dtype_bytes=2)",
             "a 2,000-token prefill of Llama-3-8B (d_model 4096, d_mlp 14336) over 8 GPUs, bfloat16",
             shapes="bytes, a float", hint="tensor = 2000 · 4096 · 2 = 16,384,000 bytes; each all-reduce sends "
                                            "2·7/8 of it; two a layer: 57,344,000. " + BYTES, lesson=COMM)
    c.close(c.call(impl.all_reduce_bytes_per_layer, shipped("llama-3-8b"), 2000, 8, 2), 57_344_000.0,
            rtol=1e-12, atol=0)


def test_bytes_the_trace_recorded(impl):
    c = Case("all_reduce_bytes_per_layer(smollm2-135m-instruct, n_tokens=5, world_size=3, dtype_bytes=4)",
             "what `minillm generate --tp 3 --trace-out` recorded for a 5-token prefill in float32: each layer's "
             "o_proj and down_proj all-reduce of [1, 5, 576] (11,520 bytes) with ring_bytes_per_rank 15,360",
             shapes="bytes, a float", hint="2 x 15,360 = 30,720. " + BYTES, lesson=COMM)
    c.close(c.call(impl.all_reduce_bytes_per_layer, shipped("smollm2-135m-instruct"), 5, 3, 4), 30720.0,
            rtol=1e-12, atol=0)


def test_one_rank_sends_nothing(impl):
    c = Case("all_reduce_bytes_per_layer(llama-3-8b, 100, world_size=1, dtype_bytes=2)", "one rank: no all-reduce",
             shapes="bytes, a float", hint="2(N-1)/N = 0 for N = 1: 0.0 (a float, not the int 0)", lesson=COMM)
    c.equal(c.call(impl.all_reduce_bytes_per_layer, shipped("llama-3-8b"), 100, 1, 2), 0.0)


def test_bytes_errors(impl):
    cfg = shipped("llama-3-8b")
    for args, case in [((cfg, -1, 2, 2), "n_tokens = -1"), ((cfg, 10, 0, 2), "world_size = 0"),
                       ((cfg, 10, 2, 0), "dtype_bytes = 0")]:
        c = Case(f"all_reduce_bytes_per_layer(llama-3-8b, {', '.join(map(str, args[1:]))})", case, lesson=COMM,
                 hint="the docstring promises a ValueError for n_tokens < 0, world_size < 1 or dtype_bytes < 1")
        c.raises(ValueError, impl.all_reduce_bytes_per_layer, *args)


# -- differential: every weight, rank, size, unit and dtype the docstrings allow, and every invalid one --


@st.composite
def shard_inputs(draw, transpose: bool):
    """(weight, rank, world_size, unit): usually valid, sometimes each kind of invalid."""
    world_size = draw(st.integers(1, 6), label="world_size")
    unit = draw(st.sampled_from([1, 1, 2, 3, 8]), label="unit")
    per_rank = draw(st.integers(1, 3), label="units per rank")
    units = world_size * per_rank
    broken = draw(st.sampled_from([None] * 6 + ["rank", "world_size", "unit", "units", "partial unit", "1-D"]),
                  label="invalid")
    rank = draw(st.integers(0, world_size - 1), label="rank")
    if broken == "rank":
        rank = draw(st.sampled_from([-1, world_size, world_size + 2]), label="bad rank")
    if broken == "world_size":
        world_size = draw(st.sampled_from([0, -1]), label="bad world_size")
    if broken == "units" and world_size > 1:
        units += 1  # the heads do not split N ways
    size = units * unit + (1 if broken == "partial unit" and unit > 1 else 0)
    if broken == "unit":
        unit = 0
    other = draw(st.integers(1, 5), label="the other dimension")
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int64]), label="dtype")
    w = (torch.arange(size * other) % 97).to(dtype).view(size, other)
    if broken == "1-D":
        return torch.arange(size).to(dtype), rank, world_size, unit
    return (w.T.contiguous() if transpose else w), rank, world_size, unit


@given(data=st.data())
@CHECKS
def test_column_shard_agrees_with_the_reference(impl, data):
    w, rank, n, unit = data.draw(shard_inputs(False), label="inputs")
    agree(impl.column_shard, REF.column_shard, lambda: ((w.clone(), rank, n, unit), {}), what="column_shard",
          exercise="ex21", lesson=SPLIT, hint=COLUMN + "; a 1-D bias is split like the rows")


@given(data=st.data())
@CHECKS
def test_row_shard_agrees_with_the_reference(impl, data):
    w, rank, n, unit = data.draw(shard_inputs(True), label="inputs")
    agree(impl.row_shard, REF.row_shard, lambda: ((w.clone(), rank, n, unit), {}), what="row_shard",
          exercise="ex21", lesson=SPLIT, hint=ROW)


@st.composite
def configs(draw):
    if draw(st.booleans(), label="shipped config"):
        return shipped(draw(st.sampled_from(SHIPPED_NAMES), label="config"))
    n_kv = draw(st.integers(1, 12), label="n_kv_heads")
    return dataclasses.replace(shipped("llama-3-8b"), n_kv_heads=n_kv,
                               n_heads=n_kv * draw(st.integers(1, 6), label="query heads per K/V head"),
                               d_model=draw(st.integers(1, 9000), label="d_model"))


@given(data=st.data())
@CHECKS
def test_heads_of_rank_agrees_with_the_reference(impl, data):
    cfg = data.draw(configs(), label="config")
    n = data.draw(st.integers(-1, 13), label="world_size")
    rank = data.draw(st.integers(-1, max(n, 0)), label="rank")
    agree(impl.heads_of_rank, REF.heads_of_rank, lambda: ((cfg, rank, n), {}), what="heads_of_rank",
          exercise="ex21", lesson=SPLIT, hint=HEADS + "; ValueError for world_size < 1 or a rank outside [0, N)")


@given(data=st.data())
@CHECKS
def test_bytes_agree_with_the_reference(impl, data):
    cfg = data.draw(configs(), label="config")
    n_tokens = data.draw(st.integers(-2, 3) | st.integers(0, 1_000_000), label="n_tokens")
    n = data.draw(st.integers(-1, 3) | st.sampled_from([4, 8, 16, 64]), label="world_size")
    dtype_bytes = data.draw(st.sampled_from([1, 2, 4, 0, -1]), label="dtype_bytes")
    agree(impl.all_reduce_bytes_per_layer, REF.all_reduce_bytes_per_layer,
          lambda: ((cfg, n_tokens, n, dtype_bytes), {}),
          what="all_reduce_bytes_per_layer", exercise="ex21", lesson=COMM,
          hint=BYTES + "; ValueError for n_tokens < 0, world_size < 1, dtype_bytes < 1", tol=(0.0, 1e-12))

