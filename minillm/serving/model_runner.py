"""The model runner: a scheduler decision in, one forward pass and one token per finished row out.

    ScheduledBatch  --prepare_batch-->  PagedBatch (flat tokens, positions, slots, tables)
                    --forward_batch-->  logits [R, vocab], one row per request that samples
                    --sample_rows---->  token ids [R], logprobs [R]

A request samples in a step when the step computes its last known token: a decode always,
a prefill only with its final chunk (an earlier chunk just fills the cache).

Prompt logprobs (vLLM's ``prompt_logprobs``, what ``echo`` with ``logprobs`` serves) need more
rows: position p's logits give prompt token p + 1's logprob, so a request that asks gets a
logits row for each prompt position of its chunk (:func:`prompt_logits_spans`), after the
sampling rows. Only those requests: the plain path still computes one row per sampling request
(the LM head over every prompt row would cost a [chunk, vocab] matmul each step).
"""

from __future__ import annotations

import torch

from ..sampling import sample, sample_constrained
from .block_allocator import slot_mapping
from .paged_attention import PagedBatch, PrefillChunk, forward_batch
from .paged_cache import PagedKVCache
from .request import Request
from .scheduler import ScheduledBatch


def prompt_logits_spans(scheduled: ScheduledBatch) -> list[tuple[Request, int, int]]:
    """(request, first position, number of positions) whose logits the step computes for prompt
    logprobs: the prompt positions of each chunk, from the first one still needed
    (:attr:`Request.prompt_logits_from`) up to the prompt's second last (the last one's logits
    sample the first output token). Positions already kept, or cached, are not computed again."""
    spans = []
    for request, n in zip(scheduled.requests, scheduled.num_tokens):
        needed_from = request.prompt_logits_from
        if needed_from is None:
            continue
        start = max(request.num_computed_tokens, needed_from)
        end = min(request.num_computed_tokens + n, request.num_prompt_tokens - 1)
        if end > start:
            spans.append((request, start, end - start))
    return spans


