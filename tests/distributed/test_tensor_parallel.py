"""Tensor parallelism over 2 gloo processes on the CPU, against the single-process model as the oracle.

Each spawned pair loads a tiny random-weight model (GPT-2, Llama with GQA, Qwen3 with QK-norm and its
own head_dim), shards it, and rank 0 writes what it computed; the test compares that with the same
model in this process: logits within 1e-5 (float32), greedy tokens equal, one trace event per
all-reduce. A rank that dies mid-request must make rank 0 fail with a clear error, not hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp
from tiny_models import CONFIGS, LLAMA_BASE, build_hf, save_hf

from minillm import load_model
from minillm.config import ModelConfig
from minillm.distributed.comm import TensorParallelError
from minillm.distributed.tensor_parallel import TensorParallelSizeError, check_tensor_parallel_size, valid_sizes
from minillm.generate import generate
from minillm.sampling import SamplingParams
from minillm.trace import Trace

pytestmark = pytest.mark.distributed

FAMILIES = ["gpt2", "llama_gqa", "qwen3"]
PROMPT = [3, 17, 42, 5, 99, 64, 1, 7]
N_NEW = 6
JOIN_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name in FAMILIES:
        family, kwargs = CONFIGS[name]
        out[name] = str(save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp(name)))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(worker, args, world_size: int = 2) -> None:
    """Start ``worker(rank, *args)`` on ``world_size`` spawned processes; kill them all past the timeout."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world_size))
    context = mp.start_processes(worker, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks still running after {JOIN_TIMEOUT_S} s: a hang")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()


def _join(rank: int, timeout_s: float = 20.0):
    from minillm.distributed.launch import join_group

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    return join_group("cpu", timeout_s=timeout_s)


def _sharded(folder: str, group):
    from minillm.distributed.tensor_parallel import shard_model

    return shard_model(load_model(folder, device="cpu", dtype="float32", fast=False), group)


def _logits_and_tokens_worker(rank: int, folders: dict, out: str) -> None:
    from minillm.distributed.launch import leave_group

    group = _join(rank)
    results = {}
    for name, folder in folders.items():
        model = _sharded(folder, group)
        full = model(torch.tensor([PROMPT]))  # no cache: every position's logits
        trace = Trace(keep=["logits"])
        with group.recording(trace if rank == 0 else None):
            steps = list(generate(model, PROMPT, SamplingParams(max_new_tokens=N_NEW), eos_token_ids=set(),
                                  trace=trace))
        results[name] = {"logits": full, "tokens": [s.token_id for s in steps],
                         "cached_logits": torch.cat(trace.activations["logits"]),
                         "kinds": [e["kind"] for e in trace.events], "kv_heads": model.config.n_kv_heads,
                         "all_reduce_bytes": [e["bytes"] for e in trace.of("all_reduce")]}
    if rank == 0:
        torch.save(results, out)
    leave_group()


def test_tensor_parallel_logits_and_greedy_tokens_equal_single_process(folders, tmp_path):
    out = tmp_path / "rank0.pt"
    _run_ranks(_logits_and_tokens_worker, (folders, str(out)))
    got = torch.load(out)
    for name, folder in folders.items():
        model = load_model(folder, device="cpu", dtype="float32", fast=False)
        want = model(torch.tensor([PROMPT]))
        trace = Trace(keep=["logits"])
        steps = list(generate(model, PROMPT, SamplingParams(max_new_tokens=N_NEW), eos_token_ids=set(), trace=trace))
        r = got[name]
        torch.testing.assert_close(r["logits"], want, atol=1e-5, rtol=0, msg=f"{name}: full-sequence logits")
        torch.testing.assert_close(r["cached_logits"], torch.cat(trace.activations["logits"]), atol=1e-5, rtol=0,
                                   msg=f"{name}: logits of the prefill and decode steps (KV cache of local heads)")
        assert r["tokens"] == [s.token_id for s in steps], name
        assert r["kv_heads"] == model.config.n_kv_heads // 2  # each rank's cache holds its own heads
        passes = 1 + N_NEW - 1  # one prefill, then a decode step per token but the last
        assert r["kinds"].count("all_reduce") == 2 * model.config.n_layers * passes
        assert r["kinds"].count("all_gather") == passes
        # a prefill's all-reduce carries [1, T, d_model] float32; a decode step's [1, 1, d_model]
        d = model.config.d_model
        assert r["all_reduce_bytes"][0] == len(PROMPT) * d * 4 and r["all_reduce_bytes"][-1] == d * 4


def _dying_worker(rank: int, folder: str, out: str) -> None:
    from minillm.distributed.launch import leave_group

    group = _join(rank, timeout_s=15.0)
    model = _sharded(folder, group)
    if rank == 1:
        model(torch.tensor([PROMPT]))  # one pass together, then gone without a word
        os._exit(0)  # exit code 0: start_processes would otherwise kill rank 0 before it reports
    try:
        for _ in range(3):
            model(torch.tensor([PROMPT]))
        message = "no error"
    except TensorParallelError as e:
        message = str(e)
    with open(out, "w") as f:
        f.write(message)
    leave_group()  # as the CLI does: a gloo group left to the interpreter's exit, its peer gone, can abort (1 in 8)


def test_a_rank_that_dies_fails_the_request_with_a_clear_error(folders, tmp_path):
    out = tmp_path / "rank0.txt"
    _run_ranks(_dying_worker, (folders["llama_gqa"], str(out)))
    message = out.read_text()
    # the next collective fails: pass 2's first all-reduce, or pass 1's all-gather when rank 1 left during it
    # one line of our own words, none of gloo's (its source paths, "Connection closed by peer")
    assert re.match(r"rank 0 of 2: the (all-reduce of blocks\.0\.attn\.o_proj|all-gather of lm_head) failed: "
                    r"another rank is gone \(its connection closed\)$", message), message


def test_rank_0_names_the_rank_that_died_from_its_process_table(group_of_one):
    from minillm.distributed.launch import dead_worker

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert dead_worker([sleeper], wait_s=0.0) is None  # still running
        sleeper.kill()
        assert dead_worker([sleeper], wait_s=5.0) == f"rank 1 (pid {sleeper.pid}) died (killed by SIGKILL)"
    finally:
        sleeper.kill()
        sleeper.wait()
    group_of_one.who_died = lambda: f"rank 1 (pid {sleeper.pid}) died (killed by SIGKILL)"
    gloo_text = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    with pytest.raises(TensorParallelError) as e, group_of_one._failures("the all-reduce of blocks.3.mlp.down_proj"):
        raise RuntimeError(gloo_text)
    assert str(e.value) == (f"rank 0 of 1: the all-reduce of blocks.3.mlp.down_proj failed: rank 1 (pid "
                            f"{sleeper.pid}) died (killed by SIGKILL)")


@pytest.mark.parametrize("n_heads, n_kv_heads, d_mlp, size, bad", [
    (4, 2, 128, 3, "n_heads = 4 and n_kv_heads = 2 and d_mlp = 128"),
    (4, 1, 128, 2, "n_kv_heads = 1"),
    (6, 6, 100, 4, "n_heads = 6 and n_kv_heads = 6"),
])
def test_sizes_that_do_not_split_heads_are_refused_by_name(n_heads, n_kv_heads, d_mlp, size, bad):
    config = ModelConfig.from_hf(dict(LLAMA_BASE, model_type="llama", num_attention_heads=n_heads,
                                      num_key_value_heads=n_kv_heads, intermediate_size=d_mlp, head_dim=16))
    with pytest.raises(TensorParallelSizeError) as e:
        check_tensor_parallel_size(config, size)
    valid = [n for n in range(1, 7) if n_heads % n == 0 and n_kv_heads % n == 0 and d_mlp % n == 0]
    assert str(e.value) == (f"tensor-parallel size {size} does not divide this model's {bad} (each rank holds "
                            f"whole heads); valid sizes: {', '.join(map(str, valid))}")
    assert valid_sizes(config) == valid


def _minillm(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, input=stdin,
                          timeout=120)


@pytest.fixture(scope="module")
def cli_folder(tmp_path_factory, smollm2_dir):
    """A tiny random Llama (GQA) with SmolLM2's tokenizer, so the command line runs it; 4096 positions, so that a
    stream lasts long enough to lose a rank in the middle of it."""
    family, kwargs = CONFIGS["llama_gqa"]
    folder = save_hf(build_hf(family, dict(kwargs, vocab_size=49152, max_position_embeddings=4096)),
                     tmp_path_factory.mktemp("cli"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return str(folder)


def test_generate_with_tensor_parallel_size_2_samples_what_one_process_samples(cli_folder):
    flags = ["--model", cli_folder, "--no-chat", "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "3",
             "--json"]
    command = [sys.executable, "-m", "minillm", "generate"]
    two = subprocess.Popen([*command, "-", "--tensor-parallel-size", "2", *flags], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    one = _minillm("generate", "The capital of France is", "--no-fast", *flags)  # meanwhile
    two_out, two_err = two.communicate("The capital of France is", timeout=120)
    assert two.returncode == 0 and one.returncode == 0, two_err + one.stderr
    assert len(two_out.splitlines()) == 1  # rank 0 prints, rank 1 is quiet
    assert json.loads(two_out)["text"] == json.loads(one.stdout)["text"]


@pytest.mark.parametrize("flags, code, message", [
    (["--tensor-parallel-size", "3"], 1, "tensor-parallel size 3 does not divide this model's n_heads = 4 and "
                                         "n_kv_heads = 2 and d_mlp = 128 (each rank holds whole heads); valid sizes: 1, 2"),
    (["--tp", "2", "--quantize", "int8"], 2, "--quantize does not go with tensor parallelism yet: shard_model "
                                             "splits float nn.Linear layers only"),
    (["--tp", "2", "--prefix-cache"], 2, "--prefix-cache does not go with tensor parallelism yet (every rank would "
                                         "have to keep the same state); drop one"),
])
def test_generate_refuses_what_tensor_parallelism_cannot_run(cli_folder, flags, code, message, capsys):
    from minillm.cli import main

    assert main(["generate", "hi", "--model", cli_folder, *flags]) == code  # before any rank starts
    assert capsys.readouterr().err.startswith(f"minillm: error: {message}")


@pytest.mark.parametrize("argv, message", [
    (["serve", "--tp", "2", "--threads", "2"], "--threads does not go with tensor parallelism: each rank runs one "
                                               "torch thread pinned to a core of its own"),
    (["generate", "", "--tp", "2"], "the prompt is empty"),
])
def test_tensor_parallel_usage_errors_come_before_any_rank_starts(cli_folder, argv, message, capsys, monkeypatch):
    from minillm.cli import main
    from minillm.distributed import launch

    def no_ranks(*args):
        raise AssertionError("ranks started before the usage error")

    monkeypatch.setattr(launch, "start_workers", no_ranks)
    assert main([*argv, "--model", cli_folder]) == 2
    assert capsys.readouterr().err.startswith(f"minillm: error: {message}")


@pytest.mark.parametrize("load, note", [(1.9, None), (2.5, "machine busy: load 2.5 on 2 cores")])
def test_the_busy_note_counts_the_cores_of_every_rank(load, note, monkeypatch):
    """3 ranks pinned over a 2-core machine run on 2 cores: load 1.9 leaves them room, though rank 0 alone
    is pinned to 1 core (the note used to compare the load with that one)."""
    from types import SimpleNamespace

    from minillm import cpu_policy
    from minillm.cli.common import busy_note_now

    monkeypatch.setattr(cpu_policy, "load_average", lambda: load)
    monkeypatch.setattr(cpu_policy, "usable_cores", lambda: 1)  # rank 0, pinned
    assert busy_note_now(SimpleNamespace(cores=2)) == note


def _generate_long(cli_folder, suite_ignores_sigint: bool = False) -> subprocess.Popen:
    """``generate --tp 2`` over 400 prompts (a tiny model ends one in milliseconds), started as a terminal starts a
    foreground job: a process group of its own, SIGINT at its default. (A job a shell starts in the background
    inherits SIGINT ignored, and minillm, as every Python program, keeps it ignored: Ctrl-C is not for it.)
    ``suite_ignores_sigint``: start it from this process with SIGINT ignored, as a suite started in the
    background (``pytest &`` from a script, some CI runners) has it. Returns once the first answer is printed:
    both ranks are at work."""
    command = [sys.executable, "-m", "minillm", "generate", "--model", cli_folder, "--tp", "2", "--no-chat",
               "--max-new-tokens", "100", *["Once upon a time"] * 400]
    with _sigint_ignored(suite_ignores_sigint):
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True, preexec_fn=_sigint_default)
    assert process.stdout.readline(), process.stderr.read()
    return process


def _sigint_default() -> None:
    """In the child before it runs Python: SIGINT back to its default, whatever this process had."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def _sigint_ignored(ignored: bool):
    """This process with SIGINT ignored while in the block (``ignored``), then as it was."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignored else None
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("signal_name, suite_ignores_sigint", [("SIGINT", False), ("SIGINT", True), ("SIGKILL", False)],
                         ids=["SIGINT", "SIGINT-suite-in-background", "SIGKILL"])
def test_the_followers_end_quietly_with_rank_0(cli_folder, signal_name, suite_ignores_sigint):
    """Ctrl-C (SIGINT to the whole group, as a terminal sends it): rank 0 says "interrupted" and stops its
    follower at once. Rank 0 killed: the follower finds its leader gone and exits without a word. Either
    way stderr closes (every rank holding it has exited) well within the timeout, with no error line.
    The same when the suite itself runs with SIGINT ignored (a background job): the command still starts
    as a terminal's."""
    process = _generate_long(cli_folder, suite_ignores_sigint)
    group = process.pid
    if signal_name == "SIGINT":
        os.killpg(group, signal.SIGINT)
    else:
        process.kill()
    try:
        _, err = process.communicate(timeout=30)  # returns at EOF: the follower, holding stderr too, is gone
    except subprocess.TimeoutExpired:
        os.killpg(group, signal.SIGKILL)  # no rank outlives the test
        process.communicate()
        raise
    # less each answer's summary line, and the warning of a machine with fewer cores than ranks
    lines = [line for line in err.splitlines() if not line.startswith("[prompt") and "ranks on" not in line]
    assert lines == (["minillm: interrupted"] if signal_name == "SIGINT" else []), err
    assert process.returncode == (130 if signal_name == "SIGINT" else -signal.SIGKILL)


@pytest.fixture
def group_of_one():
    """A gloo group of this process alone (world size 1): the collectives run, nothing is split."""
    import torch.distributed as dist

    from minillm.distributed.comm import TensorParallelGroup

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield TensorParallelGroup(0, 1, "gloo", torch.device("cpu"), 10.0)
    dist.destroy_process_group()


def test_the_trace_views_show_each_collective(folders, group_of_one):
    from rich.console import Console

    from minillm.distributed.tensor_parallel import shard_model
    from minillm.views.chrome_trace import trace_to_chrome_events
    from minillm.views.terminal import summary_panel

    model = shard_model(load_model(folders["gpt2"], device="cpu", dtype="float32", fast=False), group_of_one)
    trace = Trace()
    with group_of_one.recording(trace):
        list(generate(model, PROMPT, SamplingParams(max_new_tokens=3), eos_token_ids=set(), trace=trace))
    console = Console(record=True, width=200)
    console.print(summary_panel(trace))
    n_layers, passes = model.config.n_layers, 3
    row = next(line for line in console.export_text().splitlines() if "all-reduce " in line)
    assert f"in {2 * n_layers * passes} all-reduces and {passes} all-gathers" in row and "over 1 ranks (gloo)" in row
    events = trace_to_chrome_events(trace)
    track = next(e["tid"] for e in events if e.get("args", {}).get("name") == "all-reduce (tensor parallel)")
    boxes = [e for e in events if e.get("tid") == track and e["ph"] == "X"]
    assert [b["name"] for b in boxes] == ["all_reduce"] * (2 * n_layers) + ["all_gather"] + \
        (["all_reduce"] * (2 * n_layers) + ["all_gather"]) * (passes - 1)


ENGINE_REQUESTS = [  # (prompt, params, n)
    (PROMPT, SamplingParams(max_new_tokens=N_NEW), 1),
    ([5, 6, 7], SamplingParams(max_new_tokens=N_NEW, temperature=0.9, seed=4), 1),
    (list(range(20, 41)), SamplingParams(max_new_tokens=N_NEW, temperature=0.9, seed=5), 2),  # copy on write
]


def _serve(model) -> dict:
    """Every request of ENGINE_REQUESTS through one engine; (request, index) -> (tokens, their logprobs)."""
    from minillm.serving import LLMEngine

    # small blocks and token budget: chunked prefills, decodes and prefills in one step, several blocks a request
    engine = LLMEngine(model, num_blocks=64, block_size=4, max_num_batched_tokens=10, eos_token_ids=set())
    if getattr(model, "tensor_parallel", None) is not None:
        from minillm.distributed.engine import lead_engine

        lead_engine(engine)
    ids = [engine.add_request(prompt, params, n=n, logprobs=0) for prompt, params, n in ENGINE_REQUESTS]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[(ids.index(out.request_id), out.index)] = (out.token_ids, [lp for lp, _ in out.logprobs])
    return final


def _engine_worker(rank: int, folder: str, out: str) -> None:
    from minillm.distributed.follow import follow, lead
    from minillm.distributed.launch import leave_group

    group = _join(rank)
    model = _sharded(folder, group)
    if rank == 0:
        final = _serve(model)
        lead(group, None)
        torch.save(final, out)
    else:
        follow(model, group)
    leave_group()


def test_the_engine_with_tensor_parallelism_answers_as_one_process(folders, tmp_path):
    out = tmp_path / "rank0.pt"
    _run_ranks(_engine_worker, (folders["llama_gqa"], str(out)))
    want = _serve(load_model(folders["llama_gqa"], device="cpu", dtype="float32", fast=False))
    got = torch.load(out)
    assert len(want) == 4 and all(len(tokens) == N_NEW for tokens, _ in want.values())
    assert {k: tokens for k, (tokens, _) in got.items()} == {k: tokens for k, (tokens, _) in want.items()}
    for key, (_, logprobs) in want.items():  # the copied block's K/V too: the forked sequence reads it
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(logprobs), atol=1e-5, rtol=0, msg=str(key))


def test_serve_with_tensor_parallel_size_2_answers_as_one_process_and_stops_on_ctrl_c(cli_folder):
    import httpx

    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", cli_folder, "--tp", "2",
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    one = _minillm("generate", "The capital of France is", "--model", cli_folder, "--no-chat", "--no-fast",
                   "--max-new-tokens", "8", "--temperature", "0", "--json")  # meanwhile
    try:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except httpx.TransportError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.3)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "n": 2})
        assert [c["text"] for c in r.json()["choices"]] == [json.loads(one.stdout)["text"]] * 2
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=JOIN_TIMEOUT_S)
    assert server.returncode == 0, err


