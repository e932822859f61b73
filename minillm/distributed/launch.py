"""Starting the ranks of a tensor-parallel run, and joining their process group.

Two ways in, one group::

    torchrun --nproc-per-node 2 -m minillm generate "..."    torchrun starts 2 processes and sets
                                                              RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    minillm generate --tensor-parallel-size 2 "..."          this process becomes rank 0 and starts
                                                              ranks 1..N-1 itself (the same command, the
                                                              same variables), as torchrun would

Every rank then calls :func:`join_group` (``init_process_group`` over ``env://``): gloo on the CPU,
NCCL on CUDA (one GPU per rank, cuda:LOCAL_RANK). On the CPU each rank is pinned to a core of its
own with one torch thread (:func:`pin_to_core`): N ranks on N cores, none of them fighting over
another's cache or time slices.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from ..device import resolve_device
from .comm import TensorParallelGroup

DEFAULT_TIMEOUT_S = 60.0  # a rank that does not answer a forward pass's collective within this fails the request
# How long a follower waits for rank 0's next message: a server may stay idle for hours. A rank that
# died is noticed at once either way (its connections close); this bounds only a rank that hangs.
CONTROL_TIMEOUT_S = 7 * 24 * 3600.0
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun(environ=None) -> bool:
    """Whether this process is one rank of several started by torchrun (or by :func:`start_workers`)."""
    environ = os.environ if environ is None else environ
    return all(name in environ for name in _ENV) and int(environ["WORLD_SIZE"]) > 1


def start_workers(world_size: int, argv: list[str]) -> list[subprocess.Popen]:
    """Make this process rank 0 of ``world_size`` and start ranks 1..N-1 as ``python -m minillm ARGV``.

    They get torchrun's variables (a free port on 127.0.0.1), no stdin and no stdout (rank 0 prints;
    their errors still reach stderr), ``OMP_NUM_THREADS=1`` and SIGINT ignored (rank 0 answers Ctrl-C). Returns their processes, for
    :func:`stop_workers`.
    """
    with socket.socket() as s:  # a free port; the small race until rank 0 binds it is torchrun's too
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
              "OMP_NUM_THREADS": "1"}
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    return [subprocess.Popen([sys.executable, "-m", "minillm", *argv], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, env={**os.environ, **common, "RANK": str(r),
                                                             "LOCAL_RANK": str(r)},
                             preexec_fn=_ignore_ctrl_c)
            for r in range(1, world_size)]


def _ignore_ctrl_c() -> None:
    """In a worker before it runs Python: Ctrl-C reaches the terminal's whole process group, and rank 0 is the
    one that answers it (and stops the workers); ignored from the start, Python never installs its
    KeyboardInterrupt handler, so a worker still importing torch prints no traceback either."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def stop_workers(workers: list[subprocess.Popen], finished: bool, timeout_s: float = 10.0,
                 kill_after_s: float = 1.0) -> None:
    """End the workers. ``finished``: rank 0 told them to stop, so wait up to ``timeout_s`` for them to exit;
    else (rank 0 interrupted, failed, or its reader went away) stop them at once. Any still running then
    gets SIGTERM, and SIGKILL ``kill_after_s`` later: no rank outlives rank 0."""
    deadline = time.monotonic() + (timeout_s if finished else 0.0)
    for w in workers:
        try:
            w.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    running = [w for w in workers if w.poll() is None]
    for w in running:
        w.terminate()
    deadline = time.monotonic() + kill_after_s
    for w in running:
        try:
            w.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


def dead_worker(workers: list[subprocess.Popen], wait_s: float = 0.5) -> str | None:
    """On rank 0, after a collective failed: "rank R (pid P) died (killed by SIGKILL)" for the first of
    ``workers`` (ranks 1..N-1, from :func:`start_workers`) that has ended, or None when all still run.
    Waits up to ``wait_s`` for one to end: its connections close a moment before the OS reports its exit."""
    deadline = time.monotonic() + wait_s
    while True:
        for rank, w in enumerate(workers, start=1):
            code = w.poll()
            if code is not None:
                if code < 0:
                    try:
                        how = f"killed by {signal.Signals(-code).name}"
                    except ValueError:
                        how = f"killed by signal {-code}"
                else:
                    how = f"exit code {code}"
                return f"rank {rank} (pid {w.pid}) died ({how})"
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def stop_lost_workers(workers: list[subprocess.Popen]) -> str | None:
    """On rank 0, after a collective failed: name the rank that died (:func:`dead_worker`), then stop the
    others and reap them all. A failed group runs no collective again, so a follower left running would only
    wait, then fail, and end defunct while rank 0 lives on (a server kept up after it lost its engine)."""
    died = dead_worker(workers)
    stop_workers(workers, finished=False)
    return died


def join_group(device=None, timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallelGroup:
    """Join the process group torchrun's variables describe; returns this rank's :class:`TensorParallelGroup`.

    ``device``: "cpu" (gloo) or "cuda" (NCCL, this rank's GPU cuda:LOCAL_RANK); default cuda when
    available. ``timeout_s`` bounds every collective (gloo's and NCCL's own timeout).
    Raises ValueError when the variables are missing or there are fewer GPUs than ranks.
    """
    missing = [name for name in _ENV if name not in os.environ]
    if missing:
        raise ValueError(f"{', '.join(missing)} not set: start the ranks with torchrun or --tensor-parallel-size")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = resolve_device(device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        if local >= torch.cuda.device_count():
            raise ValueError(f"rank {rank} needs cuda:{local} but this machine has {torch.cuda.device_count()} "
                             f"GPU(s): NCCL runs one rank per GPU; use --device cpu or fewer ranks")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), rank=rank, world_size=world_size,
                            **({"device_id": device} if backend == "nccl" else {}))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
    return TensorParallelGroup(rank, world_size, backend, device, timeout_s, control)


def leave_group() -> None:
    """Tear the process group down (after the last collective of this rank)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def pin_to_core(rank: int) -> int | None:
    """Pin this process to one of the cores it may use (rank modulo their count) and run one torch
    thread; returns the core, or None where affinity cannot be set. Warns when ranks outnumber cores."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        torch.set_num_threads(1)
        return None
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if rank == 0 and world_size > len(cores):
        warnings.warn(f"{world_size} ranks on {len(cores)} cores: ranks share cores and wait for each other "
                      "at every all-reduce; use at most one rank per core", RuntimeWarning)
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return core
