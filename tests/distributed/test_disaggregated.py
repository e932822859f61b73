"""Disaggregated serving over 2 gloo processes on the CPU, against the colocated engine as the oracle.

One prefill worker and one decode worker (each loads the same tiny random-weight model from its
folder) serve a few prompts: every request's greedy tokens equal the colocated LLMEngine's in this
process, and the K/V bytes that crossed equal prompt tokens x kv_bytes_per_token (lesson 10's formula).
A decode worker killed mid-request must end the unfinished requests with a clear error, not hang.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from rich.console import Console
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import LLMEngine, SamplingParams, load_model
from minillm.bench.serving import DISAGGREGATED, ServingConfig, run_policy
from minillm.bench.workload import make_workload
from minillm.cli.bench_serving import _print_transfer
from minillm.distributed.disaggregated import DisaggregatedConfig, DisaggregatedEngine, WorkerDiedError
from minillm.distributed.disaggregated_transfer import gather_prompt_kv, scatter_prompt_kv
from minillm.serving.paged_cache import PagedKVCache
from minillm.units import fmt_bytes

pytestmark = pytest.mark.distributed

PROMPTS = [[3, 17, 42, 5, 99, 64, 1, 7], [11] * 21, [5, 9, 2], list(range(40, 77))]  # 1 to 3 blocks of 16
N_NEW = 6
CONFIG = DisaggregatedConfig(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory="1MiB", eos_token_ids=(),
                             timeout_s=20.0, start_timeout_s=60.0, link_probe_bytes=2**20)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    folder = save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("llama_gqa"))
    return load_model(folder, device="cpu")


@pytest.fixture(scope="module")
def engine(model):
    """One pair of workers for the file (starting them is most of its time); the last test kills one."""
    with DisaggregatedEngine(model, CONFIG) as engine:
        yield engine


def test_outputs_equal_colocated_and_bytes_follow_the_formula(model, engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=N_NEW)
    colocated = LLMEngine(model, kv_cache_memory="1MiB", max_num_batched_tokens=64, eos_token_ids=[],
                          enable_prefix_caching=False).generate(PROMPTS, params)
    first_only = SamplingParams(temperature=0.0, max_new_tokens=1)  # ends on the prefill worker: nothing crosses
    done = engine.generate(PROMPTS, params)
    [short] = engine.generate([PROMPTS[0]], first_only)
    summary = engine.transfer_summary()
    assert [r.output_ids for r in done] == [out.token_ids for out in colocated]
    assert all(r.finish_reason == "length" and len(r.token_times_s) == N_NEW for r in done)
    assert all(r.arrival_s <= r.first_scheduled_s <= r.token_times_s[0] for r in done)
    assert short.output_ids == colocated[0].token_ids[:1] and short.finish_reason == "length"
    # bytes = prompt positions x 2 (K, V) x n_layers x n_kv_heads x head_dim x 4 (float32)
    cfg = model.config
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    assert summary.kv_bytes_per_token == per_token
    assert sorted((h[0], h[1], h[2]) for h in engine.hand_offs) == sorted(
        (r.request_id, len(p), len(p) * per_token) for r, p in zip(done, PROMPTS))
    assert summary.num_bytes == sum(map(len, PROMPTS)) * per_token
    assert summary.num_hand_offs == len(PROMPTS) and summary.link_bytes_s > 0
    assert summary.predicted_s_per_token > 0
    # lesson 10's floor at the measured link: bytes per token / bytes per second
    assert summary.predicted_s_per_token == pytest.approx(per_token / summary.link_bytes_s, rel=1e-12)


def test_seeded_sampling_continues_where_the_prefill_worker_left_its_generator(model, engine):
    """The first token is drawn on the prefill worker, the rest on the decode worker: the generator's
    state crosses with the K/V, so a seeded request draws what it draws in one engine."""
    params = [SamplingParams(temperature=1.0, top_k=50, seed=seed, max_new_tokens=N_NEW) for seed in (1, 2, 3, 4)]
    colocated = LLMEngine(model, kv_cache_memory="1MiB", max_num_batched_tokens=64, eos_token_ids=[],
                          enable_prefix_caching=False).generate(PROMPTS, params)
    done = [engine.generate([prompt], p)[0] for prompt, p in zip(PROMPTS, params)]
    assert [r.output_ids for r in done] == [out.token_ids for out in colocated]
    assert len({tuple(r.output_ids) for r in done}) == len(PROMPTS)


def test_bench_serving_policy_gives_the_continuous_tokens(model):
    """``minillm bench-serving --policies continuous disaggregated``'s two runs, on a tiny workload."""
    workload = make_workload(3, "uniform:5-40", "4", seed=0, vocab_size=model.config.vocab_size)
    config = ServingConfig(max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory="1MiB")
    continuous = run_policy(model, workload, "continuous", config)
    disaggregated = run_policy(model, workload, DISAGGREGATED, config)
    assert disaggregated.output_ids() == continuous.output_ids()
    assert disaggregated.summary.n_completed == 3 and disaggregated.summary.total_output_tokens == 12
    transfer = disaggregated.to_dict()["transfer"]
    n_prompt = sum(len(w.prompt_ids) for w in workload)
    assert transfer["num_bytes"] == n_prompt * transfer["kv_bytes_per_token"]
    out = Console(width=400, record=True)
    _print_transfer(out, disaggregated)
    assert f"K/V of 3 prompts sent, {fmt_bytes(transfer['num_bytes'])} = {n_prompt} tokens x" in out.export_text()


def test_a_killed_decode_worker_ends_the_requests_with_an_error(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=100)
    ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
    while not all(engine.requests[i].output_ids for i in ids):  # both prefilled, decoding under way
        engine.poll(0.5)
    os.kill(engine.pids[1], signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match=r"the decode worker \(rank 1, pid \d+\) died \(killed by SIGKILL\)"):
        for _ in range(60):  # bounded: a hang fails as "DID NOT RAISE", never waits forever
            engine.poll(0.5)
    assert all(engine.requests[i].finish_reason == "error" for i in ids)
    assert "decode worker" in engine.requests[ids[0]].message


def test_gather_then_scatter_moves_exactly_the_filled_positions(model):
    """The K/V a hand-off carries, checked without processes: what lands in the second pool's blocks is
    the first pool's, position for position, and only the prompt's positions are sent."""
    torch.manual_seed(0)
    source = PagedKVCache.for_model(model, num_blocks=8, block_size=4, enable_prefix_caching=False)
    target = PagedKVCache.for_model(model, num_blocks=8, block_size=4, enable_prefix_caching=False)
    source.k.normal_(), source.v.normal_()
    source.allocator.allocate_slots("a", 3)  # take blocks so that the request's are not 0, 1, 2
    assert source.allocator.allocate_slots("r", 10)
    assert target.allocator.allocate_slots("x", 5) and target.allocator.allocate_slots("r", 10)
    table_s, table_t = source.allocator.block_tables["r"], target.allocator.block_tables["r"]
    k, v = gather_prompt_kv(source, table_s, 10)
    assert k.shape == (model.config.n_layers, 10, model.config.n_kv_heads, model.config.head_dim)
    scatter_prompt_kv(target, table_t, k, v)
    for p in range(10):
        for pool_s, pool_t in ((source.k, target.k), (source.v, target.v)):
            assert torch.equal(pool_s[:, table_s[p // 4], p % 4], pool_t[:, table_t[p // 4], p % 4])
