"""The serving benchmark (minillm/bench/serving.py) and `minillm bench-serving`, on a tiny random model.

What is checked is what the benchmark promises, never its speed: every policy gives every
request its full output (the same greedy tokens), each policy keeps its own rule (one at a
time; a static batch admits nobody until it ends), the summaries add up by hand, and the
CLI runs end to end or fails in one line.
"""

import json
import math
import shutil

import pytest
import torch
from tiny_models import CONFIGS, LLAMA_BASE, build_hf, save_hf

from minillm.formats import trace_events
from minillm.cli import main
from minillm.config import ModelConfig
from minillm.model import Transformer
from minillm.bench import serving as sb
from minillm.bench.workload import make_workload


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: on a CPU shared with other jobs a tiny model runs 10x faster than on two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    family, kwargs = CONFIGS["llama_gqa"]
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_hf(dict(kwargs, model_type=family))).eval()


CONFIG = sb.ServingConfig(max_num_seqs=2, max_num_batched_tokens=16, kv_cache_memory="1MiB", block_size=4,
                          ttft_slo_ms=1e6, tpot_slo_ms=1e6)


@pytest.fixture(scope="module")
def offline_runs(model):
    """Every policy on 5 offline requests: prompts 3-20 tokens (some longer than the budget of 16), 2-6 outputs."""
    torch.set_num_threads(1)
    workload = make_workload(5, "uniform:3-20", "uniform:2-6", seed=1, vocab_size=128)
    return workload, sb.run_serving_bench(model, {sb.OFFLINE: workload}, config=CONFIG)


def test_every_policy_gives_every_request_its_full_output(offline_runs):
    workload, result = offline_runs
    assert [r.policy for r in result.runs] == list(sb.POLICIES)
    reference = result.runs[0].output_ids()
    for run in result.runs:
        assert [len(r.output_ids) for r in run.requests] == [w.max_tokens for w in workload], run.policy
        assert run.output_ids() == reference, run.policy  # greedy: the same tokens, whatever the batching
        assert {r.finish_reason for r in run.requests} == {"length"}


def test_summaries_add_up_by_hand(offline_runs):
    workload, result = offline_runs
    for run in result.runs:
        s = run.summary
        assert s.n_requests == s.n_completed == 5 and s.n_aborted == 0
        assert s.total_output_tokens == sum(w.max_tokens for w in workload)
        assert s.total_input_tokens == sum(len(w.prompt_ids) for w in workload)
        last = max(r.token_times_s[-1] for r in run.requests)
        assert s.duration_s == pytest.approx(last - min(r.arrival_s for r in run.requests))
        assert s.output_throughput_tok_s == pytest.approx(s.total_output_tokens / s.duration_s)
        assert s.slo_attainment == 1.0 and s.goodput_req_s == pytest.approx(5 / s.duration_s)
    rows = result.rows()
    assert rows[1]["policy"] == "static" and rows[1]["rate_req_s"] == math.inf and "p99_itl_ms" in rows[1]


def test_one_at_a_time_starts_each_request_after_the_last_one_ended(offline_runs):
    run = offline_runs[1].run("one-at-a-time", sb.OFFLINE)
    for before, after in zip(run.requests, run.requests[1:]):
        assert after.first_scheduled_s >= before.token_times_s[-1]
    assert len(run.steps) == sum(len(r.output_ids) for r in run.requests)  # a step per token
    assert run.kv_memory is None


def test_a_static_batch_admits_nobody_until_it_has_finished(offline_runs):
    run = offline_runs[1].run("static", sb.OFFLINE)
    batches = [run.requests[0:2], run.requests[2:4], run.requests[4:]]  # max_num_seqs 2, arrival order
    for batch, nxt in zip(batches, batches[1:]):
        assert min(r.first_scheduled_s for r in nxt) >= max(r.finish_s for r in batch)
    prefill_steps = [s for s in run.steps if s.num_prefill_tokens]
    assert len(prefill_steps) == 3  # one per batch: its whole prompts at once
    for step, batch in zip(prefill_steps, batches):
        assert [rid for rid, _, _ in step.scheduled] == [r.request_id for r in batch]
        assert step.num_prefill_tokens == sum(r.num_prompt_tokens for r in batch)


