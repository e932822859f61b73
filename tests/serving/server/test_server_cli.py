"""`minillm serve` as a user runs it: a subprocess on a tiny model, a request, Ctrl-C; and its usage errors."""

import shutil
import signal
import socket
from types import SimpleNamespace

import httpx
import pytest
import torch
from live_server import start_serve
from tiny_models import CONFIGS, build_hf, save_hf

from minillm.cli import main
from minillm.cli.common import default_token_budget

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with SmolLM2's vocabulary, saved with SmolLM2's tokenizer files."""
    family, kwargs = CONFIGS["llama_gqa"]
    # (a context long enough that a stream of 8,000 tokens outlasts a shutdown timeout: ~1 ms a token replayed)
    kwargs = dict(kwargs, vocab_size=49152, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
    folder = save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("tiny_serve"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder


def serve_then_ctrl_c(folder, *options: str, ask) -> tuple[str, str]:
    """`minillm serve FOLDER OPTIONS`, ``ask(url)`` (its assertions), Ctrl-C: (the URL, its stderr) once it
    exited 0."""
    server, url = start_serve(folder, *options)
    try:
        ask(url)
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=TIMEOUT_S)
    finally:
        server.kill()
        server.wait(TIMEOUT_S)
    assert server.returncode == 0, stderr
    return url, stderr


@pytest.mark.server
def test_serve_starts_answers_and_stops_on_ctrl_c(tiny_folder):
    def ask(url):
        body, key = {"model": str(tiny_folder), "prompt": "Hi", "max_tokens": 3}, {"Authorization": "Bearer k3y"}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S).status_code == 401
        r = httpx.post(f"{url}/v1/completions", json=body, headers=key, timeout=TIMEOUT_S)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        models = httpx.get(f"{url}/v1/models", headers=key, timeout=TIMEOUT_S).json()["data"]
        assert [m["id"] for m in models] == [str(tiny_folder)]

    url, stderr = serve_then_ctrl_c(tiny_folder, "--max-num-seqs", "4", "--api-key", "k3y", ask=ask)
    assert f"at {url}" in stderr and f"curl {url}/v1/chat/completions" in stderr


@pytest.mark.server
def test_sigterm_ends_an_open_stream_cleanly_and_exits_0(tiny_folder):
    """SIGTERM mid-stream, with --shutdown-timeout 0.5: the stream ends with OpenAI's error event and
    [DONE], the process exits 0, and nothing is logged as a traceback (issue 31, item 7)."""
    server, url = start_serve(tiny_folder, "--shutdown-timeout", "0.5")
    lines = []
    try:
        body = {"prompt": "Hi", "max_tokens": 8000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
            for line in r.iter_lines():
                if line and not lines:
                    server.send_signal(signal.SIGTERM)
                lines += [line] if line else []
        _, stderr = server.communicate(timeout=TIMEOUT_S)
    finally:
        server.kill()
        server.wait(TIMEOUT_S)
    assert lines[-1] == "data: [DONE]" and '"server_shutting_down"' in lines[-2]
    assert server.returncode == 0 and "Traceback" not in stderr, stderr
    assert "1 request(s) still running after 0.5 s were ended" in stderr


@pytest.mark.parametrize("args, message", [
    (["--port", "0"], "--port must be in 1..65535, got 0"),
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--max-waiting-requests", "0"], "--max-waiting-requests must be >= 1"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory: KV cache memory must be a size"),
    (["--served-model-name", ""], "--served-model-name is empty"),
    (["--api-key", " "], "--api-key is empty"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a number of seconds >= 0"),
    (["--kv-offload-memory", "lots"], "--kv-offload-memory: the host tier's size must be a size"),
    (["--kv-offload-memory", "0GiB"], "--kv-offload-memory: the host tier's size must be > 0"),
    (["--tensor-parallel-size", "2", "--kv-offload-dir", "kv"], "--kv-offload-dir does not go with tensor "
                                                                 "parallelism yet"),
    (["--pack-weights", "--no-fast"], "--pack-weights packs the speed layer's products; drop --no-fast"),
    (["--pack-weights", "--dtype", "bfloat16"], "--pack-weights packs float32 or int8/int4 matrices; bfloat16 keeps "
                                                "one copy"),
    (["--pack-weights", "--dtype", "float64"], "float64 keeps one copy (its products never read a packed one)"),
    (["--pack-weights", "--device", "cuda"], "--pack-weights packs for a CPU's products; on cuda drop"),
    (["--tensor-parallel-size", "2", "--pack-weights"], "--pack-weights does not go with tensor parallelism"),
])
def test_usage_errors(args, message, capsys):
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("minillm: error: ") and message in err and "\n" not in err


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_pack_weights_is_refused_where_the_matrix_units_read_the_codes(fmt, capsys):
    """On a CPU with AMX-INT8 quantised products run on the matrix units, which never read the packed copy."""
    from minillm.fast import kernels

    if not kernels.quantized_amx_ready():
        pytest.skip("needs a CPU with AMX-INT8: elsewhere --pack-weights --quantize packs the codes")
    assert main(["serve", "--pack-weights", "--quantize", fmt]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"minillm: error: --pack-weights packs {fmt} codes for the vector units, but this CPU multiplies "
                   "them on its matrix units (AMX-INT8), which read no packed copy; drop --pack-weights")


def test_busy_port_is_one_line(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"cannot listen on 127.0.0.1:{port}" in err and "pick another --port" in err
    assert main(["serve", "--host", "no-such-host.invalid"]) == 2
    assert "give --host an address of this machine" in capsys.readouterr().err


def test_a_kv_offload_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "kv").write_text("")
    assert main(["serve", "--kv-offload-dir", str(tmp_path / "kv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minillm: error: --kv-offload-dir: ") and "exists and is not a folder" in err
    assert err.count("\n") == 1


@pytest.mark.server
def test_a_restarted_serve_finds_its_blocks_in_the_kv_offload_dir(tiny_folder, tmp_path):
    """Ctrl-C closes the engine, which writes its blocks to --kv-offload-dir; the next server on that
    folder answers the same prompt from them, with the same greedy text."""
    body = {"prompt": list(range(1000, 1050)), "max_tokens": 3, "temperature": 0}  # 50 tokens: 3 blocks can hit
    answers = []
    for _ in range(2):
        serve_then_ctrl_c(tiny_folder, "--kv-offload-dir", str(tmp_path), ask=lambda url: answers.append(
            httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S).json()))
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 48]
    assert answers[1]["choices"][0]["text"] == answers[0]["choices"][0]["text"]


@pytest.mark.parametrize("dtype, budget", [(torch.bfloat16, 2048), (torch.float32, 512), (torch.float16, 512)])
def test_a_servers_default_token_budget_follows_its_dtype(dtype, budget):
    """--max-num-batched-tokens left out: vLLM's CPU server default (2048) for a bfloat16 model, where it measured
    faster on every metric, 512 otherwise (float32: the same tok/s, a worse TTFT at 2048)."""
    model = SimpleNamespace(embed=SimpleNamespace(weight=torch.zeros(1, dtype=dtype)))
    assert default_token_budget(model) == budget
