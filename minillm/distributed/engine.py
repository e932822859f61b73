"""The serving engine on a tensor-parallel model: rank 0 schedules and samples, the other ranks follow its batches.

    rank 0: LLMEngine (scheduler, block tables, sampling, clients)      ranks 1..N-1: follow()
      step: schedule -> copy-on-write copies -> flat batch  ──send──>   the same copies on its cache shard
            forward_batch over its cache shard   <── all-reduces ──>    forward_batch over its cache shard
            sample the logits rows (the all-gather gave it the whole vocabulary)

Every rank holds a paged KV cache of the same number of blocks, each block its own heads' K/V: rank
0's block tables address every rank's pool alike. So a step's message is just the flat batch
(:class:`~minillm.serving.paged_attention.PagedBatch`'s tensors, as lists) and the blocks copy on
write copied before it; the followers keep no scheduler, allocator or request state at all.

:func:`lead_engine` turns rank 0's engine into the leader: its model becomes a :class:`LeadingTransformer`
(the same module, one method more, as :mod:`minillm.fast` swaps classes), whose forward pass over a
serving batch first sends that batch.
"""

from __future__ import annotations

import torch

from ..model import Transformer
from ..serving.paged_attention import PagedBatch, PrefillChunk, forward_batch
from ..serving.paged_cache import PagedKVCache
from .comm import TensorParallelGroup


class LeadingTransformer(Transformer):
    """Rank 0's model in a tensor-parallel engine: a forward pass over a serving batch sends the batch to
    the other ranks first (with the copy-on-write copies made since the last one), then runs as usual."""

    pending_copies: list[tuple[int, int]]

    def forward(self, token_ids, cache=None, hook=None, last_only=False, positions=None, logits_rows=None):
        if isinstance(cache, PagedBatch):
            copies, self.pending_copies = self.pending_copies, []
            self.tensor_parallel.broadcast_object(("step", (batch_message(cache), copies)))
        return super().forward(token_ids, cache, hook, last_only, positions, logits_rows)


def lead_engine(engine) -> None:
    """Make ``engine`` (an LLMEngine over a model :func:`~minillm.distributed.tensor_parallel.shard_model`
    split, on rank 0) send each step's batch to the other ranks, which run :func:`follow_engine` (through
    :func:`~minillm.distributed.follow.follow`). Raises TensorParallelError when a follower is gone."""
    model, cache = engine.model, engine.cache
    group: TensorParallelGroup = model.tensor_parallel
    group.broadcast_object(("engine", (cache.num_blocks, cache.block_size)))
    model.__class__ = LeadingTransformer  # one method more; every parameter stays the same object
    model.pending_copies = []
    copy_pending = cache.copy_pending

    def copy_and_remember() -> int:  # the followers make the same copies in their shards before the step
        model.pending_copies += cache.allocator.pending_copies
        return copy_pending()

    cache.copy_pending = copy_and_remember


def batch_message(batch: PagedBatch) -> dict:
    """A PagedBatch as plain lists (any device can rebuild it): what rank 0 sends each step."""
    return {"token_ids": batch.token_ids.tolist(), "positions": batch.positions.tolist(),
            "slots": batch.slots.tolist(), "decode_rows": batch.decode_rows.tolist(),
            "decode_block_tables": batch.decode_block_tables.tolist(),
            "decode_context_lens": batch.decode_context_lens.tolist(),
            "prefills": [(c.start, c.end, c.context_len, c.block_table.tolist()) for c in batch.prefills],
            "logits_rows": batch.logits_rows.tolist()}


def follow_engine(model, num_blocks: int, block_size: int, receive) -> None:
    """On ranks 1..N-1: a pool like rank 0's, then each step rank 0 sends until ``receive()`` (the next
    message) is not a step; returns that message, for the caller's loop."""
    cache = PagedKVCache.for_model(model, num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)
    device = cache.k.device
    while True:
        kind, payload = message = receive()
        if kind != "step":
            return message
        batch, copies = payload
        if copies:
            source, destination = (torch.tensor(ids, device=device) for ids in zip(*copies))
            cache.k[:, destination] = cache.k[:, source]
            cache.v[:, destination] = cache.v[:, source]
        forward_batch(model, _rebuild(cache, batch))


def _rebuild(cache: PagedKVCache, m: dict) -> PagedBatch:
    device = cache.k.device
    long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    rows = m["decode_block_tables"]
    tables = long(rows).reshape(len(rows), len(rows[0]) if rows else 1)  # no decodes: [0, 1], as rank 0 made it
    prefills = [PrefillChunk(start, end, context_len, long(table)) for start, end, context_len, table in m["prefills"]]
    return PagedBatch(cache, long(m["token_ids"]), long(m["positions"]), long(m["slots"]), long(m["decode_rows"]),
                      tables, long(m["decode_context_lens"]), prefills, long(m["logits_rows"]))