def test_a_static_batch_keeps_its_finished_rows_as_padding_until_the_longest_ends(offline_runs):
    workload, result = offline_runs
    run = result.run("static", sb.OFFLINE)
    for ids in (["0", "1"], ["2", "3"], ["4"]):
        steps = [s for s in run.steps if {rid for rid, _, _ in s.scheduled} & set(ids)]
        assert all(sorted(rid for rid, _, _ in s.scheduled) == ids for s in steps)  # every row, every step
        assert len(steps) == max(workload[int(i)].max_tokens for i in ids)  # prefill + decodes of the longest
        for i in ids:  # answered with its own tokens, at its own last one
            request = run.requests[int(i)]
            assert len(request.output_ids) == workload[int(i)].max_tokens
            assert request.finish_s == request.token_times_s[-1] <= steps[-1].end_s


def test_continuous_chunks_only_with_chunked_prefill(offline_runs):
    workload, result = offline_runs
    prompts = {str(i): len(w.prompt_ids) for i, w in enumerate(workload)}
    for policy, chunked in (("continuous", False), ("continuous+chunked", True)):
        run = result.run(policy, sb.OFFLINE)
        prefill_rows = [(rid, p) for s in run.steps for rid, p, _ in s.scheduled if p]
        cut = any(p < prompts[rid] for rid, p in prefill_rows)
        assert cut == chunked, policy  # prompts of up to 20 tokens, budget 16


def test_kv_memory_at_the_peak_is_the_held_tokens_rounded_up_to_blocks(offline_runs, model):
    cfg = model.config
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    for run in offline_runs[1].runs[1:]:
        m = run.kv_memory
        assert m.paged_bytes == m.num_blocks_used * CONFIG.block_size * per_token
        assert m.held_bytes == m.held_tokens * per_token
        # each running request wastes at most block_size - 1 positions of its last block
        assert m.held_tokens <= m.num_blocks_used * CONFIG.block_size <= m.held_tokens + m.num_running * 3
        assert m.max_seq_len_bytes == m.num_running * cfg.max_seq_len * per_token


def test_ratios_divide_the_runs_summaries(offline_runs):
    result = offline_runs[1]
    by = {r.policy: r.summary for r in result.runs}
    [cont, chunked] = sb.policy_ratios(result.runs)
    assert cont["policy"] == "continuous" and chunked["policy"] == "continuous+chunked"
    assert cont["output_tok_s_vs_static"] == pytest.approx(
        by["continuous"].output_throughput_tok_s / by["static"].output_throughput_tok_s)
    assert chunked["goodput_vs_one_at_a_time"] == pytest.approx(
        by["continuous+chunked"].goodput_req_s / by["one-at-a-time"].goodput_req_s)
    json.dumps(result.to_dict())  # every number is JSON


def test_requests_arrive_in_real_time(model):
    workload = make_workload(3, "4", "2", rate=50, seed=0, vocab_size=128)
    run = sb.run_policy(model, workload, "continuous", CONFIG, rate_req_s=50)
    t0 = min(r.arrival_s for r in run.requests)
    for w, r in zip(workload, run.requests):
        assert r.arrival_s - t0 == pytest.approx(w.arrival_s)
        assert r.first_scheduled_s >= r.arrival_s  # nobody is served before it arrives


def test_chunked_prefill_experiment_cuts_the_long_prompt_into_chunks(model):
    c = sb.run_chunked_prefill_experiment(model, n_short=2, short_prompt_len=4, short_output_len=6,
                                          long_prompt_len=40, chunk_budget=16, join_after=2)
    assert c.long_prefill_steps == {"no chunking": 1, "chunked": 3}  # 40 tokens: 14 + 14 + 12 next to 2 decodes
    assert c.budgets == {"no chunking": 42, "chunked": 16}
    assert all(len(gaps) == 2 * 5 for gaps in c.itl_ms.values())  # 2 requests, 6 tokens, 5 gaps each
    assert c.p99_ratio == pytest.approx(c.p99_itl_ms["no chunking"] / c.p99_itl_ms["chunked"])


def test_unknown_policy_is_a_value_error(model):
    with pytest.raises(ValueError, match="unknown policy 'batched'"):
        sb.run_policy(model, make_workload(1, "4", "2", vocab_size=128), "batched")


