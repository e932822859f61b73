"""Paged attention equals contiguous-cache attention (within 1e-5, float32).

The oracle is the plain path: a sequence's K/V laid end to end and
``F.scaled_dot_product_attention`` with the rectangular causal mask. The paged path must
give the same output for sequences whose length ends exactly on a block boundary, one
before and one after, for prefill chunks (from position 0 or onto cached positions) and
decodes, alone and all in one flat batch. The pool is filled with noise first, and the
requests' blocks are handed out round-robin, so a wrong mask or a wrong block order shows.
"""

import pytest
import torch
import torch.nn.functional as F

from minillm.model import causal_mask, sdpa_attention
from minillm.sampling import SamplingParams
from minillm.serving.block_allocator import slot_mapping
from minillm.serving.model_runner import prepare_batch
from minillm.serving.paged_attention import PagedBatch
from minillm.serving.paged_cache import PagedKVCache
from minillm.serving.request import Request
from minillm.serving.scheduler import ScheduledBatch

N_HEADS, N_KV_HEADS, HEAD_DIM = 4, 2, 8  # GQA: 2 query heads per K/V head
LENGTHS = [15, 16, 17, 31, 32, 33]


def make_case(lengths, chunks, block_size, seed=0):
    """A pool holding each sequence's first ``length - chunk`` positions, and the q, k, v of its chunk.

    Returns (cache, scheduled batch, q [1, H, N, D], k, v [1, Hkv, N, D], the full K/V per sequence).
    """
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    cache = PagedKVCache(1, N_KV_HEADS, HEAD_DIM, num_blocks, block_size, enable_prefix_caching=False)
    cache.k.normal_(generator=g)  # stale values everywhere: a position the mask lets through shows
    cache.v.normal_(generator=g)
    requests = [Request(str(i), list(range(n)), SamplingParams(), 0.0) for i, n in enumerate(lengths)]
    for n_blocks in range(1, num_blocks):  # grow the tables one block at a time, round-robin: interleaved
        for r, n in zip(requests, lengths):
            cache.allocator.allocate_slots(r.request_id, min(n, n_blocks * block_size))
    full_k, full_v = [], []
    for r, n, c in zip(requests, lengths, chunks):
        k = torch.randn(n, N_KV_HEADS, HEAD_DIM, generator=g)
        v = torch.randn(n, N_KV_HEADS, HEAD_DIM, generator=g)
        table = cache.allocator.block_tables[r.request_id]
        slots = torch.tensor(slot_mapping(table, 0, n - c, block_size), dtype=torch.long)
        cache.write(0, k[: n - c], v[: n - c], slots)  # what earlier steps computed
        r.num_computed_tokens = n - c
        full_k.append(k)
        full_v.append(v)
    scheduled = ScheduledBatch(requests, list(chunks))
    q = torch.randn(1, N_HEADS, sum(chunks), HEAD_DIM, generator=g)
    k_new = torch.cat([k[n - c :] for k, n, c in zip(full_k, lengths, chunks)]).transpose(0, 1)[None]
    v_new = torch.cat([v[n - c :] for v, n, c in zip(full_v, lengths, chunks)]).transpose(0, 1)[None]
    return cache, scheduled, q, k_new, v_new, full_k, full_v


def contiguous_attention(q, k, v, scale):
    """The oracle: q [1, H, c, D] against one sequence's whole k, v [n, Hkv, D], causal."""
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    mask = causal_mask(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def check(lengths, chunks, block_size, listed=None):
    """``listed``: the decodes' order in the batch's lists (rows, tables, lengths), prepare_batch's if None."""
    cache, scheduled, q, k, v, full_k, full_v = make_case(lengths, chunks, block_size)
    batch, _ = prepare_batch(cache, scheduled)
    if listed is not None:
        batch = PagedBatch(cache, batch.token_ids, batch.positions, batch.slots, batch.decode_rows[listed],
                           batch.decode_block_tables[listed], batch.decode_context_lens[listed], batch.prefills,
                           batch.logits_rows)
    scale = HEAD_DIM**-0.5
    def sdpa(q, keys, values, mask):  # what Attention hands a cache: the cache's mask, or None: causal, the
        return sdpa_attention(q, keys, values, mask, scale)  # queries being the last of the keys

    out = batch.attend(0, q, k, v, sdpa)
    start = 0
    for n, c, fk, fv in zip(lengths, chunks, full_k, full_v):
        expected = contiguous_attention(q[:, :, start : start + c], fk, fv, scale)
        torch.testing.assert_close(out[:, :, start : start + c], expected, atol=1e-5, rtol=0,
                                   msg=lambda m: f"length {n}, chunk {c}, block_size {block_size}: {m}")
        start += c
    # attend() also wrote the new K/V into the pool: every position now reads back whole
    for r, n, fk in zip(scheduled.requests, lengths, full_k):
        table = torch.tensor(cache.allocator.block_tables[r.request_id])[None]
        keys, _ = cache.gather(0, table)
        torch.testing.assert_close(keys[0, :, :n], fk.transpose(0, 1), atol=0, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("kind", ["prefill from 0", "chunk onto cache", "decode"])
def test_one_sequence_matches_contiguous(kind, length, block_size):
    chunk = {"prefill from 0": length, "chunk onto cache": 6, "decode": 1}[kind]
    check([length], [chunk], block_size)


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_matches_contiguous(block_size):
    # every length twice: once as a decode, once as a prefill chunk (whole, or onto a cached start)
    lengths = LENGTHS + LENGTHS
    chunks = [1] * len(LENGTHS) + [n if i % 2 else n - 13 for i, n in enumerate(LENGTHS)]
    check(lengths, chunks, block_size)


def test_single_token_prompt_and_one_token_last_chunk():
    # a 1-token request goes down the decode path: a 1-token prompt, and a prompt's last token alone
    check([1, 17, 16], [1, 1, 16], block_size=4)


@pytest.mark.parametrize("listed", [[3, 2, 1, 0], [0, 2, 1, 3], [1, 0, 2, 3]])
@pytest.mark.parametrize("prefill", ["none", "first", "last"])
def test_decodes_listed_in_any_order_attend_over_their_own_blocks(listed, prefill):
    """The batch's lists say which row has which block table: decodes listed out of row order (rows 3 2 1 0, or 0 2
    1 3: a run of rows that is not a slice) still attend each over its own blocks, beside a prefill chunk or not."""
    lengths, chunks = [15, 16, 17, 33], [1, 1, 1, 1]
    if prefill == "first":
        lengths, chunks = [31] + lengths, [12] + chunks
    elif prefill == "last":
        lengths, chunks = lengths + [31], chunks + [12]
    check(lengths, chunks, block_size=4, listed=listed)
