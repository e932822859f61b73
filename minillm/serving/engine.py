"""LLMEngine: many requests at once, one step at a time (vLLM's ``LLMEngine`` in small).

    add_request ──> waiting ──schedule──> running ──finish──> outputs
                        ^                    │
                        └──── preempted ─────┘   (blocks freed, recomputed later)

Each :meth:`LLMEngine.step` is the same four moves::

    batch  = scheduler.schedule()            which requests, how many tokens each
    logits = forward_batch(model, batch)     one pass over all their tokens, paged KV
    tokens = sample_rows(logits, requests)   each with its own SamplingParams and seed
    update: append tokens, cache full blocks, finish (EOS, stop, max_tokens, context)

A request's tokens do not depend on what else is in the batch: each one attends only to
its own K/V, so its greedy output equals :func:`~minillm.generate.generate`'s alone.

And no request can harm another. What belongs to one request is checked at admission where it
can be (:meth:`LLMEngine.add_request`), and contained where it runs: its logits row, its
constraint's matcher, its logit_bias and penalties, its stop strings and its text. When one of
those fails during a step, that request alone finishes with ``finish_reason == "error"`` and the
reason in its ``message``; the others get exactly the tokens they would have had without it.
Only a failure no request owns (the forward pass itself) makes :meth:`LLMEngine.step` raise.

Beyond the pool (``kv_offload_memory``, ``kv_offload_dir``): blocks the pool evicts go to host
memory, then disk, and come back when a prefix needs them (:mod:`minillm.serving.kv_tiers`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..block_hash import block_hashes, salted_seed
from ..generate import check_params, check_prompt, eos_token_set
from ..sampling import SamplingParams
from ..stopping import TextStream, check_stop
from .block_allocator import blocks_needed
from .kv_tiers import CachePoint, KVOffload
from .model_runner import prompt_logits_spans, run_model, sample_rows
from .paged_cache import PagedKVCache
from .request import RUNNING, Request, sequence_id
from .scheduler import Scheduler, ScheduledBatch
from .step_trace import StepRecord, write_chrome_trace


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (vLLM's ``RequestOutput``, flattened).

    Attributes:
        request_id: the id :meth:`LLMEngine.add_request` returned.
        prompt_token_ids: the prompt.
        new_token_ids: tokens generated in this step (0 or 1).
        token_ids: every token generated so far.
        finished: True on the request's last output.
        finish_reason: "eos", "stop", "length", "abort" or "error" when finished, else None
            ("error": a part of this request failed during a step; ``message`` says which and why).
        stop_reason: the stop id or stop string that ended it; for "error", the part of the request
            that failed ("allowed_tokens": its constraint, "logits": a NaN or +inf in its row,
            "sampling", "stop": its stop strings or text, "prompt_logprobs"); else None.
        num_cached_tokens: prompt tokens served from the prefix cache (vLLM's name).
        text: with a tokenizer, the answer so far (stop strings cut out), else None.
        message: why "length", "abort" or "error" came early (a pool too small, a failed
            constraint), else None.
        logprobs: with ``add_request(..., logprobs=k)``, one ``(logprob, [(id, logprob), ...k])`` per
            token of ``token_ids``: its log-probability and the k most likely tokens at that
            position (natural log of the model's raw distribution, as OpenAI and vLLM report
            them); else None.
        prompt_logprobs: with ``add_request(..., prompt_logprobs=k)``, one entry per prompt token:
            None for the first (nothing precedes it), then ``(logprob, [(id, logprob), ...k])`` of
            token j given tokens 0..j-1, from the prefill's logits (vLLM's ``prompt_logprobs``);
            complete from the request's first token on; else None.
        index: which of the request's n sequences this output is about (``add_request(..., n=3)``:
            0, 1 or 2, under the same ``request_id``; OpenAI's choice ``index``); 0 when n = 1.
        num_cache_write_tokens: tokens of the request's cache point (its full blocks) that were not
            read from a cache: computed and written now (Anthropic's ``cache_creation_input_tokens``;
            ``num_cached_tokens`` is its ``cache_read_input_tokens``); 0 without a cache point.
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    text: str | None = None
    message: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    index: int = 0
    num_cache_write_tokens: int = 0


class LLMEngine:
    """Continuous batching over a paged KV cache, with prefix caching and chunked prefill.

    Args:
        model: a :class:`~minillm.model.Transformer` (``minillm.load_model(...)``).
        tokenizer: optional; outputs then carry ``text``, and ``SamplingParams.stop`` works.
        kv_cache_memory: the pool's budget: "512MiB", "2GiB", bytes, or a fraction of free
            memory such as 0.3; default 512MiB. Give it or ``num_blocks``, not both.
        num_blocks: the pool's size in blocks (vLLM's ``num_gpu_blocks_override``).
        block_size: positions per block (vLLM's ``block_size``).
        max_num_seqs, max_num_batched_tokens, enable_chunked_prefill: the scheduler's knobs,
            with vLLM's names (see :class:`~minillm.serving.scheduler.Scheduler`).
        enable_prefix_caching: requests share cached full blocks of a common prefix.
        eos_token_ids: ids that end a request; default the checkpoint's.
        kv_offload_memory: a host-memory tier for blocks the pool evicts ("2GiB", bytes, a fraction
            of free memory; vLLM's ``--kv-offloading-size``); None: none.
        kv_offload_dir: a disk tier's folder (created if missing): evicted blocks, and every computed
            block written through, so a restarted engine or another process hits them; None: none.
            Either tier can be given alone; both need prefix caching. Call :meth:`close` at the end.
        kv_offload_disk_size: the disk tier's bound ("20GiB", bytes, a fraction of the disk's free space):
            past it, the least recently used block files are removed, those pinned by a cache point kept
            until their lifetime ends (LMCache's ``max_local_disk_size``); None: unbounded. Needs kv_offload_dir.

    Attributes:
        cache (:class:`PagedKVCache`), scheduler (:class:`Scheduler`), requests (id -> Request),
        steps (one :class:`StepRecord` per step: the step trace), offload (the
        :class:`~minillm.serving.kv_tiers.KVOffload` of the tiers: ``.host``, ``.disk``, ``.counts``;
        None without tiers).

    Raises ValueError for a pool that holds no block, bad knobs, a bad kv_offload_memory or
    kv_offload_disk_size (or one that holds no block), a kv_offload_disk_size without kv_offload_dir, a
    kv_offload_dir that is a file or cannot be written, or tiers without prefix caching.
    """

    def __init__(self, model, tokenizer=None, *, kv_cache_memory: str | int | float | None = None,
                 num_blocks: int | None = None, block_size: int = 16, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, eos_token_ids=None,
                 kv_offload_memory: str | int | None = None, kv_offload_dir: str | Path | None = None,
                 kv_offload_disk_size: str | int | None = None):
        self.model, self.tokenizer = model, tokenizer
        if kv_cache_memory is not None and num_blocks is not None:
            raise ValueError(f"give kv_cache_memory ({kv_cache_memory!r}) or num_blocks ({num_blocks}), not both: "
                             "num_blocks sets the pool's size exactly")
        memory = "512MiB" if kv_cache_memory is None else kv_cache_memory
        self.cache = PagedKVCache.for_model(model, memory, block_size, num_blocks, enable_prefix_caching)
        self.scheduler = Scheduler(self.cache.allocator, max_num_seqs, max_num_batched_tokens,
                                   enable_chunked_prefill)
        if not enable_prefix_caching and (kv_offload_memory is not None or kv_offload_dir is not None):
            raise ValueError("KV tiers (kv_offload_memory, kv_offload_dir) hold blocks by their prefix hashes: "
                             "they need enable_prefix_caching=True")
        self.offload = KVOffload.create(self.cache, model, kv_offload_memory, kv_offload_dir, kv_offload_disk_size)
        self.scheduler.offload = self.offload
        self.eos_token_ids = eos_token_set(model, eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.steps: list[StepRecord] = []
        self._ids, self._step_numbers = itertools.count(), itertools.count()

    # -- requests in ------------------------------------------------------------------

    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_s: float | None = None, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, n: int = 1, cache_salt: str | None = None,
                    cache_point: CachePoint | Sequence[CachePoint] | None = None) -> str:
        """Queue a prompt (token ids); returns its request id.

        ``params`` default to the checkpoint's generation defaults, as in ``generate``.
        ``arrival_s``: its arrival time (``time.perf_counter()`` seconds); default now.
        ``logprobs``: k >= 0 records each output token's logprob and the k most likely tokens
        (vLLM's ``SamplingParams.logprobs``; see :attr:`RequestOutput.logprobs`); None: not kept.
        ``prompt_logprobs``: k >= 0 records each prompt token's logprob and the k most likely
        tokens at its position (vLLM's ``SamplingParams.prompt_logprobs``; see
        :attr:`RequestOutput.prompt_logprobs`). They come from the prefill itself, chunk by chunk,
        with a logits row for every prompt position of this request only. Prefix caching: such a
        request takes no cache hits for the positions whose logits it still needs (as vLLM, which
        recomputes the prompt: cached blocks hold K/V, not logits); its blocks are still cached
        for others, and a recompute after a preemption, its prompt logprobs kept, takes hits again.

        ``n``: parallel sampling (vLLM's ``SamplingParams.n``, OpenAI's ``n``): n sequences from one
        prompt, each with its own generator, reported under this request id with their
        :attr:`RequestOutput.index`. The prompt is prefilled once; then the request *forks*: the
        n - 1 other sequences get block tables pointing at the same blocks (reference counts
        raised, :meth:`BlockAllocator.fork`), and each samples its first token from the same
        logits. The prompt's last, partial block is copied when a sequence first writes into it
        while another still holds it (copy on write); full blocks stay shared until they finish.
        With a seed s, sequence i draws from a generator seeded s + i (vLLM's rule for its child
        requests): sequence 0 is the n = 1 answer, and a seeded request is reproducible. Sequence
        i's engine id is ``f"{request_id}#{i}"`` (:func:`~minillm.serving.request.sequence_id`).
        The scheduler admits the request only when n sequences fit ``max_num_seqs``.

        ``cache_salt``: the tenant's salt (vLLM's ``cache_salt``): the request shares cached blocks,
        in the pool and in every tier, only with requests of the same salt (:func:`block_hash.salted_seed`).
        ``cache_point``: a :class:`~minillm.serving.kv_tiers.CachePoint`, or a list of them (Anthropic's
        breakpoints, up to 4 there, each with its own ttl): the full blocks of each one's first
        ``num_tokens`` prompt tokens are pinned in the host and disk tiers for its ``ttl_s`` seconds from
        now (a block under several points keeps the longest; a later mark extends a pin, never shortens
        it); :attr:`RequestOutput.num_cache_write_tokens` counts those of the longest point it computed::

            prompt   [ tools | system ........ | document ......... | question ]
            points   1h -------------------^    5m --------------------^
            pinned   blocks of the first prefix until now + 1 h; the rest of the second until now + 5 min

        Raises ValueError for text instead of ids, an empty prompt, ids outside the vocabulary,
        a prompt beyond the model's context or the whole pool, a prompt longer than
        ``max_num_batched_tokens`` without chunked prefill, a duplicate request id, or an ``n``
        outside [1, max_num_seqs], a cache_salt that is not a non-empty string, a cache_point
        that is not a CachePoint or a list of them, and for a constraint whose matcher cannot be made (any error
        its ``matcher()`` raises, as one line).
        """
        if isinstance(prompt_ids, str):
            raise ValueError("add_request takes token ids, not text; encode it first: "
                             "engine.add_request(tok.encode(text))")
        if getattr(prompt_ids, "ndim", 1) == 2 and len(prompt_ids) > 1 or _is_nested(prompt_ids):
            raise ValueError("add_request takes one prompt; add each prompt with its own add_request, "
                             "or pass the list to engine.generate([...])")
        prompt = check_prompt(prompt_ids).tolist()
        params = check_params(self.model, params, self.tokenizer)
        self._check_fits(prompt)
        for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if k is not None and not (type(k) is int and 0 <= k <= self.model.config.vocab_size):
                raise ValueError(f"{name} must be None or a number of top tokens in [0, vocab size], got {k!r}")
        self.check_n(n)
        salted_seed(b"", cache_salt)  # ValueError for a bad salt
        cache_points = _cache_points(cache_point)
        if request_id is None:  # the next number the caller has not taken already
            request_id = next(i for i in map(str, self._ids) if i not in self.requests)
        request_id = str(request_id)
        if any(sequence_id(request_id, i) in self.requests for i in range(n)):
            raise ValueError(f"request id {request_id!r} is already in use; give a new one or leave it out")
        device = self.cache.k.device
        request = Request(request_id, prompt, params, time.perf_counter() if arrival_s is None else arrival_s,
                          generator=params.make_generator(device), num_logprobs=logprobs,
                          num_prompt_logprobs=prompt_logprobs)
        request.num_forks = n - 1
        request.cache_salt, request.cache_points = cache_salt, cache_points
        _attach_sequence_state(request, self.tokenizer)
        if cache_points and self.offload is not None:
            self._pin_cache_points(request)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _pin_cache_points(self, request: Request) -> None:
        """Pin the full blocks of each of the request's cache points (its first num_tokens prompt tokens) in
        the tiers for its own ttl: one hash chain, over the longest point, whose first blocks are the others'."""
        size, allocator, now = self.cache.block_size, self.cache.allocator, self.offload.clock()
        longest = request.prompt_ids[: request.cache_points[-1].num_tokens]
        hashes = block_hashes(longest, size, salted_seed(allocator.seed, request.cache_salt))
        for point in request.cache_points:
            self.offload.pin(hashes[: point.num_tokens // size], now + point.ttl_s)

    def check_n(self, n) -> None:
        """ValueError unless ``n`` (sequences per request) is an int in [1, max_num_seqs]: a request with more
        could never be scheduled, however long it waited."""
        if not (type(n) is int and 1 <= n <= self.scheduler.max_num_seqs):
            raise ValueError(f"n (sequences per request) must be an integer in [1, max_num_seqs = "
                             f"{self.scheduler.max_num_seqs}], got {n!r}")

    def _check_fits(self, prompt: list[int]) -> None:
        vocab, context, pool = self.model.config.vocab_size, self.model.config.max_seq_len, self.cache.allocator
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt ids must be in [0, {vocab}) (the vocabulary), got {min(prompt)}..{max(prompt)}")
        if len(prompt) > context:
            raise ValueError(f"the prompt is {len(prompt)} tokens but the model's context is {context}; "
                             "shorten the prompt")
        if blocks_needed(len(prompt) + 1, pool.block_size) > pool.num_blocks:
            raise ValueError(f"the prompt is {len(prompt)} tokens but the whole KV cache pool holds "
                             f"{pool.num_blocks} blocks of {pool.block_size} ({pool.num_blocks * pool.block_size} "
                             "positions); give the engine more kv_cache_memory")
        budget = self.scheduler.max_num_batched_tokens
        if len(prompt) > budget and not self.scheduler.enable_chunked_prefill:
            raise ValueError(f"the prompt is {len(prompt)} tokens, more than max_num_batched_tokens ({budget}), "
                             "and chunked prefill is off; raise max_num_batched_tokens or enable chunked prefill")

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request now: its blocks go back to the pool. Returns its last output, which says
        "abort" (no later step reports it: it is in no batch).

        Raises ValueError for an unknown id; aborting a finished request changes nothing.
        A request with n > 1 stops all its sequences (the output is sequence 0's).
        """
        request = self.requests.get(str(request_id))
        if request is None:
            raise ValueError(f"no request with id {request_id!r}; known ids: {list(self.requests)[:10]}")
        for sequence in self.sequences(request.request_id) if request.parent_id is None else [request]:
            if not sequence.finished:
                self.scheduler.finish(sequence, "abort", message="aborted by the caller")
        return self._output(request, None)

    def sequences(self, request_id: str) -> list[Request]:
        """A request's sequences in index order: itself, then (n > 1, once forked) ``#1``, ``#2``, ..."""
        found = [self.requests[str(request_id)]]
        while (child := self.requests.get(sequence_id(str(request_id), len(found)))) is not None:
            found.append(child)
        return found

    def has_unfinished_requests(self) -> bool:
        """True while some request is waiting or running (vLLM's name)."""
        return self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, sample, and return an output per request that changed.

        A request appears when it got a token or finished (a prefill chunk that does not
        reach the end of the prompt yields nothing yet). Returns [] when nothing is left.
        """
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.cache.copy_pending()  # copy on write: before this step writes into the copies
        rows = scheduled.rows()
        new_tokens: dict[str, int] = {}
        forked: list[Request] = []
        if scheduled:
            spans = prompt_logits_spans(scheduled)  # before num_computed_tokens moves on
            forward_start = time.perf_counter()
            sampling, logits = run_model(self.model, self.cache, scheduled)  # raises: no request owns it
            if self.offload is not None and scheduled.num_decode_tokens == 0:  # what a recompute costs here
                chunks = [(r.num_computed_tokens, n) for r, n in zip(scheduled.requests, scheduled.num_tokens)]
                self.offload.record_prefill(chunks, time.perf_counter() - forward_start)
            if spans:
                self._keep_prompt_logprobs(spans, logits[len(sampling):])
                logits = logits[: len(sampling)]
            sampling, tokens, logits = self._sample(logits, sampling)
            now = time.perf_counter()
            for request, n in zip(scheduled.requests, scheduled.num_tokens):
                if request.finished:  # failed this step: its blocks are already free
                    continue
                request.num_computed_tokens += n
                named = self.cache.allocator.cache_full_blocks(request.request_id, request.all_token_ids,
                                                               request.num_computed_tokens, request.cache_salt)
                if self.offload is not None:
                    self.offload.write_through(named)
            if any(r.num_forks for r in sampling):  # n > 1: a prefill just completed
                forked, sampling, tokens, logits = self._fork(sampling, tokens, logits)
            for row, (request, token) in enumerate(zip(sampling, tokens)):
                if self._append_token(request, token, now, logits[row]):
                    new_tokens[request.request_id] = token
        changed = [r for r in scheduled.requests + forked if r.request_id in new_tokens or r.finished]
        changed += [r for r in scheduled.finished if r not in changed]
        self._record(scheduled, rows, start, changed)
        return [self._output(r, new_tokens.get(r.request_id)) for r in changed]

    def _sample(self, logits: torch.Tensor, requests: list[Request]):
        """:func:`sample_rows`, each failed row ending its request alone (finish_reason "error").
        Returns the survivors: (requests, tokens, logits rows), in the same order; a request that
        had already failed this step (its prompt logprobs) is left out too."""
        tokens, _, failures = sample_rows(logits, requests)
        for row, (part, why) in failures.items():
            self._fail(requests[row], part, why)
        keep = [row for row, request in enumerate(requests) if not request.finished]
        if len(keep) == len(requests):
            return requests, tokens, logits
        return [requests[row] for row in keep], [tokens[row] for row in keep], logits[keep]

    def _keep_prompt_logprobs(self, spans, logits: torch.Tensor) -> None:
        """Each span's prompt logprobs to its request (rows in span order); a span that fails ends
        its request alone."""
        row = 0
        for request, position, count in spans:
            try:
                _append_prompt_logprobs(request, position, logits[row : row + count])
            except Exception as error:
                self._fail(request, "prompt_logprobs", f"{type(error).__name__}: {error}")
            row += count

    def _fail(self, request: Request, part: str, why: str) -> None:
        """End one request on a failure of its own ``part`` (its stop_reason: "allowed_tokens", "logits",
        "sampling", "stop", "prompt_logprobs"): its blocks are freed; its message says why, in one line."""
        n = len(request.output_ids)
        where = f"after {n} output token{'s' * (n > 1)}" if n else "before its first token"
        self.scheduler.finish(request, "error", part, f"the request's {part} failed {where}: {why}")

    def _fork(self, sampling: list[Request], tokens: list[int], logits: torch.Tensor):
        """Parallel sampling: each request with n > 1 whose prefill just completed forks into its
        n - 1 other sequences. Each shares its block table (no K/V copied) and samples its own first
        token from the same logits row, with its own generator. Returns (the new sequences, then the
        step's sampling requests, tokens and logits rows with the new ones that sampled after those
        of ``sampling``)."""
        children, rows = [], []
        for row, parent in enumerate(sampling):
            for index in range(1, parent.num_forks + 1):
                children.append(self._fork_sequence(parent, index))
                rows.append(row)
            parent.num_forks = 0
        sampled, child_tokens, child_logits = self._sample(logits[rows], children)
        return children, sampling + sampled, tokens + child_tokens, torch.cat([logits, child_logits])

    def _fork_sequence(self, parent: Request, index: int) -> Request:
        """Sequence ``index`` of ``parent``'s request: its tokens and cache state so far, its block
        table shared, its own generator (seeded seed + index when the request has a seed)."""
        params, child_id = parent.params, sequence_id(parent.request_id, index)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.cache.k.device).manual_seed((params.seed + index) % 2**63)
        child = Request(child_id, parent.prompt_ids, params, parent.arrival_s, status=RUNNING,
                        num_computed_tokens=parent.num_computed_tokens, num_cached_tokens=parent.num_cached_tokens,
                        first_scheduled_s=parent.first_scheduled_s, generator=generator,
                        num_logprobs=parent.num_logprobs, index=index, parent_id=parent.request_id)
        child.num_prompt_logprobs, child.prompt_logprobs = parent.num_prompt_logprobs, list(parent.prompt_logprobs)
        child.cache_salt = parent.cache_salt
        self.cache.allocator.fork(parent.request_id, child_id)
        self.requests[child_id] = child
        self.scheduler.running.append(child)
        try:  # forked before any output token: a fresh matcher
            _attach_sequence_state(child, self.tokenizer)
        except ValueError as error:
            self._fail(child, "allowed_tokens", str(error))
        return child

    def _append_token(self, request: Request, token: int, now: float, logits: torch.Tensor) -> bool:
        """Add a sampled token (and its logprobs from its ``logits`` row [vocab], if asked); finish the
        request on EOS, a stop id or string, max tokens, or the context (minillm/stopping.py's rules,
        as generate's). Returns False when a part of the request failed on it: the token is taken
        back and the request ends alone with "error"."""
        kept = len(request.output_ids)
        part = "allowed_tokens"
        try:
            if request.matcher is not None:  # the constraint moves past every token the request keeps
                request.matcher.accept(token)
            part = "stop"  # its stop strings and its text
            if request.num_logprobs is not None:
                request.output_logprobs.append(_token_logprobs(logits, token, request.num_logprobs))
            request.output_ids.append(token)
            request.token_times_s.append(now)
            self._check_stop(request, token)
        except Exception as error:  # its constraint, stop strings or text: it alone fails
            del request.output_ids[kept:], request.token_times_s[kept:], request.output_logprobs[kept:]
            self._fail(request, part, f"on token {token}: {type(error).__name__}: {error}")
            return False
        return True

    def _check_stop(self, request: Request, token: int) -> None:
        """Finish the request if ``token``, just appended, ends it (the text stream is told the token)."""
        context = self.model.config.max_seq_len
        no_room = request.num_tokens > context  # no position left to decode this token
        reason, stop_reason, _ = check_stop(token, len(request.output_ids), self.eos_token_ids, request.params,
                                            no_room, request.text_stream)
        message = None
        if reason == "cache_full":  # here the room ends at the model's context, which vLLM reports as "length"
            reason, message = "length", f"reached the model's context of {context} tokens"
        if reason:
            self.scheduler.finish(request, reason, stop_reason, message)

    def _output(self, request: Request, new_token: int | None) -> RequestOutput:
        return RequestOutput(
            request.parent_id or request.request_id, request.prompt_ids, [] if new_token is None else [new_token],
            list(request.output_ids), request.finished, request.finish_reason, request.stop_reason,
            request.num_cached_tokens, request.text_stream.text if request.text_stream else None, request.message,
            None if request.num_logprobs is None else list(request.output_logprobs),
            None if request.num_prompt_logprobs is None else [None, *request.prompt_logprobs],
            index=request.index, num_cache_write_tokens=_cache_write_tokens(request, self.cache.block_size))

    def _record(self, scheduled: ScheduledBatch, rows: tuple, start: float, changed: list[Request]) -> None:
        pool = self.cache.allocator
        self.steps.append(StepRecord(
            next(self._step_numbers), start, time.perf_counter(), rows, pool.num_used_blocks, pool.num_free_blocks,
            pool.num_cached_blocks, tuple(r.request_id for r in scheduled.preempted),
            tuple(r.request_id for r in changed if r.finished), len(self.scheduler.waiting),
            len(self.scheduler.running), sum(r.num_computed_tokens for r in self.scheduler.running),
            self.offload.take_decisions() if self.offload is not None else ()))

    def close(self) -> None:
        """Write what must outlive the engine (blocks still only in the pool or the host tier) to the
        disk tier, so a restarted engine on the same folder finds them. Idempotent; nothing without tiers."""
        if self.offload is not None:
            self.offload.close()

    # -- all at once ------------------------------------------------------------------

    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run a list of prompts (token id lists) to completion; final outputs in prompt order.

        ``params``: one :class:`SamplingParams` for all, or one per prompt (vLLM's ``LLM.generate``).
        Raises ValueError as :meth:`add_request`, or for a params list of the wrong length.
        """
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise ValueError("generate() takes a list of prompts (token id lists); encode text with the tokenizer")
        if isinstance(params, Sequence):
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts; give one, or one each")
        else:
            params = [params] * len(prompts)
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp))
        except ValueError:  # a bad prompt refuses the whole call: none of its prompts stays queued
            for request_id in ids:
                self.scheduler.finish(self.requests.pop(request_id), "abort")
            raise
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def export_chrome_trace(self, path) -> Path:
        """Write the step trace as a Chrome trace (open it in ui.perfetto.dev): a scheduler track,
        a track per request, counters for blocks and queues. Returns the path; ValueError for a
        missing folder."""
        s = self.scheduler
        metadata = {"block_size": self.cache.block_size, "num_blocks": self.cache.num_blocks,
                    "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
                    "enable_chunked_prefill": s.enable_chunked_prefill}
        return write_chrome_trace(path, self.steps, self.requests, metadata)

    def __repr__(self) -> str:
        return f"LLMEngine({self.scheduler!r}, {self.cache!r})"


def _cache_points(cache_point) -> tuple[CachePoint, ...]:
    """add_request's ``cache_point`` (None, one CachePoint, or a list of them) as a tuple, shortest prefix
    first; ValueError, one line, for anything else."""
    points = () if cache_point is None else (cache_point,) if isinstance(cache_point, CachePoint) else cache_point
    if isinstance(points, (str, bytes)) or not isinstance(points, Sequence) or not all(
            isinstance(p, CachePoint) for p in points):
        raise ValueError(f"cache_point must be a CachePoint(num_tokens, ttl_s) or a list of them, got {cache_point!r}")
    return tuple(sorted(points, key=lambda p: p.num_tokens))


def _cache_write_tokens(request: Request, block_size: int) -> int:
    """The longest cache point's full-block tokens that were not read from a cache (0 before the request is
    scheduled, or without a cache point): the others' blocks are inside it."""
    if not request.cache_points or request.first_scheduled_s is None:
        return 0
    pinned = min(request.cache_points[-1].num_tokens, request.num_prompt_tokens) // block_size * block_size
    return max(0, pinned - request.num_cached_tokens)


def _token_logprobs(logits, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of ``token``, the k most likely (id, logprob)) from one row of raw logits [vocab]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = logprobs.topk(k)
    return logprobs[token].item(), list(zip(top.indices.tolist(), top.values.tolist()))


def _append_prompt_logprobs(request: Request, position: int, logits: torch.Tensor) -> None:
    """Append a span's prompt logprobs to its request: the span's row for position p [count, vocab]
    scores prompt token p + 1, from ``position`` on."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(request.prompt_ids[position + 1 : position + 1 + len(logits)], device=logprobs.device)
    values = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    top = logprobs.topk(request.num_prompt_logprobs, dim=-1)
    for value, ids, top_values in zip(values, top.indices.tolist(), top.values.tolist()):
        request.prompt_logprobs.append((value, list(zip(ids, top_values))))


def _attach_sequence_state(request: Request, tokenizer) -> None:
    """A new sequence's own parts: its text stream (stop strings) and its constraint's matcher.
    ValueError, one line, when the constraint cannot make a matcher (any error of ``matcher()``)."""
    if tokenizer is not None:
        request.text_stream = TextStream(tokenizer, request.params.stop)
    if request.params.allowed_tokens is not None:
        try:
            request.matcher = request.params.allowed_tokens.matcher()
        except Exception as error:
            raise ValueError(f"the constraint (allowed_tokens) cannot start: {type(error).__name__}: {error}") from None


def _is_nested(prompt_ids) -> bool:
    """A list of several lists: a batch of prompts ([[1, 2]] alone is one prompt, as in generate)."""
    return isinstance(prompt_ids, (list, tuple)) and len(prompt_ids) > 1 and isinstance(prompt_ids[0], (list, tuple))