def prepare_batch(cache: PagedKVCache, scheduled: ScheduledBatch, batch_cls=PagedBatch
                  ) -> tuple[PagedBatch, list[Request]]:
    """Lay the scheduled tokens end to end (see :class:`PagedBatch`).

    Returns the batch (built by ``batch_cls``, PagedBatch's arguments) and the requests that sample
    this step, in the order of its logits rows; the rows of :func:`prompt_logits_spans` follow theirs,
    span after span.
    """
    device, block_size = cache.k.device, cache.block_size
    tables = cache.allocator.block_tables
    token_ids, positions, slots, logits_rows, sampling = [], [], [], [], []
    decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
    for request, n in zip(scheduled.requests, scheduled.num_tokens):
        start, end, row = request.num_computed_tokens, request.num_computed_tokens + n, len(token_ids)
        table = tables[request.request_id]
        token_ids += request.all_token_ids[start:end]
        positions += range(start, end)
        slots += slot_mapping(table, start, end, block_size)
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(table)
            decode_lens.append(end)
        else:
            table_t = torch.tensor(table[: -(-end // block_size)], device=device)
            prefills.append(PrefillChunk(row, row + n, end, table_t))
        if end == request.num_tokens:
            logits_rows.append(row + n - 1)
            sampling.append(request)
    starts = {id(r): row for r, row in zip(scheduled.requests, _first_rows(scheduled))}
    for request, position, count in prompt_logits_spans(scheduled):
        first = starts[id(request)] + position - request.num_computed_tokens
        logits_rows += range(first, first + count)
    width = max((len(t) for t in decode_tables), default=1)
    padded = [t + [0] * (width - len(t)) for t in decode_tables]  # block 0 is a stand-in: masked out
    as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    batch = batch_cls(cache, as_long(token_ids), as_long(positions), as_long(slots), as_long(decode_rows),
                       as_long(padded).reshape(len(padded), width), as_long(decode_lens), prefills,
                       as_long(logits_rows))
    return batch, sampling


def _first_rows(scheduled: ScheduledBatch) -> list[int]:
    """Each scheduled request's first row in the flat batch."""
    rows, row = [], 0
    for n in scheduled.num_tokens:
        rows.append(row)
        row += n
    return rows


def run_model(model, cache: PagedKVCache, scheduled: ScheduledBatch) -> tuple[list[Request], torch.Tensor]:
    """One forward pass over the scheduled tokens: (requests that sample, their logits [R, vocab] float32).

    With prompt logprobs asked, the logits hold more rows: the R sampling rows, then those of
    :func:`prompt_logits_spans` in its order. The speed layer may give the model its own batch
    (``model.paged_batch``: attention over the blocks in place, minillm/fast/paged_attention.py), and its own
    step for a batch it applies to (``model.replayed_batch``: minillm/fast/replay_serving.py): the same logits."""
    batch, sampling = prepare_batch(cache, scheduled, getattr(model, "paged_batch", None) or PagedBatch)
    replayed = getattr(model, "replayed_batch", None)  # the hook for minillm/fast: skip on a first reading
    if replayed is not None and replayed.applies(model, batch):
        return sampling, replayed(model, batch)
    return sampling, forward_batch(model, batch)


def sample_rows(logits: torch.Tensor, requests: list[Request]
                ) -> tuple[list[int | None], list[float], dict[int, tuple[str, str]]]:
    """Each request's next token from its row of logits, with its own params and generator.

    The same :func:`~minillm.sampling.sample` call that :func:`~minillm.generate.generate`
    makes, row by row, so a seeded request draws the same tokens in a batch as alone.
    Greedy rows without penalties, bias or constraint are one batched argmax. A request with a
    matcher (constrained decoding) samples among the tokens its ``matcher.allowed()`` gives.

    What belongs to one request fails that row alone (vLLM's per-request errors): a NaN or +inf
    in its logits row, its constraint's matcher raising, its logit_bias or penalties failing.
    Returns (tokens [R], logprobs [R], failures): ``failures`` maps a failed row to (the part that
    failed: "logits", "allowed_tokens" or "sampling"; one line saying why); its token is None and its
    logprob 0. The other rows are exactly what they would be without it.
    """
    tokens, logprobs = [None] * len(requests), [0.0] * len(requests)
    failures = _non_finite_rows(logits)
    plain = [i for i, r in enumerate(requests) if r.params.greedy and r.params.is_plain and i not in failures]
    if plain:
        rows = logits if len(plain) == len(requests) else logits[plain]  # (indexing copies every row)
        ids, lps = sample(rows, requests[plain[0]].params)
        for i, token, lp in zip(plain, ids.tolist(), lps.tolist()):
            tokens[i], logprobs[i] = token, lp
    for i, request in enumerate(requests):
        if tokens[i] is not None or i in failures:
            continue
        part = "allowed_tokens"
        try:  # the request's own constraint, bias or penalties: it alone fails
            allowed = request.matcher.allowed() if request.matcher is not None else None
            part = "sampling"
            tokens[i], logprobs[i] = _sample_one(logits[i : i + 1], request, allowed)
        except Exception as error:
            failures[i] = (part, f"{type(error).__name__}: {error}")
    return tokens, logprobs, failures


def _sample_one(logits: torch.Tensor, request: Request, allowed: torch.Tensor | None) -> tuple[int, float]:
    """One request's token from its logits row [1, vocab]: its penalties, bias, allowed tokens, generator."""
    prompt = torch.tensor(request.prompt_ids, device=logits.device)[None]
    token, lp = sample_constrained(logits, request.params, request.generator, prompt, [request.output_ids], allowed)
    return token.item(), lp.item()


def _non_finite_rows(logits: torch.Tensor) -> dict[int, str]:
    """Rows whose logits hold NaN or +inf, or no finite value (a row's max shows all three in one pass)."""
    bad = (~torch.isfinite(logits.amax(dim=-1))).nonzero().flatten().tolist()
    return {row: ("logits", "its logits row holds NaN or +inf, or no finite value (a numerical failure of the "
                            "model on this request; try another dtype)") for row in bad}
