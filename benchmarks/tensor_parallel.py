"""Tensor parallelism on this machine: decode TPOT and prefill time of 2 ranks against one process, and
the all-reduces' share of a step (minillm/distributed).

    python benchmarks/tensor_parallel.py                      # 3 rounds: 7-12 min on the busy 2-core VM
    python benchmarks/tensor_parallel.py --rounds 5 --decode-steps 64
    python benchmarks/tensor_parallel.py --device cuda        # NCCL, one GPU a rank (needs 2 GPUs)
    python benchmarks/tensor_parallel.py --check-default-model   # SmolLM2-135M's logits, TP=3 vs one process
                                                                 # (and both vs float64)

The settings, each a fresh process (or pair of processes), the lesson's float32 model (fast=False):

    TP=2            2 ranks over gloo (torchrun's variables, 127.0.0.1), each pinned to its own core, one thread
    1 proc, 2 thr   one process, 2 torch threads (the machine's 2 cores shared by OpenMP)
    1 proc, 1 thr   one process, 1 torch thread
    (--device cuda: TP=2 over NCCL, a GPU a rank, against one GPU; skipped with fewer than 2 GPUs)

The model: SmolLM2-135M splits into 1 or 3 ranks only (9 query heads, 3 K/V heads), and this machine
has 2 cores, so the settings run a model of SmolLM2-135M's shape with 8 query heads and 4 K/V heads of
72 dimensions (d_model 576, 30 layers, d_mlp 1536, vocabulary 49,152, tied; random weights, the same
on every rank): 137.8 M parameters to SmolLM2-135M's 134.5 M (K/V 4 x 72 wide instead of 3 x 64),
2.5% more bytes a decode step, split in two.

Each process prefills --prompt-tokens random ids 3 times (median) and then decodes --decode-steps
tokens (median step). Rank 0 of TP=2 times each all-reduce and all-gather (comm.py's trace events):
their share of the prefill and of a decode step is the time inside the collectives (waiting for the
slower rank included) over the pass's time. Settings run interleaved, a new order each round, so a
change in the machine's load hits them alike; each row shows the 1-minute load average after its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SETTINGS = {  # device -> setting -> (ranks, threads per rank)
    "cpu": {"TP=2 (2 ranks x 1 thread)": (2, 1), "1 proc, 2 threads": (1, 2), "1 proc, 1 thread": (1, 1)},
    "cuda": {"TP=2 (2 GPUs, NCCL)": (2, 1), "1 GPU": (1, 1)},
}
SHAPE = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=72)  # SmolLM2-135M's, halvable


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="runs of each setting (median)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, needs a GPU per rank)")
    ap.add_argument("--check-default-model", action="store_true",
                    help="instead: SmolLM2-135M's logits with TP=3 against one process (max |difference|)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a setting's process: write its measurement to this file
    ap.add_argument("--check-worker", help=argparse.SUPPRESS)  # a rank of --check-default-model
    args = ap.parse_args()
    if args.worker:
        return _worker(args)
    if args.check_worker:
        return _check_worker(args.check_worker)
    if args.check_default_model:
        return _check_default_model()
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            print(f"skipped: TP=2 over NCCL needs 2 GPUs, this machine has {torch.cuda.device_count()}")
            return 0
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS[args.device]}
    names = list(SETTINGS[args.device])
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(_run(name, args))
            print(f"round {r + 1}: {name}: {_brief(results[name][-1])}", file=sys.stderr, flush=True)
    _print_table(results, args)
    return 0


def _run(name: str, args) -> dict:
    """One setting's measurement in fresh processes; the result rank 0 wrote, with the load after it."""
    ranks, threads = SETTINGS[args.device][name]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        worker = [__file__, "--worker", out, "--prompt-tokens", str(args.prompt_tokens),
                  "--decode-steps", str(args.decode_steps), "--device", args.device]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MINILLM_CPU_POLICY="off")
        if ranks > 1:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                       "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *worker]
        else:
            command = [sys.executable, *worker]
        subprocess.run(command, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
        with open(out) as f:
            result = json.load(f)
    result["load_1m"] = os.getloadavg()[0]
    return result


def _worker(args) -> int:
    import torch

    from minillm.distributed.launch import join_group, launched_by_torchrun, leave_group, pin_to_core
    from minillm.distributed.tensor_parallel import shard_model
    from minillm.kv_cache import KVCache
    from minillm.phases import decode_step, prefill
    from minillm.sweep import warm_up
    from minillm.trace import Trace

    group = join_group(args.device) if launched_by_torchrun() else None
    if group is not None and group.device.type == "cpu":
        pin_to_core(group.rank)
    device = group.device if group is not None else torch.device(args.device)
    model = _model(device)
    if group is not None:
        shard_model(model, group)
    warm_up(model, args.prompt_tokens)
    ids = torch.randint(0, model.config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1))
    prefill_ms, prefill_comm_ms, decode_ms, decode_comm_ms = [], [], [], []
    for _ in range(3):
        cache = KVCache.for_model(model, max_seq_len=args.prompt_tokens + args.decode_steps + 1)
        ms, comm = _timed(lambda: prefill(model, ids, cache), group, device, Trace)
        prefill_ms.append(ms)
        prefill_comm_ms.append(comm)
    token = torch.tensor(0)
    for _ in range(args.decode_steps):
        ms, comm = _timed(lambda: decode_step(model, token, cache), group, device, Trace)
        decode_ms.append(ms)
        decode_comm_ms.append(comm)
    all_reduce_us = _all_reduce_us(group, model.config.d_model, device) if group is not None else None
    if group is None or group.rank == 0:
        with open(args.worker, "w") as f:
            json.dump({"prefill_ms": statistics.median(prefill_ms), "tpot_ms": statistics.median(decode_ms),
                       "all_reduce_us": all_reduce_us,
                       "prefill_comm_share": sum(prefill_comm_ms) / sum(prefill_ms),
                       "decode_comm_share": sum(decode_comm_ms) / sum(decode_ms),
                       "threads": torch.get_num_threads(), "ranks": 1 if group is None else group.world_size}, f)
    if group is not None:
        leave_group()
    return 0