def _start_serve(folder: str, *flags: str) -> tuple[subprocess.Popen, str, int]:
    """``minillm serve --tp 2`` on 127.0.0.1, once /health answers; returns the server, its URL and rank 1's pid."""
    import httpx

    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", folder, "--tp", "2", "--port",
                               str(port), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + JOIN_TIMEOUT_S
    try:
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1).raise_for_status()
                break
            except httpx.TransportError:
                assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.3)
        (rank_1,) = _children(server.pid)
    except BaseException:
        server.kill()  # its follower then finds rank 0 gone and exits
        raise
    return server, url, rank_1


def _children(pid: int) -> dict[int, str]:
    """The child processes of ``pid`` (from /proc), each with its state: R, S, ..., Z for defunct (a zombie)."""
    children = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, parent = f.read().rsplit(")", 1)[1].split()[:2]  # after "pid (command)"
        except (OSError, ValueError):
            continue  # not a process, or one that has just ended
        if int(parent) == pid:
            children[int(entry)] = state
    return children


def _stream_and_kill(url: str, rank_1: int) -> list[str]:
    """Start a long stream, SIGKILL rank 1 once its first chunk arrives; returns the stream's data lines after it."""
    import httpx

    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=JOIN_TIMEOUT_S) as r:
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line)
        assert json.loads(next(lines).removeprefix("data: "))["choices"]
        os.kill(rank_1, signal.SIGKILL)
        return list(lines)


