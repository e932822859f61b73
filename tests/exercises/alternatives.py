"""Correct solutions written differently from the reference: the checks must pass them all.

A check that demands the reference's exact way of working (its order of operations, its
internal calls, its RNG draws beyond what the docstring fixes) would fail a right answer.
Each function here replaces one name of its exercise (see ``registry.py``) as a student
might write it: loops instead of one torch call, another formula with the same result.
``test_alternatives_pass.py`` runs every check of the exercise on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exercises.registry import StandIn, stand_in


@dataclass(frozen=True)
class Alternative(StandIn):
    """A correct ``fn`` standing in for ``replaces`` of ``exercise``, written another way."""


ALTERNATIVES: list[Alternative] = []


def alternative(exercise: str, replaces: str):
    return stand_in(ALTERNATIVES, Alternative, exercise, replaces)


# -- ex01 ------------------------------------------------------------------------------------------


@alternative("ex01", "causal_mask")
def mask_from_positions(n_queries, n_keys, device=None, window=None):
    """Compare each query's position with each key's, as the docstring states the rule."""
    query_pos = torch.arange(n_keys - n_queries, n_keys, device=device)[:, None]
    key_pos = torch.arange(n_keys, device=device)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask


@alternative("ex01", "causal_mask")
def mask_by_loops(n_queries, n_keys, device=None, window=None):
    """Fill a False mask cell by cell: from the first key the query may see to its own position (issue 30)."""
    mask = torch.zeros(n_queries, n_keys, dtype=torch.bool, device=device)
    for i in range(n_queries):
        position = n_keys - n_queries + i
        first = 0 if window is None else max(0, position - window + 1)
        for j in range(first, position + 1):
            mask[i, j] = True
    return mask


# -- ex02 ------------------------------------------------------------------------------------------


@alternative("ex02", "eager_attention")
def attention_one_query_at_a_time(q, k, v, hook=None, name="", scale=None, window=None):
    """Each query against only the keys it may see, in float32, cast back at the end (issue 30)."""
    B, n_heads, T, D = q.shape
    S = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    out = torch.empty(B, n_heads, T, D, dtype=torch.float32, device=q.device)
    for i in range(T):
        position = S - T + i
        first = 0 if window is None else max(0, position - window + 1)
        keys, values = k[:, :, first : position + 1].float(), v[:, :, first : position + 1].float()
        scores = torch.einsum("bhd,bhsd->bhs", q[:, :, i].float(), keys) * scale
        weights = torch.nn.functional.softmax(scores, dim=-1)
        out[:, :, i] = torch.einsum("bhs,bhsd->bhd", weights, values)
    return out.to(q.dtype)


# -- ex03 ------------------------------------------------------------------------------------------


@alternative("ex03", "RotaryEmbedding.forward")
def rope_tables_in_float64(self, positions, dtype):
    """The angles in float64 (more exact than the reference's float32), each half written separately (issue 30)."""
    from minillm.rope import rope_inv_freq

    inv_freq = self.inv_freq
    if self.dynamic:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, int(positions.max()) + 1)
    angles = torch.outer(positions.double(), inv_freq.double())
    cos, sin = torch.empty(len(positions), self.head_dim, dtype=torch.float64), torch.empty(
        len(positions), self.head_dim, dtype=torch.float64)
    half = self.head_dim // 2
    cos[:, :half], cos[:, half:] = angles.cos(), angles.cos()
    sin[:, :half], sin[:, half:] = angles.sin(), angles.sin()
    return (cos * self.attention_factor).to(dtype), (sin * self.attention_factor).to(dtype)


