"""The serving batch's decode attention, faster: read each request's blocks in place, in C.

The reference :class:`~minillm.serving.paged_attention.PagedBatch` gathers every decoding request's
blocks into one contiguous [B_dec, n_kv_heads, S, head_dim] copy, padded to the longest request,
then runs one masked SDPA: every layer copies the whole K/V of the batch once and attends over the
padding too. :class:`FastPagedBatch` runs instead :func:`minillm.fast.kernels.paged_decode_attention`
(vLLM's paged_attention on a CPU, flash-decoding's split of the keys), which finds each key through
the block table where it lies and reads only the request's own positions::

    request b, key j:   k_pool[layer][block_tables[b, j // block_size], j % block_size, kv_head, :]

Prefill chunks keep the reference path (their gather is one request's blocks, small next to the
chunk's products; the module's own C loops then take a long enough chunk), with one change in bfloat16
and float16: a chunk that reaches SDPA has its queries and keys padded to a multiple of CHUNK_PAD_ROWS
(:meth:`FastPagedBatch.attend_chunk`). SDPA's flash kernel builds an
AMX micro-kernel for every block shape it meets and keeps each one for the life of the thread, without limit
(``cpublas::brgemm``'s cache in torch 2.13); a server's chunks come in every length, so its memory grew with
every new one (benchmarks/sdpa_shape_cache.py, 1,200 chunks of random lengths: +157 MiB in use, padded +29
MiB, flat from the first 400). Same values as the reference up to float32 rounding (the softmax summed in another
order). Swapped in by :func:`use_fast_paged_attention` when the speed layer loads a model (float32 or
bfloat16 on a CPU, head_dim a multiple of 8, the C kernels built); ``--no-fast`` runs the reference. A
bfloat16 pool is read as it lies, half float32's bytes, each key and value widened to float32 in the kernel:
at batch 32 the reference's gather and SDPA were 46 % of a SmolLM2-135M bfloat16 decode step, and the step took
120 ms so against 85 (BENCHMARKS.md, "bfloat16: decode and serving").
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ..serving.paged_attention import PagedBatch
from . import kernels
from .attention import c_kernels_fit, prefill_in_bf16, prefill_pays, score_scale

CHUNK_PAD_ROWS = 32  # a chunk's queries and keys, rounded up to this: a few shapes for SDPA's per-shape kernels


class FastPagedBatch(PagedBatch):
    """:class:`~minillm.serving.paged_attention.PagedBatch` whose decodes attend in C over the pool.

    Args:
        blocks: the model's blocks, read as the step is built: each attention's score scale (its ``scale``,
            ``ModelConfig.attn_scale``; 1/√head_dim where None) by the cache layer it writes, and whether every
            layer runs a long enough prefill chunk's attention in C (:class:`~minillm.fast.attention.FastAttention`'s
            ``c_prefill``): such a chunk is not padded.
        the rest: as :class:`~minillm.serving.paged_attention.PagedBatch`.

    Raises ValueError when a decode's block table names a block outside the pool or is too short
    for its context (checked once per step, not per layer).
    """

    def __init__(self, blocks, cache, *args, **kwargs):
        super().__init__(cache, *args, **kwargs)
        # (read each step, not once at load: a scale set after loading is the one the model's own attention uses)
        self.scales = {b.attn.layer: score_scale(b.attn) for b in blocks}
        self.c_prefill = all(getattr(b.attn, "c_prefill", False) for b in blocks)
        self.decode_first = torch.zeros_like(self.decode_context_lens)
        if len(self.decode_rows) and not kernels.paged_ranges_fit(
                self.decode_block_tables, self.decode_first, self.decode_context_lens, cache.num_blocks,
                cache.block_size):
            raise ValueError(f"a decode's block table does not cover its context, or names a block outside the pool "
                             f"({cache.num_blocks} blocks): tables {self.decode_block_tables.tolist()}, context "
                             f"lengths {self.decode_context_lens.tolist()}")

    def attend_decodes(self, layer: int, q_dec: torch.Tensor, attention, window: int | None) -> torch.Tensor:
        """As :meth:`PagedBatch.attend_decodes`, by the C kernel over the blocks in place
        (``attention``, the module's SDPA call, is not needed: the kernel is the attention)."""
        first = self.decode_first if window is None else (self.decode_context_lens - window).clamp(min=0)
        return kernels.paged_decode_attention(q_dec, self.cache.k[layer], self.cache.v[layer],
                                              self.decode_block_tables, first, self.decode_context_lens,
                                              self.scales[layer], check=False)

    def attend_chunk(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attention,
                     window: int | None) -> torch.Tensor:
        """As :meth:`PagedBatch.attend_chunk`; in bfloat16 and float16 (no sliding window), where SDPA takes the chunk
        (not the module's C loops), over queries and keys padded with zeros to multiples of CHUNK_PAD_ROWS,
        the padding's rows of the output dropped::

            keys    0 .. S-1 | S .. S2-1  (padding: masked for every query)
            queries the last T of the S keys (query t sees keys 0 .. S-T+t) | T .. T2-1 (padding: sees key 0)

        A first chunk (T = S) pads both by the same rows and stays SDPA's causal case: its queries are still the
        last of its keys, and no real query sees a padded key (they come after it). The same values as without the
        padding up to the order of the sums (the flash kernel's blocks change)."""
        T, S = q.shape[2], keys.shape[2]
        T2, S2 = -(-T // CHUNK_PAD_ROWS) * CHUNK_PAD_ROWS, -(-S // CHUNK_PAD_ROWS) * CHUNK_PAD_ROWS
        if (window is not None or q.dtype not in (torch.bfloat16, torch.float16) or (T2, S2) == (T, S)
                or prefill_in_bf16(q, keys, values) or (self.c_prefill and prefill_pays(T, S))):
            # (the C loops take every length as it is)
            return attention(q, keys, values, None)
        q2 = F.pad(q, (0, 0, 0, T2 - T))
        keys, values = F.pad(keys, (0, 0, 0, S2 - S)), F.pad(values, (0, 0, 0, S2 - S))
        if T == S:
            return attention(q2, keys, values, None)[:, :, :T]
        t, j = torch.arange(T2, device=q.device)[:, None], torch.arange(S2, device=q.device)[None, :]
        mask = ((j <= S - T + t) & (j < S)) | ((t >= T) & (j == 0))  # [T2, S2] bool, True: may attend
        return attention(q2, keys, values, mask)[:, :, :T]


def use_fast_paged_attention(model) -> None:
    """Give the serving engine :class:`FastPagedBatch` for ``model`` (``model.paged_batch``, which
    :func:`minillm.serving.model_runner.run_model` calls to build each step's batch) where the C kernel
    runs (:func:`~minillm.fast.attention.c_kernels_fit`); elsewhere the reference stays (None)."""
    if not c_kernels_fit(model):
        model.paged_batch = None
        return
    model.paged_batch = partial(FastPagedBatch, model.blocks)
