"""The serving batch's decode attention, faster: read each request's blocks in place, in C.

The reference :class:`~minillm.serving.paged_attention.PagedBatch` gathers every decoding request's
blocks into one contiguous [B_dec, n_kv_heads, S, head_dim] copy, padded to the longest request,
then runs one masked SDPA: every layer copies the whole K/V of the batch once and attends over the
padding too. :class:`FastPagedBatch` runs instead :func:`minillm.fast.kernels.paged_decode_attention`
(vLLM's paged_attention on a CPU, flash-decoding's split of the keys), which finds each key through
the block table where it lies and reads only the request's own positions::

    request b, key j:   k_pool[layer][block_tables[b, j // block_size], j % block_size, kv_head, :]

Prefill chunks keep the reference path (their gather is one request's blocks, small next to the
chunk's products). Same values as the reference up to float32 rounding (the softmax summed in another
order). Swapped in by :func:`use_fast_paged_attention` when the speed layer loads a model (float32 or
bfloat16 on a CPU, head_dim a multiple of 8, the C kernels built); ``--no-fast`` runs the reference. A
bfloat16 pool is read as it lies, half float32's bytes, each key and value widened to float32 in the kernel:
at batch 32 the reference's gather and SDPA were 46 % of a SmolLM2-135M bfloat16 decode step, and the step took
120 ms so against 85 (BENCHMARKS.md, "bfloat16: decode and serving").
"""

from __future__ import annotations

from functools import partial

import torch

from ..serving.paged_attention import PagedBatch
from . import kernels
from .attention import c_kernels_fit


class FastPagedBatch(PagedBatch):
    """:class:`~minillm.serving.paged_attention.PagedBatch` whose decodes attend in C over the pool.

    Args:
        scales: per layer, the attention's score scale (``ModelConfig.attn_scale``: 1/√head_dim by default).
        the rest: as :class:`~minillm.serving.paged_attention.PagedBatch`.

    Raises ValueError when a decode's block table names a block outside the pool or is too short
    for its context (checked once per step, not per layer).
    """

    def __init__(self, scales: tuple[float, ...], cache, *args, **kwargs):
        super().__init__(cache, *args, **kwargs)
        self.scales = scales
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


def use_fast_paged_attention(model) -> None:
    """Give the serving engine :class:`FastPagedBatch` for ``model`` (``model.paged_batch``, which
    :func:`minillm.serving.model_runner.run_model` calls to build each step's batch) where the C kernel
    runs (:func:`~minillm.fast.attention.c_kernels_fit`); elsewhere the reference stays (None)."""
    if not c_kernels_fit(model):
        model.paged_batch = None
        return
    scales = tuple(block.attn.scale for block in model.blocks)
    model.paged_batch = partial(FastPagedBatch, scales)
