"""The process group a tensor-parallel model's ranks share, and the two collectives it uses.

    all-reduce   every rank holds a partial sum [.., d_model]; afterwards every rank holds the sum.
                 Ring algorithm: each rank sends and receives 2(N-1)/N of the tensor's bytes
                 (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms"), whatever N is.
    all-gather   every rank holds one slice [.., V/N]; afterwards every rank holds all N, concatenated.
                 Each rank receives the (N-1)/N of the whole it lacks.

With a trace attached (``with group.recording(trace): ...``), each collective records one event
(kind "all_reduce" or "all_gather": the module that called it, the tensor's shape and bytes, the
ring's bytes per rank, start_ms and time_ms), so a student sees what communication each layer
adds. Without one nothing is timed. A rank that is gone (it died, or it stopped answering for
``timeout_s``) makes the collective fail on the others: they raise :class:`TensorParallelError`,
one line, instead of waiting forever.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import EngineLostError, MiniLLMError


class TensorParallelError(EngineLostError):
    """A collective failed: another rank died or did not answer within the group's timeout. One line: the
    operation, and which rank died when rank 0's launcher knows (no gloo/NCCL internals)."""


class TensorParallelSizeError(MiniLLMError, ValueError):
    """The model's head counts or MLP width do not split into the asked number of ranks."""


@dataclass
class TensorParallelGroup:
    """The ranks one model is split over, as this rank sees them.

    Attributes:
        rank: this process's rank, 0..world_size-1; rank 0 decides (schedules, samples, prints).
        world_size: N, how many ranks share the model.
        backend: "gloo" (CPU) or "nccl" (CUDA).
        device: where this rank's shard lives (cpu, or cuda:LOCAL_RANK).
        timeout_s: how long a collective of a forward pass waits for the other ranks before it fails.
        control: the gloo process group rank 0's messages travel on (:meth:`broadcast_object`), with a
            timeout of its own: a follower waits for the next request as long as a server stays idle.
            None: the default group.
        trace: the :class:`~minillm.trace.Trace` collectives record into, set by :meth:`recording`; None: no timing.
        cores: the CPU cores all ranks run on together (N ranks pinned one a core: min(N, cores)), set when they
            are pinned; what a "machine busy" note compares the load with, not this rank's one core. None: unpinned.
        who_died: on rank 0 when it started the other ranks: returns "rank R (pid P) died (killed by SIGKILL)"
            or None, named in a failed collective's error (:func:`~minillm.distributed.launch.stop_lost_workers`,
            which then stops the other ranks too: a group whose collective failed runs no other).
        first_dead: on rank 0 when it started the other ranks: the same words for a rank that has ended, or
            None, asking without waiting and stopping nothing (a server's watchdog polls it while idle).
    """

    rank: int
    world_size: int
    backend: str
    device: torch.device
    timeout_s: float
    control: object | None = field(default=None, repr=False)
    trace: object | None = field(default=None, repr=False)
    cores: int | None = None
    who_died: Callable[[], str | None] | None = field(default=None, repr=False)
    first_dead: Callable[[], str | None] | None = field(default=None, repr=False)

    @contextmanager
    def recording(self, trace):
        """Record every collective run inside the block into ``trace`` (None: record nothing)."""
        previous, self.trace = self.trace, trace
        try:
            yield trace
        finally:
            self.trace = previous

    def all_reduce(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Sum ``x`` over the ranks in place and return it (the same values on every rank).

        ``name``: the module asking (recorded in the trace and named in errors).
        Raises TensorParallelError when another rank is gone.
        """
        ring_bytes = 2 * (self.world_size - 1) / self.world_size * _nbytes(x)
        with self._timed("all_reduce", name, x, ring_bytes):
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """[.., n] on each rank (the same n everywhere) -> [.., N·n], rank 0's slice first.

        Raises TensorParallelError when another rank is gone.
        """
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        ring_bytes = (self.world_size - 1) * _nbytes(x)
        with self._timed("all_gather", name, x, ring_bytes):
            dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj=None):
        """Rank 0's ``obj`` on every rank (pickled; for small messages, not tensors of a pass).

        Raises TensorParallelError when another rank is gone.
        """
        box = [obj]
        on_nccl = self.control is None and self.backend == "nccl"
        with self._failures("a message from rank 0" if self.rank else "sending a message to the other ranks"):
            dist.broadcast_object_list(box, src=0, group=self.control, device=self.device if on_nccl else None)
        return box[0]

    @contextmanager
    def _timed(self, kind: str, name: str, x: torch.Tensor, ring_bytes: float):
        trace = self.trace
        with self._failures(f"the {kind.replace('_', '-')} of {name}"):
            if trace is None:
                yield
                return
            _sync(x.device)
            start_ms = trace.now_ms()
            yield
            _sync(x.device)
            end_ms = trace.now_ms()
        trace.record(kind, t_ms=end_ms, name=name, shape=list(x.shape), bytes=_nbytes(x),
                     ring_bytes_per_rank=int(ring_bytes), world_size=self.world_size, backend=self.backend,
                     start_ms=start_ms, time_ms=end_ms - start_ms)

    @contextmanager
    def _failures(self, what: str):
        try:
            yield
        # gloo and NCCL raise RuntimeError subclasses (DistBackendError, ...); a broadcast cut off mid-message
        # (its sender died) leaves the next one's bytes misread: an unpickling error, not a message
        except (RuntimeError, pickle.UnpicklingError, EOFError) as e:
            raise TensorParallelError(f"rank {self.rank} of {self.world_size}: {what} failed: {self._cause(e)}") \
                from None

    def _cause(self, error: Exception) -> str:
        """Why a collective failed, in our words: gloo's own text names its source files, not the rank."""
        died = self.who_died() if self.who_died is not None else None
        if died:
            return died
        if "timed out" in str(error).lower() or "timeout" in str(error).lower():
            return f"another rank did not answer within {self.timeout_s:g} s"
        return "another rank is gone (its connection closed)"


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