def _check_lost(url: str, rank_1: int, rest: list[str]) -> str:
    """The stream ended with an error event naming rank 1, then [DONE]; a new request gets 503 "engine_dead" with
    the reason. Returns the reason (the server's error line)."""
    import httpx

    died = f"rank 1 (pid {rank_1}) died (killed by SIGKILL)"
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert died in json.loads(rest[-2].removeprefix("data: "))["error"]["message"], rest[-2]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=JOIN_TIMEOUT_S)
    error = r.json()["error"]
    assert r.status_code == 503 and error["code"] == "engine_dead" and died in error["message"], r.text
    return error["message"].removeprefix("the engine cannot run: ").removesuffix("; restart the server")


def test_serve_exits_after_it_loses_a_rank(cli_folder):
    """Rank 1 killed mid-stream: the stream ends with an error event and [DONE], a request sent right after gets
    503 with the reason, and within a bounded time the server exits with status 1 and one error line, its ranks
    all reaped (none defunct), so a supervisor that restarts on exit brings it back."""
    server, url, rank_1 = _start_serve(cli_folder)
    try:
        reason = _check_lost(url, rank_1, _stream_and_kill(url, rank_1))
        assert _children(server.pid) == {}  # rank 1 reaped (before the error event was sent), not left defunct
        _, err = server.communicate(timeout=30)
    finally:
        server.kill()
        server.wait()
    assert server.returncode == 1, err
    assert [line for line in err.splitlines() if "error" in line.lower()] == [f"minillm: error: {reason}"], err
    assert "Traceback" not in err
    assert not os.path.exists(f"/proc/{rank_1}")  # and no process at all now