# -- the CLI -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with SmolLM2's tokenizer (its vocabulary size)."""
    folder = save_hf(build_hf("llama", dict(LLAMA_BASE, vocab_size=49152)), tmp_path_factory.mktemp("tiny_serving"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder


@pytest.mark.large
def test_cli_runs_every_policy_and_writes_json_plots_and_trace(tiny_folder, tmp_path, capsys):
    args = ["bench-serving", "--model", str(tiny_folder), "--quick", "--num-prompts", "3", "--input-len", "uniform:4-12",
            "--output-len", "3", "--request-rate", "100", "inf", "--long-prompt-len", "40",
            "--max-num-batched-tokens", "16", "--kv-cache-memory", "4MiB", "--threads", "1", "--json", str(tmp_path / "r.json"),
            "--plots", str(tmp_path), "--trace-out", str(tmp_path / "trace.json")]
    assert main(args) == 0
    out, err = capsys.readouterr()
    for policy in sb.POLICIES:
        assert policy in out
    assert "output tok/s vs one-at-a-time" in out and "Chunked prefill" in out and "load average" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert len(data["runs"]) == 8 and data["runs"][0]["rate_req_s"] == 100.0 and data["runs"][4]["rate_req_s"] == "inf"
    assert all(r["summary"]["total_output_tokens"] == 9 for r in data["runs"])
    assert data["chunked_prefill"]["long_prefill_steps"]["no chunking"] == 1
    for name in ("serving_rate_sweep.png", "serving_timeline.png", "serving_itl.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    trace_events.validate(json.loads((tmp_path / "trace.json").read_text()))
    assert f"wrote {tmp_path / 'r.json'}" in err


@pytest.mark.large
def test_cli_prints_no_ratio_against_a_policy_it_did_not_run(tiny_folder, capsys):
    args = ["bench-serving", "--model", str(tiny_folder), "--quick", "--num-prompts", "2", "--input-len", "4",
            "--output-len", "2", "--long-prompt-len", "0", "--threads", "1", "--kv-cache-memory", "4MiB"]
    assert main([*args, "--policies", "continuous", "static"]) == 0
    out = capsys.readouterr().out
    assert "- continuous @ inf: vs static x" in out and "goodput vs" not in out  # (was: 'goodput vs ... n/a')
    assert main([*args, "--policies", "continuous+chunked"]) == 0
    assert "Ratios" not in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--request-rate", "0"], "--request-rate: '0' is not a rate"),
    (["--request-rate", "fast"], "--request-rate: 'fast' is not a rate"),
    (["--request-rate", "2", "2"], "--request-rate lists 2 twice"),
    (["--input-len", "uniform:9-2"], "--input-len: bad length spec 'uniform:9-2'"),
    (["--policies", "batched"], "invalid choice: 'batched'"),
    (["--policies", "static", "static"], "--policies lists static more than once"),
    (["--max-num-batched-tokens", "8"], "--max-num-batched-tokens (8) must be at least one block"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory: KV cache memory must be a size"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--ttft-slo-ms", "-1"], "--ttft-slo-ms must be a number of milliseconds > 0"),
    (["--trace-out", "run.txt"], "--trace-out: run.txt must end in .json"),
    (["--dataset", "no-such.jsonl"], "--dataset: no file no-such.jsonl"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--kv-offload-memory", "much"], "--kv-offload-memory: the host tier's size must be a size"),
    (["--kv-offload-dir", "/dev/null"], "--kv-offload-dir: /dev/null exists and is not a folder"),
])
def test_bad_options_are_one_line_usage_errors(args, message, capsys):
    assert main(["bench-serving", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.large
def test_server_only_options_are_said_to_have_no_effect_in_process(tiny_folder, capsys):
    args = ["bench-serving", "--model", str(tiny_folder), "--quick", "--num-prompts", "1", "--input-len", "4",
            "--output-len", "2", "--long-prompt-len", "0", "--threads", "1", "--policies", "continuous"]
    assert main([*args, "--timeout", "5", "--tokenizer", "x"]) == 0
    err = capsys.readouterr().err
    assert "--tokenizer has no effect without --base-url" in err and "--timeout has no effect without --base-url" in err


@pytest.mark.large
def test_requests_beyond_the_context_are_a_usage_error(tiny_folder, capsys):
    assert main(["bench-serving", "--model", str(tiny_folder), "--quick", "--input-len", "120"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exceeds the model's context (128)" in err


def test_before_step_runs_before_every_forward_pass(model):
    """bench-serving's thread governor (minillm/cpu_policy.py) is called between the passes of each policy here."""
    workload = make_workload(3, "4", "3", seed=1, vocab_size=128)
    for policy in ("one-at-a-time", "continuous"):
        calls = []
        run = sb.run_policy(model, workload, policy, CONFIG, before_step=lambda: calls.append(1))
        # one-at-a-time: a pass per output token (the prefill gives the first); continuous: one per engine step
        passes = sum(len(r.output_ids) for r in run.requests) if policy == "one-at-a-time" else len(run.steps)
        assert len(calls) == passes, policy


def test_kv_tiers_the_engine_refuses_are_its_one_line_error(tiny_folder, tmp_path, capsys):
    """A host tier too small for one block passes the size check; the engine's ValueError says why, in the
    command's error line (exit 1), before any run."""
    args = ["bench-serving", "--model", str(tiny_folder), "--num-prompts", "1", "--input-len", "4", "--output-len",
            "2", "--long-prompt-len", "0", "--threads", "1", "--policies", "continuous", "--quiet"]
    assert main([*args, "--kv-offload-memory", "1KiB"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("minillm: error: kv_offload_memory '1KiB' holds no block") and err.count("\n") == 1


@pytest.mark.large
def test_each_run_writes_its_own_disk_tier_and_a_second_command_finds_it_warm(tiny_folder, tmp_path, capsys,
                                                                              monkeypatch):
    """The engine's load-or-recompute choice weighs measured disk reads against measured prefills; on a busy
    machine a slow read can make it prefill a run again (a full test run saw 32 cached tokens for 64). This test
    is about where the blocks go, so it makes every found run a load: its prefills count as 10^-9 of the floor."""
    from minillm.serving.kv_tiers import offload

    real = offload.load_or_recompute
    monkeypatch.setattr(offload, "load_or_recompute", lambda *a: real(*a[:-1], 1e-9))
    args = ["bench-serving", "--model", str(tiny_folder), "--num-prompts", "2", "--input-len", "40", "--output-len",
            "2", "--long-prompt-len", "0", "--threads", "1", "--policies", "continuous", "static", "--quiet",
            "--kv-offload-dir", str(tmp_path), "--json", str(tmp_path / "r.json")]
    cached = []
    for _ in range(2):  # the same command twice: the second finds each run's blocks from the first
        assert main(args) == 0
        data = json.loads((tmp_path / "r.json").read_text())
        cached.append([run["summary"]["total_cached_tokens"] for run in data["runs"]])
    runs = {p.name: len(list(p.glob("*/*.kv"))) for p in tmp_path.iterdir() if p.is_dir()}
    assert runs == {"continuous@inf": 4, "static@inf": 4}  # 2 prompts x 2 full blocks of 16, each run its own
    # cold: no run hit another's blocks; warm: each prompt's 2 full blocks (the last token is always prefilled)
    assert cached == [[0, 0], [2 * 32, 2 * 32]]


@pytest.mark.parametrize("dtype, budget", [("bfloat16", 2048), ("float32", 512)])
def test_cli_takes_serves_token_budget_for_the_models_dtype(tiny_folder, tmp_path, dtype, budget):
    """Without --max-num-batched-tokens (and without --quick's 64), a step takes what `minillm serve` would for the
    model: 2048 tokens in bfloat16, 512 otherwise (minillm.cli.common.default_token_budget)."""
    args = ["bench-serving", "--model", str(tiny_folder), "--dtype", dtype, "--num-prompts", "2", "--input-len", "8",
            "--output-len", "2", "--policies", "continuous+chunked", "--long-prompt-len", "0", "--threads", "1",
            "--kv-cache-memory", "4MiB", "--json", str(tmp_path / "r.json"), "--quiet"]
    assert main(args) == 0
    assert json.loads((tmp_path / "r.json").read_text())["config"]["max_num_batched_tokens"] == budget
