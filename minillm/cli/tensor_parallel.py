"""--tensor-parallel-size for the commands that run a model (generate, serve): the flag, its checks, and
starting the ranks (minillm/distributed/launch.py) around the command's own run."""

from __future__ import annotations

import os
import signal
import sys

from .common import UsageError, ensure_model

FOLLOWER_LOST_EXIT = 1  # a follower whose leader or peer is gone: failed, but rank 0 is the one that says why


def tensor_parallel_option(p, what: str) -> None:
    p.add_argument("--tensor-parallel-size", "--tp", type=int, metavar="N",
                   help="split the model over N processes, each holding 1/N of every layer (minillm/distributed: "
                        "whole heads per rank, two all-reduces a layer; gloo on the CPU, each rank pinned to a core "
                        "with one thread; NCCL on GPUs, one per rank); runs the lesson's model (no fast layer); "
                        f"rank 0 {what}. Started by this command, or by 'torchrun --nproc-per-node N -m minillm ...' "
                        "(default: 1, one process)")


def tensor_parallel_size(args, not_with: list[str]) -> int:
    """N from --tensor-parallel-size or torchrun's WORLD_SIZE (1: one process); usage errors for what N
    cannot go with (``not_with``: argument names, each refused with its reason from NOT_WITH_TENSOR_PARALLEL),
    said before any process starts."""
    from ..distributed.launch import launched_by_torchrun

    n = args.tensor_parallel_size
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if n is not None and n != world:
            raise UsageError(f"--tensor-parallel-size {n} but torchrun started {world} processes; drop the flag "
                             "or make them equal")
        n = world
    n = 1 if n is None else n
    if n < 1:
        raise UsageError(f"--tensor-parallel-size must be >= 1, got {n}")
    not_with = {name: NOT_WITH_TENSOR_PARALLEL[name] for name in not_with}
    given = [name for name in not_with if getattr(args, name, None) not in (None, False)]
    if n > 1 and given:
        raise UsageError(not_with[given[0]])
    return n


# why each flag cannot go with tensor parallelism, each in its own words (argument name -> the error)
_SAME_STATE = "does not go with tensor parallelism yet (every rank would have to keep the same state); drop one"
_SHARDED_KV = ("does not go with tensor parallelism yet: each rank's pool holds its own KV heads, and a tier "
               "would have to keep every rank's share of a block; drop one")
NOT_WITH_TENSOR_PARALLEL = {
    "quantize": "--quantize does not go with tensor parallelism yet: shard_model splits float nn.Linear layers only "
                "(minillm/distributed/tensor_parallel.py), not quantized ones; drop one",
    "threads": "--threads does not go with tensor parallelism: each rank runs one torch thread pinned to a core of "
               "its own (N ranks use N cores); drop --threads",
    "pack_weights": "--pack-weights does not go with tensor parallelism: the ranks run the lesson's sharded layers, "
                    "not the speed layer's products; drop --pack-weights",
    "speculative": f"--speculative {_SAME_STATE}",
    "prefix_cache": f"--prefix-cache {_SAME_STATE}",
    "json_schema": f"--json-schema {_SAME_STATE}",
    "regex": f"--regex {_SAME_STATE}",
    "choice": f"--choice {_SAME_STATE}",
    "kv_offload_memory": f"--kv-offload-memory {_SHARDED_KV}",
    "kv_offload_dir": f"--kv-offload-dir {_SHARDED_KV}",
    "kv_offload_disk_size": f"--kv-offload-disk-size {_SHARDED_KV}",
}


def run_tensor_parallel(args, n: int, run) -> int:
    """This process as rank 0 of N, ranks 1..N-1 started here (or every rank by torchrun): the sizes checked,
    the group joined, each CPU rank pinned to its own core, then ``run(args, group)`` on every rank.

    Rank 0 reports, the others stay quiet: a follower whose collective fails (rank 0 or a peer is gone)
    exits with FOLLOWER_LOST_EXIT and prints nothing. When rank 0 ends early (Ctrl-C, an error, ``| head``)
    it stops the ranks it started at once (SIGTERM, then SIGKILL), before it leaves the group."""
    import torch

    from .. import cpu_policy
    from ..config import ModelConfig
    from ..device import resolve_device
    from ..distributed.comm import TensorParallelError
    from ..distributed.launch import (dead_worker, join_group, launched_by_torchrun, leave_group, pin_to_core,
                                      start_workers, stop_lost_workers, stop_workers)
    from ..distributed.tensor_parallel import check_tensor_parallel_size

    check_tensor_parallel_size(ModelConfig.from_json(ensure_model(args.model, args.weights_dir)), n)
    if resolve_device(args.device).type == "cuda" and torch.cuda.device_count() < n:  # say it before any rank waits
        raise UsageError(f"--tensor-parallel-size {n} runs a rank a GPU and this machine has "
                         f"{torch.cuda.device_count()}; use --device cpu or at most {torch.cuda.device_count()}")
    workers = [] if launched_by_torchrun() else start_workers(n, getattr(args, "argv", None) or sys.argv[1:])
    finished = False
    try:
        group = join_group(args.device)
        if workers:
            group.who_died = lambda: stop_lost_workers(workers)  # and the others stopped: the group is done
            group.first_dead = lambda: dead_worker(workers, wait_s=0)
        if group.device.type == "cpu":
            group.cores = min(n, cpu_policy.usable_cores())  # read before this rank is pinned to one of them
            pin_to_core(group.rank)
        if group.rank:  # Ctrl-C in a terminal reaches every rank: rank 0 decides (serve drains) and tells them
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            code = run(args, group)
            finished = code == 0  # else (serve lost a rank) the others may wait on it forever: stop them now
            return code
        except TensorParallelError:
            if group.rank:  # the leader, or a peer, is gone: rank 0 says so (or has been interrupted), not each rank
                return FOLLOWER_LOST_EXIT
            raise
        finally:
            if not finished:  # before leaving the group: a follower must not see it close and report that
                stop_workers(workers, finished=False)
            leave_group()
    finally:
        stop_workers(workers, finished)