def test_serve_with_keep_alive_on_engine_death_stays_up_answering_503(cli_folder):
    """The same loss with --keep-alive-on-engine-death: still up past the grace the default exits after, /health
    and requests answer 503 with the reason, no rank left defunct; stopped, it says why it failed (status 1)."""
    import httpx

    from minillm.cli.serve import ENGINE_DEATH_GRACE_S

    server, url, rank_1 = _start_serve(cli_folder, "--keep-alive-on-engine-death")
    try:
        _check_lost(url, rank_1, _stream_and_kill(url, rank_1))
        with pytest.raises(subprocess.TimeoutExpired):  # past the grace the default would exit after
            server.wait(timeout=ENGINE_DEATH_GRACE_S + 1)
        health = httpx.get(f"{url}/health", timeout=JOIN_TIMEOUT_S)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert _children(server.pid) == {}  # no rank left defunct while it stays up
    finally:
        server.terminate()
        _, err = server.communicate(timeout=JOIN_TIMEOUT_S)
    assert server.returncode == 1 and f"rank 1 (pid {rank_1}) died" in err.splitlines()[-1], err


def test_serve_sees_a_rank_die_while_idle(cli_folder):
    """Rank 1 killed while no request runs (no collective to fail): rank 0's watchdog sees it within a poll,
    /health answers 503 naming it, and the server exits with status 1, rank 1 reaped, without a request."""
    import httpx

    server, url, rank_1 = _start_serve(cli_folder)
    try:
        os.kill(rank_1, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{url}/health", timeout=5)).status_code == 200:  # before the grace ends
            assert time.monotonic() < deadline, "the watchdog did not see rank 1 die"
            time.sleep(0.1)
        assert health.status_code == 503 and f"rank 1 (pid {rank_1}) died" in health.json()["error"]["message"]
        _, err = server.communicate(timeout=30)
    finally:
        server.kill()
        server.wait()
    assert server.returncode == 1, err
    assert err.splitlines()[-1] == (f"minillm: error: rank 0 of 2: rank 1 (pid {rank_1}) died (killed by SIGKILL), "
                                    "seen while idle"), err
    assert not os.path.exists(f"/proc/{rank_1}")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=5)