def _all_reduce_us(group, d_model: int, device, repeats: int = 200) -> float:
    """Median µs of one all-reduce of a decode step's [1, 1, d_model] float32 alone: the link's latency."""
    import torch

    x = torch.zeros(1, 1, d_model, device=device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        group.all_reduce(x, "benchmark")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _timed(run, group, device, trace_cls) -> tuple[float, float]:
    """ms of one pass, and ms of it inside collectives (rank 0's trace events; 0 without a group)."""
    import torch

    trace = trace_cls() if group is not None else None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    if group is None:
        run()
    else:
        with group.recording(trace):
            run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    comm = 0.0 if trace is None else sum(e["time_ms"] for e in trace.events if e["kind"] in ("all_reduce", "all_gather"))
    return ms, comm


def _model(device):
    """SmolLM2-135M's shape with 8 query and 4 K/V heads (module docstring), random weights from seed 0."""
    import torch

    from minillm.config import ModelConfig
    from minillm.formats.weights import model_dir
    from minillm.model import Transformer

    with open(model_dir("smollm2-135m-instruct") / "config.json") as f:
        hf = json.load(f)
    config = ModelConfig.from_hf(dict(hf, **SHAPE))
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(config)
    model.lm_head.weight = model.embed.weight
    return model.eval().requires_grad_(False)


def _check_default_model() -> int:
    """SmolLM2-135M with TP=3 (3 gloo ranks; this machine may have fewer cores) against one process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "diff.json")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr",
                        "127.0.0.1", "--master-port", str(_free_port()), __file__, "--check-worker", out],
                       check=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
        with open(out) as f:
            print(json.dumps(json.load(f)))
    return 0


def _check_worker(out: str) -> int:
    """One rank of --check-default-model; rank 0 also runs the whole model and writes the comparison."""
    import torch

    from minillm import load_model
    from minillm.distributed.launch import join_group, leave_group
    from minillm.distributed.tensor_parallel import shard_model
    from minillm.generate import generate
    from minillm.sampling import SamplingParams
    from minillm.tokenizer import load_tokenizer

    group = join_group("cpu")
    model = shard_model(load_model("smollm2-135m-instruct", device="cpu", dtype="float32", fast=False), group)
    tokenizer = load_tokenizer(model.source)
    ids = tokenizer.encode("The capital of France is Paris, and the capital of Germany is")
    greedy = SamplingParams(max_new_tokens=16)
    logits = model(torch.tensor([ids]))
    tokens = [s.token_id for s in generate(model, ids, greedy, eos_token_ids=set())]
    if group.rank == 0:
        whole = load_model("smollm2-135m-instruct", device="cpu", dtype="float32", fast=False)
        want = whole(torch.tensor([ids]))
        want_tokens = [s.token_id for s in generate(whole, ids, greedy, eos_token_ids=set())]
        exact = load_model("smollm2-135m-instruct", device="cpu", dtype="float64", fast=False)(torch.tensor([ids]))
        with open(out, "w") as f:  # float64: how far each float32 run is from the exact sums
            json.dump({"model": "smollm2-135m-instruct", "tensor_parallel_size": group.world_size,
                       "positions": len(ids), "max_abs_logit_diff": (logits - want).abs().max().item(),
                       "tp_vs_float64": (logits.double() - exact).abs().max().item(),
                       "one_process_vs_float64": (want.double() - exact).abs().max().item(),
                       "max_abs_logit": want.abs().max().item(), "greedy_tokens_equal": tokens == want_tokens,
                       "text": tokenizer.decode(tokens)}, f)
    leave_group()
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _brief(r: dict) -> str:
    return (f"prefill {r['prefill_ms']:.1f} ms, TPOT {r['tpot_ms']:.1f} ms, collectives {100 * r['decode_comm_share']:.0f}% "
            f"of a step, load {r['load_1m']:.1f}")


def _print_table(results: dict[str, list[dict]], args) -> None:
    print(f"prompt {args.prompt_tokens} tokens, {args.decode_steps} decode steps, {args.rounds} rounds, "
          f"{os.cpu_count()} cores, device {args.device} (median of the rounds' medians)")
    print("| setting | prefill ms | TPOT ms | in collectives, prefill | in collectives, decode step | load (1 min) |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "all_reduce_us"}
        loads = ", ".join(f"{r['load_1m']:.1f}" for r in runs)
        comm = (f"{100 * med['prefill_comm_share']:.0f}%", f"{100 * med['decode_comm_share']:.0f}%") \
            if med["ranks"] > 1 else ("-", "-")
        print(f"| {name} | {med['prefill_ms']:.1f} | {med['tpot_ms']:.1f} | {comm[0]} | {comm[1]} | {loads} |")
    for name, runs in results.items():
        if runs[0]["all_reduce_us"] is not None:
            us = statistics.median(r["all_reduce_us"] for r in runs)
            print(f"{name}: one all-reduce of a decode step's [1, 1, d_model] float32 alone: {us:.0f} µs (median)")


if __name__ == "__main__":
    sys.exit(main())