@alternative("ex03", "apply_rope")
def rope_rotation_of_each_half(x, cos, sin):
    """Rotate the two halves separately with the 2-D rotation formula and join them (issue 30)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# -- ex04 ------------------------------------------------------------------------------------------


@alternative("ex04", "eager_attention")
def gqa_by_repeating_kv(q, k, v, hook=None, name="", scale=None, window=None):
    """Copy each K/V head n_rep times (HF's repeat_kv), then plain multi-head attention (issue 30)."""
    from minillm.model import causal_mask

    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    T, S, D = q.shape[2], k.shape[2], q.shape[3]
    scores = torch.matmul(q.float(), k.float().transpose(2, 3)) * (D**-0.5 if scale is None else scale)
    scores = torch.where(causal_mask(T, S, q.device, window), scores, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v.float()).to(q.dtype)


# -- ex05 ------------------------------------------------------------------------------------------


@alternative("ex05", "KVCache.write")
def cache_write_with_narrow_and_copy(self, layer, k, v):
    """Check the room first, copy_ into narrow()ed views, return narrow()ed views (issue 30)."""
    from minillm.errors import CacheFullError

    T = k.size(2)
    if self.length + T > self.max_seq_len:
        raise CacheFullError(f"no room for {T} more positions after {self.length} of {self.max_seq_len}")
    self.k[layer].narrow(2, self.length, T).copy_(k)
    self.v[layer].narrow(2, self.length, T).copy_(v)
    return self.k[layer].narrow(2, 0, self.length + T), self.v[layer].narrow(2, 0, self.length + T)


@alternative("ex05", "KVCache.keys")
def cache_keys_by_narrow(self, layer):
    """narrow() the layer's buffer to the filled positions (a view, as slicing gives)."""
    return self.k.select(0, layer).narrow(2, 0, self.length)


@alternative("ex05", "KVCache.values")
def cache_values_by_narrow(self, layer):
    """narrow() the layer's buffer to the filled positions (a view, as slicing gives)."""
    return self.v.select(0, layer).narrow(2, 0, self.length)


# -- ex06 ------------------------------------------------------------------------------------------


def _pass_from_the_parts(model, ids, cache, hook):
    """The forward pass written out: positions from cache.length, the blocks, the last row's logits."""
    T = ids.shape[1]
    positions = cache.length + torch.arange(T, device=ids.device)
    with torch.no_grad():
        x = model.embed(ids)
        if model.pos_embed is not None:
            x = x + model.pos_embed(positions)
        rope = None if model.rope is None else model.rope(positions, x.dtype)
        for block in model.blocks:
            x = block(x, rope, cache, model.attn_impl, hook)
        cache.advance(T)
        return model.lm_head(model.ln_final(x[:, -1:]))[:, 0].to(torch.float32)


def _validated(model, ids, cache, rank: int) -> torch.Tensor:
    ids = torch.as_tensor(ids)
    if ids.dim() > rank or ids.numel() == 0:
        raise ValueError(f"expected at most {rank} dimensions and at least one token, got {tuple(ids.shape)}")
    ids = ids.reshape(1, -1) if rank == 2 and ids.dim() < 2 else ids.reshape(-1, 1) if rank == 1 else ids
    if ids.shape[0] != cache.batch_size:
        raise ValueError(f"batch {ids.shape[0]}, cache batch {cache.batch_size}")
    outside = [i for i in ids.reshape(-1).tolist() if not 0 <= i < model.config.vocab_size]
    if outside:
        raise ValueError(f"token ids outside the vocabulary: {outside}")
    cache.check_room(ids.shape[1])
    return ids.long()


@alternative("ex06", "prefill")
def prefill_from_the_parts(model, token_ids, cache, hook=None, trace=None):
    """Python-level checks, ln_final on the last row only, float32 by .to()."""
    return _pass_from_the_parts(model, _validated(model, token_ids, cache, rank=2), cache, hook)


@alternative("ex07", "decode_step")
def decode_step_from_the_parts(model, token_id, cache, hook=None, trace=None):
    """A decode step is a prefill of one token per sequence: [B] -> [B, 1]."""
    return _pass_from_the_parts(model, _validated(model, token_id, cache, rank=1), cache, hook)


# -- ex08 ------------------------------------------------------------------------------------------


@alternative("ex08", "filter_logits")
def filter_logits_row_by_row(logits, params):
    """One row at a time: the k-th value from a sort, the nucleus walked in a Python loop."""
    out = logits / min(params.temperature, torch.finfo(torch.float32).max)
    rows = []
    for row in out:
        if params.top_k:
            kth = row.sort(descending=True).values[min(params.top_k, row.numel()) - 1]
            row = torch.where(row >= kth, row, torch.full_like(row, -float("inf")))
        if params.top_p < 1:
            probs = torch.softmax(row, dim=-1).tolist()
            keep, mass = torch.zeros_like(row, dtype=torch.bool), 0.0
            for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
                if mass >= params.top_p:
                    break
                keep[i], mass = True, mass + probs[i]
            row = row.masked_fill(~keep, -float("inf"))
        rows.append(row)
    return torch.stack(rows)


@alternative("ex08", "sample")
def sample_by_gumbel_max(logits, params, generator=None, prompt_ids=None, output_ids=None):
    """The Gumbel-max trick: argmax(log p - log(-log u)) with u uniform from the generator (another stream of
    random numbers than multinomial's, the same distribution)."""
    from minillm.sampling import filter_logits

    x = logits.float()
    if not torch.isfinite(x.amax(dim=-1)).all():
        raise ValueError("logits must be finite or -inf, with a finite value in every row")
    if params.greedy:
        ids = x.argmax(dim=-1)
    else:
        filtered = filter_logits(x - x.amax(dim=-1, keepdim=True), params)
        u = torch.rand(x.shape, generator=generator, device=x.device).clamp(min=1e-20)
        ids = (torch.log_softmax(filtered, dim=-1) - torch.log(-torch.log(u))).argmax(dim=-1)
    return ids, torch.log_softmax(x, dim=-1).gather(-1, ids[:, None]).squeeze(-1)


# -- ex09 ------------------------------------------------------------------------------------------


@alternative("ex09", "RequestMetrics.from_timestamps")
def metrics_from_gaps(cls, start_s, token_times_s, n_prompt_tokens, bytes_per_decode_step=None, peak_bandwidth=None):
    """Walk the timestamps once, collecting the gaps; TPOT as the mean gap (issue 30)."""
    import math

    from minillm.metrics import percentile

    previous, gaps, n_out = start_s, [], 0
    for t in token_times_s:
        if t < previous:
            raise ValueError("a token before the start" if n_out == 0 else "timestamps go back")
        if n_out:
            gaps.append((t - previous) * 1000.0)
        previous, n_out = t, n_out + 1
    if n_out == 0:
        raise ValueError("no output token")
    first, last = token_times_s[0], token_times_s[-1]
    ttft_ms, e2e_ms = (first - start_s) * 1000.0, (last - start_s) * 1000.0
    tpot_ms = sum(gaps) / len(gaps) if gaps else None
    itl = tuple(gaps)
    return cls(n_prompt_tokens=n_prompt_tokens, n_output_tokens=n_out, ttft_ms=ttft_ms, tpot_ms=tpot_ms, itl_ms=itl,
               itl_p50_ms=percentile(itl, 50) if itl else None, itl_p90_ms=percentile(itl, 90) if itl else None,
               itl_p99_ms=percentile(itl, 99) if itl else None, e2e_ms=e2e_ms,
               output_throughput_tok_s=n_out * 1000.0 / e2e_ms if e2e_ms > 0 else math.inf,
               prefill_throughput_tok_s=n_prompt_tokens * 1000.0 / ttft_ms if ttft_ms > 0 else math.inf)


# -- ex10 ------------------------------------------------------------------------------------------


@alternative("ex10", "kv_bytes_per_token")
def kv_bytes_layer_by_layer(config, dtype_bytes):
    """Add up one layer's K and V bytes per layer, as a loop (issue 30)."""
    total = 0
    for _ in range(config.n_layers):
        for _tensor in ("K", "V"):
            total += config.n_kv_heads * config.head_dim * dtype_bytes
    return total


@alternative("ex10", "decode_cost")
def decode_cost_layer_by_layer(config, context_len, dtype_bytes, batch_size=1):
    """Count each layer's keys and cache reads by itself (its window or none), then the matmuls (issue 30)."""
    from minillm.costs import PhaseCost, attention_params, lm_head_params, mlp_params, weights_bytes

    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    per_layer_kv = 2 * config.n_kv_heads * config.head_dim * dtype_bytes
    keys = 0
    for layer in range(config.n_layers):
        window = config.window(layer)
        keys += context_len if window is None else min(context_len, window)
    matmuls = config.n_layers * (attention_params(config) + mlp_params(config)) + lm_head_params(config)
    flops = batch_size * (2.0 * matmuls + 4.0 * config.n_heads * config.head_dim * keys)
    w = weights_bytes(config, dtype_bytes)
    read = per_layer_kv * keys * batch_size
    written = per_layer_kv * config.n_layers * batch_size
    return PhaseCost(float(flops), float(w + read + written), float(w), float(read), float(written))


# -- ex11 ------------------------------------------------------------------------------------------


from minillm.block_hash import hash_block  # noqa: E402  (the stub's default hash_fn)


@alternative("ex11", "block_hashes")
def block_hashes_while_full(token_ids, block_size, seed, extra_keys=(), hash_fn=hash_block):
    """Take blocks off the front while a whole one remains (issue 30)."""
    hashes, parent, start = [], seed, 0
    while start + block_size <= len(token_ids):
        parent = hash_fn(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
        start += block_size
    return hashes


@alternative("ex11", "longest_cached_prefix")
def longest_cached_prefix_takewhile(block_hashes, cached, n_tokens, block_size):
    """itertools.takewhile over the hashes, then cap the blocks so one token is left (issue 30)."""
    import itertools

    run = sum(1 for _ in itertools.takewhile(lambda h: h in cached, block_hashes))
    usable = (n_tokens - 1) // block_size if n_tokens > 0 else 0
    return min(run, usable) * block_size


# -- ex12 ------------------------------------------------------------------------------------------


@alternative("ex12", "prefill_cost")
def prefill_cost_query_by_query(config, n_tokens, dtype_bytes, cached_tokens=0, batch_size=1, last_only=True):
    """Walk the layers and, in each, the queries: the keys each one sees, the positions some query reads (issue 30)."""
    from minillm.costs import PhaseCost, attention_params, lm_head_params, mlp_params, weights_bytes

    if n_tokens < 1 or cached_tokens < 0 or batch_size < 1:
        raise ValueError("n_tokens >= 1, cached_tokens >= 0 and batch_size >= 1, please")
    per_position = 2 * config.n_kv_heads * config.head_dim * dtype_bytes  # one layer's K and V of a position
    pairs = positions_read = 0
    for layer in range(config.n_layers):
        window = config.window(layer)
        first_key_seen = cached_tokens + n_tokens
        for i in range(n_tokens):
            position = cached_tokens + i
            first = 0 if window is None else max(0, position - window + 1)
            pairs += position - first + 1
            first_key_seen = min(first_key_seen, first)
        positions_read += cached_tokens + n_tokens - first_key_seen
    layer_params = config.n_layers * (attention_params(config) + mlp_params(config))
    flops = 2 * layer_params * n_tokens + 2 * lm_head_params(config) * (1 if last_only else n_tokens)
    flops += 4 * config.n_heads * config.head_dim * pairs
    w = weights_bytes(config, dtype_bytes)
    read = positions_read * per_position * batch_size
    written = n_tokens * config.n_layers * per_position * batch_size
    return PhaseCost(float(flops * batch_size), float(w + read + written), float(w), float(read), float(written))


@alternative("ex12", "roofline")
def roofline_by_comparing_times(cost, time_s, hw):
    """Compare the time with OVERHEAD_FACTOR floors by multiplying, and name the bound by intensity vs ridge (issue 30)."""
    from minillm.hardware import OVERHEAD_FACTOR, Roofline

    if not time_s > 0:
        raise ValueError(f"time_s must be positive, got {time_s}")
    compute_s, memory_s = cost.flops / hw.peak_flops, cost.bytes / hw.mem_bandwidth
    floor_s = compute_s if compute_s >= memory_s else memory_s
    if time_s > OVERHEAD_FACTOR * floor_s:
        bound = "overhead-bound"
    else:
        bound = "compute-bound" if compute_s >= memory_s else "memory-bound"
    return Roofline(time_s=time_s, arithmetic_intensity=cost.flops / cost.bytes, compute_floor_s=compute_s,
                    memory_floor_s=memory_s, floor_s=floor_s, attained_flops=cost.flops / time_s,
                    attained_bandwidth=cost.bytes / time_s, roofline_fraction=floor_s / time_s, bound=bound,
                    explanation=f"{bound}: floors {compute_s:.3g} s (compute), {memory_s:.3g} s (memory)")


# -- ex13 ------------------------------------------------------------------------------------------


@alternative("ex13", "percentile")
def percentile_by_hand(values, p):
    """Sort a copy, find the two neighbours of the fractional rank with divmod, interpolate (issue 30)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if p < 0 or p > 100:
        raise ValueError(f"p must be between 0 and 100, got {p}")
    whole, frac = divmod((len(ordered) - 1) * p / 100, 1)
    lo = int(whole)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] * (1 - frac) + ordered[hi] * frac)


@alternative("ex13", "slo_attainment")
def slo_attainment_by_counting_misses(metrics_list, ttft_ms=None, tpot_ms=None):
    """Count the requests that miss some SLO, and subtract (issue 30)."""
    n = len(metrics_list)
    if n == 0:
        raise ValueError("no requests")
    missed = 0
    for m in metrics_list:
        if ttft_ms is not None and m.ttft_ms > ttft_ms:
            missed += 1
        elif tpot_ms is not None and m.tpot_ms is not None and m.tpot_ms > tpot_ms:
            missed += 1
    return (n - missed) / n


@alternative("ex13", "goodput")
def goodput_by_counting(metrics_list, duration_s, ttft_ms=None, tpot_ms=None):
    """Count the good requests in one pass and divide by the duration (issue 30)."""
    if len(metrics_list) == 0:
        raise ValueError("no requests")
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    good = sum(1 for m in metrics_list if (ttft_ms is None or m.ttft_ms <= ttft_ms)
               and (tpot_ms is None or m.tpot_ms is None or m.tpot_ms <= tpot_ms))
    return good / duration_s


# -- ex14 ------------------------------------------------------------------------------------------


@alternative("ex14", "generate")
def generate_with_a_while_loop(model, prompt_ids, params, cache, eos_token_ids):
    """A while loop over the count, the stop reasons as an ordered table of (reason, condition)."""
    import time as clock

    from minillm.generate import GenerationStep
    from minillm.phases import decode_step, prefill
    from minillm.sampling import sample

    generator = params.make_generator(cache.k.device)
    logits, produced = prefill(model, prompt_ids, cache), 0
    while True:
        token, logprob = sample(logits, params, generator)
        known_at, produced, token_id = clock.perf_counter(), produced + 1, int(token[0])
        reasons = [("eos", token_id in eos_token_ids), ("stop", token_id in set(params.stop_token_ids)),
                   ("length", produced == params.max_new_tokens), ("cache_full", cache.length == cache.max_seq_len)]
        reason = next((name for name, applies in reasons if applies), None)
        phase = "decode" if produced > 1 else "prefill"
        yield GenerationStep(token_id=token_id, logprob=float(logprob[0]), phase=phase,
                             cache_length=cache.length, time_s=known_at, finish_reason=reason,
                             prefill_tokens=int(prompt_ids.shape[0]))
        if reason is not None:
            break
        logits = decode_step(model, token, cache)


# -- ex15 ------------------------------------------------------------------------------------------


@alternative("ex15", "blocks_needed")
def blocks_needed_by_divmod(num_tokens, block_size):
    """Whole blocks, plus one for a partial remainder."""
    full, rest = divmod(num_tokens, block_size)
    return full + 1 if rest else full


@alternative("ex15", "slot_mapping")
def slot_mapping_position_by_position(block_table, start, end, block_size):
    """Looks each position's block up in turn, and refuses the first one past the table."""
    slots = []
    for position in range(start, end):
        logical, offset = divmod(position, block_size)
        if logical >= len(block_table):
            raise ValueError(f"position {position} is beyond the block table; allocate its blocks first")
        slots.append(block_table[logical] * block_size + offset)
    return slots


@alternative("ex15", "BlockAllocator.allocate_slots")
def allocate_slots_counting_fresh_blocks_first(self, request_id, num_tokens, cached_blocks=()):
    """Counts what the pool can give (free blocks that are not among the hits) before touching anything."""
    hits = list(cached_blocks)
    have = len(self.block_tables.get(request_id, ())) + len(hits)
    fresh = max(0, (num_tokens + self.block_size - 1) // self.block_size - have)
    available = len([b for b in self.free_queue if b not in hits])
    if fresh > available:
        return False
    table = self.block_tables.setdefault(request_id, [])
    for block_id in hits:
        self.share_block(block_id)
        table.append(block_id)
    while fresh:
        table.append(self.allocate_block().block_id)
        fresh -= 1
    return True


@alternative("ex15", "BlockAllocator.free")
def free_walking_the_table_backwards(self, request_id):
    """Indexes the table from its end; a request with no table has nothing to free."""
    table = self.block_tables.get(request_id)
    if table is not None:
        for i in range(len(table) - 1, -1, -1):
            self.free_block(table[i])
        del self.block_tables[request_id]
    self._hashes.pop(request_id, None)


# -- ex16 ------------------------------------------------------------------------------------------


@alternative("ex16", "Scheduler.schedule")
def schedule_with_explicit_groups(self):
    """Decodes and prefills as two lists, preemption with running.pop(), admission with an explicit cut."""
    import time

    from minillm.serving.request import RUNNING, WAITING
    from minillm.serving.scheduler import ScheduledBatch

    batch, budget = ScheduledBatch(), self.max_num_batched_tokens
    decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
    prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]
    for request in decodes + prefills:
        if budget == 0:
            break
        if not any(r is request for r in self.running):  # preempted by a request before it
            continue
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        while not self.allocator.allocate_slots(request.request_id, request.num_computed_tokens + n):
            victim = self.running.pop()
            self.allocator.free(victim.request_id)
            victim.status, victim.num_computed_tokens = WAITING, 0
            victim.num_preemptions += 1
            victim.preempted_s.append(time.perf_counter())
            self.waiting.appendleft(victim)
            for i, r in enumerate(batch.requests):
                if r is victim:
                    batch.requests.pop(i)
                    batch.num_tokens.pop(i)
                    break
            batch.preempted.append(victim)
            if victim is request:
                break
        else:
            batch.requests.append(request)
            batch.num_tokens.append(n)
            budget -= n
    if batch.preempted:
        return batch
    while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
        request = self.waiting[0]
        hits = self.allocator.find_cached_prefix(request.all_token_ids)
        computed = len(hits) * self.allocator.block_size
        n = request.num_tokens - computed
        if n > budget:
            if not self.enable_chunked_prefill and n <= self.max_num_batched_tokens:
                break
            n = budget
        if not self.allocator.allocate_slots(request.request_id, computed + n, hits):
            break
        self.waiting.popleft()
        request.status, request.num_computed_tokens = RUNNING, computed
        if request.first_scheduled_s is None:
            request.first_scheduled_s, request.num_cached_tokens = time.perf_counter(), computed
        self.running.append(request)
        batch.requests.append(request)
        batch.num_tokens.append(n)
        budget -= n
    return batch


# -- ex17 ------------------------------------------------------------------------------------------


@alternative("ex17", "residual_distribution")
def residual_from_the_overlap(p, q):
    """p minus the overlap min(p, q) is max(0, p - q); normalised by its own sum."""
    left = p - torch.minimum(p, q)
    total = left.sum()
    return left / total if total > 0 else p


@alternative("ex17", "accept_or_resample")
def accept_or_resample_always_drawing_u(p, q, draft_ids, generator=None):
    """Draws u for every draft it tests, even when the ratio is >= 1 (the reference skips that draw: another
    stream of random numbers, the same distribution); a deterministic draft's residual is p without the draft."""
    for i, d in enumerate(draft_ids):
        q_d = 1.0 if q is None else float(q[i, d])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u < float(p[i, d]) / q_d:
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0
        else:
            residual = torch.clamp(p[i] - q[i], min=0)
        if float(residual.sum()) <= 0:
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(draft_ids), int(torch.multinomial(p[len(draft_ids)], 1, generator=generator))


# -- ex18 ------------------------------------------------------------------------------------------


@alternative("ex18", "quantize_int4")
def quantize_int4_by_group_index(w, group_size=64):
    """Give each column its group's index and reduce with scatter_reduce (no padding: the short group is just
    fewer columns), gather each weight's scale and zero back, pack by arithmetic (issue 30)."""
    from minillm.quantize import QuantizationError

    if group_size < 2:
        raise QuantizationError(f"group_size must be at least 2, got {group_size}")
    w = w.to(torch.float32)
    out, n_in = w.shape
    n_groups = (n_in + group_size - 1) // group_size
    group = (torch.arange(n_in) // group_size).expand(out, n_in)
    lo = torch.zeros(out, n_groups).scatter_reduce(1, group, w, reduce="amin")  # starts at 0: lo <= 0
    hi = torch.zeros(out, n_groups).scatter_reduce(1, group, w, reduce="amax")  # hi >= 0
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
    zero = torch.clamp(torch.round(-lo / scale), 0, 15)
    codes = torch.clamp(torch.round(w / scale.gather(1, group)) + zero.gather(1, group), 0, 15).to(torch.uint8)
    if n_in % 2:
        codes = torch.cat([codes, torch.zeros(out, 1, dtype=torch.uint8)], dim=1)
    return codes[:, 0::2] + codes[:, 1::2] * 16, scale, zero.to(torch.uint8)


@alternative("ex18", "dequantize_int4")
def dequantize_int4_by_index(packed, scale, zero, in_features, group_size=64):
    """Read each weight's nibble and its group's scale and zero by index arithmetic (issue 30)."""
    i = torch.arange(in_features)
    nibbles = packed[:, i // 2].to(torch.int32)
    q = torch.where(i % 2 == 0, nibbles % 16, nibbles // 16)
    g = i // group_size
    return ((q - zero[:, g].to(torch.int32)).to(torch.float32) * scale[:, g]).to(torch.float32)


# -- ex19 ------------------------------------------------------------------------------------------


@alternative("ex19", "kv_transfer_seconds")
def transfer_in_bits(config, prompt_tokens, dtype_bytes, link_gbit_s):
    """Count the K/V in bits, layer by layer, and divide by the link's bits per second."""
    if prompt_tokens < 0 or dtype_bytes < 1 or not link_gbit_s > 0:
        raise ValueError(f"bad transfer: {prompt_tokens} tokens, {dtype_bytes} bytes, {link_gbit_s} Gb/s")
    bits = 0
    for _layer in range(config.n_layers):
        for _tensor in ("K", "V"):
            bits += prompt_tokens * config.n_kv_heads * config.head_dim * dtype_bytes * 8
    return bits / (link_gbit_s * 1e9)


@alternative("ex19", "transfer_vs_prefill")
def ratio_from_predict(config, prompt_tokens, dtype_bytes, link_gbit_s, hw):
    """The prefill time from whatif's predict (its TTFT floor), the transfer from the config directly."""
    from minillm.whatif import predict

    if not link_gbit_s > 0 or dtype_bytes < 1:
        raise ValueError(f"link_gbit_s must be > 0 and dtype_bytes >= 1, got {link_gbit_s}, {dtype_bytes}")
    ttft_s = predict(config, hw, prompt_tokens, 1, dtype_bytes).ttft_ms / 1e3  # ValueError for prompt_tokens < 1
    link_bytes_s = link_gbit_s * 1e9 / 8
    return prompt_tokens * config.kv_bytes_per_token(dtype_bytes) / link_bytes_s / ttft_s


# -- ex20 ------------------------------------------------------------------------------------------


def _check_a_k(a, k):
    if not (a >= 0 and a <= 1):
        raise ValueError(f"acceptance_rate must be in [0, 1], got {a}")
    if isinstance(k, float) or int(k) != k or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k}")


@alternative("ex20", "expected_tokens_per_pass")
def tokens_as_a_sum(acceptance_rate, k):
    """Sum the probability that each position of the pass makes a token: a^0 (the model's own) + a^1 + ... + a^k."""
    _check_a_k(acceptance_rate, k)
    total = 0.0
    for i in range(k + 1):
        total += acceptance_rate ** i  # draft i is kept only if drafts 1..i all were
    return total


@alternative("ex20", "speculative_speedup")
def speedup_as_time_per_token(acceptance_rate, k, draft_cost, verify_cost=1.0):
    """Time per token speculating (pass time / tokens) against plain decoding's 1 step per token."""
    import math

    _check_a_k(acceptance_rate, k)
    if not (draft_cost >= 0 and math.isfinite(draft_cost)) or not (verify_cost > 0 and math.isfinite(verify_cost)):
        raise ValueError(f"costs must be finite, draft_cost >= 0, verify_cost > 0: {draft_cost}, {verify_cost}")
    tokens = tokens_as_a_sum(acceptance_rate, k)
    seconds_per_token = (k * draft_cost + verify_cost) / tokens
    return 1.0 / seconds_per_token


# -- ex21 ------------------------------------------------------------------------------------------


def _split_whole(size, rank, world_size, unit):
    """(first, count) of rank's elements along a dimension of ``size``, units whole, or ValueError."""
    if not (world_size >= 1 and 0 <= rank < world_size and unit >= 1):
        raise ValueError(f"rank {rank} of {world_size}, unit {unit}")
    units, rest = divmod(size, unit)
    if rest or units % world_size:
        raise ValueError(f"{size} in units of {unit} do not split {world_size} ways")
    count = units // world_size * unit
    return rank * count, count


@alternative("ex21", "column_shard")
def column_shard_by_chunk(weight, rank, world_size, unit=1):
    """torch.chunk into N pieces after the checks (equal pieces, since the units divide)."""
    _split_whole(weight.shape[0], rank, world_size, unit)
    return torch.chunk(weight, world_size, dim=0)[rank]


@alternative("ex21", "row_shard")
def row_shard_by_index_select(weight, rank, world_size, unit=1):
    """Gather the columns by index: a copy, not a view (the docstring's view is not demanded)."""
    if weight.dim() != 2:
        raise ValueError(f"a 2-D weight, got {weight.dim()}-D")
    first, count = _split_whole(weight.shape[1], rank, world_size, unit)
    return weight.index_select(1, torch.arange(first, first + count))


@alternative("ex21", "heads_of_rank")
def heads_from_the_groups(config, rank, world_size):
    """The K/V heads as the groups of the rank's query heads: h // (H / Hkv) for each of them."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of {world_size}")
    if config.n_heads % world_size or config.n_kv_heads % world_size:
        raise ValueError(f"{world_size} ranks do not split {config.n_heads} and {config.n_kv_heads} heads")
    per_rank = config.n_heads // world_size
    queries = range(rank * per_rank, (rank + 1) * per_rank)
    group = config.n_heads // config.n_kv_heads
    kv = sorted({h // group for h in queries})
    return queries, range(kv[0], kv[-1] + 1)


@alternative("ex21", "all_reduce_bytes_per_layer")
def all_reduce_bytes_step_by_step(config, n_tokens, world_size, dtype_bytes):
    """Walk the ring: 2(N-1) steps an all-reduce, a chunk of 1/N of the tensor each, two all-reduces."""
    if n_tokens < 0 or world_size < 1 or dtype_bytes < 1:
        raise ValueError(f"n_tokens {n_tokens}, world_size {world_size}, dtype_bytes {dtype_bytes}")
    chunk = n_tokens * config.d_model * dtype_bytes / world_size
    steps = 2 * (world_size - 1)
    return 2.0 * steps * chunk
