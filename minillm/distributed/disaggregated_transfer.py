"""The hand-off of disaggregated serving: a finished prompt's K/V from the prefill worker to the decode worker.

Lesson 10's formula, now over a real link between two processes::

    bytes = prompt positions P · kv_bytes_per_token
          = P · 2 (K, V) · n_layers · n_kv_heads · head_dim · dtype bytes      (minillm.costs)

One hand-off, prefill worker (rank 0) -> decode worker (rank 1)::

    control   a multiprocessing queue    HandOff: request id, prompt, first token, times (pickled, small)
    data      torch.distributed send     k [n_layers, P, n_kv_heads, head_dim], then v, the model's dtype:
                                         every layer's K/V of the prompt's filled positions only,
                                         gathered out of the paged pool's blocks

The split is the one vLLM's disaggregated connectors make (a side channel for metadata, NCCL or
NIXL for the KV): the decode worker reads the small control queue between its decode steps
without blocking, and only then posts the receives for the tensors. (gloo's ``irecv`` cannot be
polled: its ``is_completed`` stays False until ``wait``.) The prefill worker sends from a thread
(:class:`HandOffSender`), so its next prefill never waits for the decode worker to be between steps.

Why ``torch.distributed`` send/recv rather than shared memory: shared memory only works inside one
machine, and a real deployment puts the two pools on different GPUs or servers. There the K/V
moves by point-to-point transfers between the devices' memories (NCCL's send/recv over NVLink or
InfiniBand, or NIXL's RDMA reads in vLLM's and Dynamo's connectors), never through a shared page.
``dist.send``/``dist.recv`` are that path: the same code runs on gloo (CPU tensors, TCP over
127.0.0.1 here) and on NCCL (GPU tensors), and the bytes really cross a link that can be timed
against the formula. Shared memory would be faster on one machine, and would measure nothing.
A send completes only once the receiver has posted its receive (a rendezvous), so the link's time
for the bytes runs from the later of the two to the last byte received (:func:`receive_kv`).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..serving.block_allocator import slot_mapping
from ..serving.paged_cache import PagedKVCache
from ..serving.request import Request

PREFILL_RANK, DECODE_RANK = 0, 1


@dataclass
class HandOff:
    """What the decode worker needs besides the K/V to continue a request as if it had prefilled it.

    Attributes:
        request_id, prompt_ids, params, arrival_s, first_scheduled_s: the request's, unchanged.
        first_token: the token the prefill sampled (the decode worker's first input).
        first_token_s: when it was sampled (``time.perf_counter()``; one clock for every process on
            Linux, CLOCK_MONOTONIC).
        generator_state: the request's sampling generator after its first draw
            (``torch.Generator.get_state()``), or None for the global one (greedy needs none).
        sent_s: when the prefill worker's sender started on it, just before the notice and the sends
            (its queue may have held it before).
    """

    request_id: str
    prompt_ids: list[int]
    params: object
    arrival_s: float
    first_scheduled_s: float
    first_token: int
    first_token_s: float
    generator_state: torch.Tensor | None
    sent_s: float = 0.0


@dataclass(frozen=True)
class Received:
    """A hand-off as the decode worker got it.

    Attributes:
        hand_off: the :class:`HandOff`.
        k, v: [n_layers, P, n_kv_heads, head_dim], the model's dtype.
        num_bytes: bytes of k and v together (P · kv_bytes_per_token; the small HandOff notice is not
            counted, as the formula does not count it).
        transfer_s: the link's time for k and v (s): from the later of the receive posted and the send
            started (``HandOff.sent_s``) to the last byte of v.
        received_s: when the last byte arrived (``time.perf_counter()``).
    """

    hand_off: HandOff
    k: torch.Tensor
    v: torch.Tensor
    num_bytes: int
    transfer_s: float
    received_s: float


def gather_prompt_kv(cache: PagedKVCache, block_table: list[int], num_positions: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V of positions 0..num_positions-1 of one request, out of the paged pool.

    ``block_table``: the request's blocks in logical order. Returns k, v, each
    [n_layers, num_positions, n_kv_heads, head_dim], contiguous copies (the blocks can be freed).
    """
    n_layers, _, block_size, n_kv_heads, head_dim = cache.k.shape
    blocks = torch.tensor(block_table[: -(-num_positions // block_size)], device=cache.k.device)
    run = (n_layers, len(blocks) * block_size, n_kv_heads, head_dim)
    k = cache.k.index_select(1, blocks).reshape(run)[:, :num_positions].contiguous()
    v = cache.v.index_select(1, blocks).reshape(run)[:, :num_positions].contiguous()
    return k, v


def scatter_prompt_kv(cache: PagedKVCache, block_table: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Write k, v [n_layers, P, n_kv_heads, head_dim] at positions 0..P-1 of a request whose
    blocks (``block_table``, already allocated for P positions) are in ``cache``."""
    n_layers, num_blocks, block_size, n_kv_heads, head_dim = cache.k.shape
    slots = torch.tensor(slot_mapping(block_table, 0, k.shape[1], block_size), device=cache.k.device)
    flat = (n_layers, num_blocks * block_size, n_kv_heads, head_dim)  # slot s is row s of every layer
    cache.k.view(flat).index_copy_(1, slots, k)
    cache.v.view(flat).index_copy_(1, slots, v)


def hand_off_of(request: Request) -> HandOff:
    """The :class:`HandOff` of a request whose prefill just sampled its first token."""
    generator = request.generator
    return HandOff(request.request_id, list(request.prompt_ids), request.params, request.arrival_s,
                   request.first_scheduled_s, request.output_ids[0], request.token_times_s[0],
                   None if generator is None else generator.get_state())


class HandOffSender:
    """The prefill worker's side: a thread that sends each hand-off's K/V, in submission order.

    Args:
        control: the queue the decode worker reads :class:`HandOff` notices from.

    :attr:`error` holds the first failure (the decode worker is gone); every later send is skipped.
    """

    def __init__(self, control):
        self.control, self.error = control, None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    def submit(self, hand_off: HandOff, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue one hand-off (k, v [n_layers, P, n_kv_heads, head_dim]); returns at once."""
        self._jobs.put((hand_off, k, v))

    def close(self) -> None:
        """Send what is queued, then tell the decode worker that no more hand-offs will come."""
        self._jobs.put(None)
        self._thread.join()
        self.control.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self.error is not None:
                continue
            hand_off, k, v = job
            try:
                hand_off.sent_s = time.perf_counter()  # the notice carries it, so it is taken just before
                self.control.put(hand_off)
                dist.send(k, DECODE_RANK)
                dist.send(v, DECODE_RANK)
            except RuntimeError as e:  # gloo's errors: the peer closed the connection or timed out
                self.error = e


def receive_kv(hand_off: HandOff, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> Received:
    """The decode worker's side: receive the K/V a :class:`HandOff` notice announced (blocking; the
    group's timeout bounds it).

    Raises RuntimeError (gloo's) when the prefill worker is gone or stops mid-message.
    """
    k = torch.empty(n_layers, len(hand_off.prompt_ids), n_kv_heads, head_dim, dtype=dtype)
    v = torch.empty_like(k)
    posted = time.perf_counter()
    dist.recv(k, PREFILL_RANK)
    dist.recv(v, PREFILL_RANK)
    end = time.perf_counter()
    # The bytes move once both sides are there (a rendezvous): from the later of the two to the end
    # (one clock for both processes: perf_counter is CLOCK_MONOTONIC on Linux).
    return Received(hand_off, k, v, k.nbytes + v.nbytes, end - max(posted, hand_off.sent_s), end)


def measure_link_bytes_s(rank: int, num_bytes: int = 64 * 2**20, repeats: int = 3) -> float | None:
    """The link's one-way bandwidth, bytes/s, measured once between the two workers (call on both).

    Rank 0 sends ``num_bytes`` and rank 1 answers with one byte; the best of ``repeats`` round trips
    (the least disturbed by other work on the machine). Returns it on rank 0, None on rank 1.
    """
    payload = torch.empty(num_bytes, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        if rank == PREFILL_RANK:
            start = time.perf_counter()
            dist.send(payload, DECODE_RANK)
            dist.recv(ack, DECODE_RANK)
            best = min(best, time.perf_counter() - start)
        else:
            dist.recv(payload, PREFILL_RANK)
            dist.send(ack, PREFILL_RANK)
    return num_bytes / best if rank == PREFILL_RANK else None
