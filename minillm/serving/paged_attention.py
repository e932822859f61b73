"""One step's batch as the model sees it: every request's new tokens in one flat row.

The scheduler hands over requests of very different shapes: a 300-token prefill chunk
next to twenty 1-token decodes. Padding them to a rectangle would waste compute on the
pad, so the tokens are laid end to end (vLLM's "flattened" batch) and each token carries
its own position and the pool slot its K/V goes to::

    request:     A (prefill chunk)     B     C      (B, C decode)
    token_ids:   a5 a6 a7 a8           b9    c41    [N = 6]
    positions:   5  6  7  8            9     41
    slots:       from A's block table  B's   C's

Everything but attention is per token, so the layers run on [1, N, d_model] unchanged.
Attention is per request: each reads its own K/V from the pool through its block table.
This module writes the reference path: gather the request's blocks into a contiguous
view, then scaled dot-product attention with the mask that hides what it must not see:

- the decodes, together: queries [B_dec, heads, 1, head_dim] against their gathered K/V
  padded to the longest, with a mask hiding positions past each one's length;
- each prefill chunk on its own: its queries against its K/V with the causal mask offset
  by the positions already in the cache (the same rectangular mask as a prefix-cache hit):
  the chunk's queries are the last of the keys, the case ``Attention`` masks itself when
  handed no mask (and a first chunk's square is SDPA's ``is_causal``, which skips the
  masked half).

A sliding-window layer (W) masks more: a decode sees only its last W positions, a chunk's
queries the band of :func:`~minillm.model.causal_mask`. The pool still holds every position
(the blocks do not roll), so the window saves compute here, not memory.

A production kernel (vLLM's paged_attention, FlashInfer) reads the blocks in place
without the gather copy; on a CPU the gather costs one extra read and write of the K/V, and
the decodes' padding to the longest is attended too. The speed layer's version of the decodes'
half does the same in C (:mod:`minillm.fast.paged_attention`, swapped in by ``load_model``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model import Transformer
from .paged_cache import PagedKVCache


@dataclass
class PrefillChunk:
    """A request whose step computes ``end - start`` > 1 tokens (tokens start..end-1 of the flat row).

    ``context_len``: positions it attends over (cached before + this chunk);
    ``block_table``: [n_blocks] int64, enough blocks for ``context_len``.
    """

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor


class PagedBatch:
    """The flat token row of one step, with what paged attention needs to find each request's K/V.

    Args:
        cache: the :class:`PagedKVCache` pool.
        token_ids: [N] int64, every scheduled token, request after request.
        positions: [N] int64, each token's position in its own sequence.
        slots: [N] int64, the pool slot each token's K/V is written to.
        decode_rows: [B_dec] int64, the indices in the row of the 1-token (decode) requests.
        decode_block_tables: [B_dec, max_blocks] int64 (short tables padded with block 0, masked).
        decode_context_lens: [B_dec] int64, positions each decode attends over (its own included).
        prefills: one :class:`PrefillChunk` per request with more than one token.
        logits_rows: [R] int64, the rows whose logits are wanted (each request's last token,
            when that token completes its known tokens and so samples the next one).
    """

    def __init__(self, cache: PagedKVCache, token_ids, positions, slots, decode_rows, decode_block_tables,
                 decode_context_lens, prefills: list[PrefillChunk], logits_rows):
        self.cache = cache
        self.token_ids, self.positions, self.slots = token_ids, positions, slots
        self.decode_rows, self.decode_block_tables = decode_rows, decode_block_tables
        # rows a, a+1, ... in order (every decode, in a step without a prefill) are a slice: a view of q, not a gather
        rows = decode_rows.tolist() if decode_rows.device.type == "cpu" else []  # (a GPU's: no sync for it)
        in_order = bool(rows) and rows == list(range(rows[0], rows[0] + len(rows)))
        self.decode_span = slice(rows[0], rows[0] + len(rows)) if in_order else decode_rows
        self.prefills, self.logits_rows = prefills, logits_rows
        keys = torch.arange(decode_block_tables.shape[1] * cache.block_size, device=token_ids.device)
        self.decode_mask = (keys[None, :] < decode_context_lens[:, None])[:, None, None, :]  # [B_dec, 1, 1, S]
        self.decode_keys, self.decode_context_lens = keys, decode_context_lens

    def _decode_mask(self, window: int | None) -> torch.Tensor:
        """[B_dec, 1, 1, S] bool: each decode's filled positions, only the last ``window`` of them if set."""
        if window is None:
            return self.decode_mask
        recent = self.decode_keys[None, :] >= self.decode_context_lens[:, None] - window
        return self.decode_mask & recent[:, None, None, :]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention,
               window: int | None = None) -> torch.Tensor:
        """Write this step's K/V into the pool, then ``attention(q, keys, values, mask)`` of every request
        over its own K/V (what :class:`~minillm.model.Attention` asks of a cache).

        q [1, n_heads, N, head_dim]; k, v [1, n_kv_heads, N, head_dim] (RoPE applied); ``window``: the
        layer's sliding window W (the masks hide what it cuts), or None. Returns
        [1, n_heads, N, head_dim], each token's output from its own request's keys.
        """
        self.cache.write(layer, k[0].transpose(0, 1), v[0].transpose(0, 1), self.slots)
        if len(self.decode_rows):
            q_dec = q[0, :, self.decode_span].transpose(0, 1)  # [B_dec, n_heads, head_dim]
            out_dec = self.attend_decodes(layer, q_dec, attention, window).transpose(0, 1)[None]
            if not self.prefills and isinstance(self.decode_span, slice) and len(self.decode_rows) == q.shape[2]:
                return out_dec
        # laid out [1, N, n_heads, head_dim], as the caller reshapes it to [1, N, n_heads · head_dim]: a view
        out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)
        if len(self.decode_rows):
            out[:, :, self.decode_span] = out_dec
        for chunk in self.prefills:
            if chunk.context_len == chunk.end - chunk.start:  # a prompt's first chunk: its keys are all this step's
                keys, values = k[:, :, chunk.start : chunk.end], v[:, :, chunk.start : chunk.end]
            else:
                keys, values = self.cache.gather(layer, chunk.block_table[None])
                keys, values = keys[:, :, : chunk.context_len], values[:, :, : chunk.context_len]
            out[:, :, chunk.start : chunk.end] = self.attend_chunk(q[:, :, chunk.start : chunk.end], keys, values,
                                                                   attention, window)
        return out

    def attend_chunk(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attention,
                     window: int | None) -> torch.Tensor:
        """One prefill chunk's attention: q [1, n_heads, T, head_dim] over its request's keys and values
        [1, n_kv_heads, S, head_dim], T <= S. Its queries are the last T of the S keys, the case ``attention``
        masks itself when handed no mask (causal, and the ``window`` band). Returns [1, n_heads, T, head_dim]."""
        return attention(q, keys, values, None)

    def attend_decodes(self, layer: int, q_dec: torch.Tensor, attention, window: int | None) -> torch.Tensor:
        """The decodes' attention, all in one call: q_dec [B_dec, n_heads, head_dim] (one query each) ->
        [B_dec, n_heads, head_dim], each over its own K/V, gathered and padded to the longest, masked."""
        keys, values = self.cache.gather(layer, self.decode_block_tables)  # [B_dec, n_kv_heads, S, head_dim]
        return attention(q_dec.unsqueeze(2), keys, values, self._decode_mask(window)).squeeze(2)


def forward_batch(model: Transformer, batch: PagedBatch) -> torch.Tensor:
    """Run the model over one flat batch; returns float32 logits [R, vocab] of ``batch.logits_rows``.

    :meth:`Transformer.forward` itself, with per-token positions and this batch as the cache (paged
    attention). Only the rows that sample go through the LM head, the largest matmul of a small model.
    """
    with torch.inference_mode():
        logits = model(batch.token_ids[None], cache=batch, positions=batch.positions, logits_rows=batch.logits_rows)
        return logits[0].float()
