"""The serving benchmark over HTTP: a workload sent to an OpenAI-compatible server, timed by the client.

:mod:`minillm.bench.serving` replays a workload inside the process, on the engine. Here the
same workload goes to a server (``minillm serve``, vLLM, any OpenAI-compatible one) as its
users would send it, and every latency is taken where a user feels it, on the client::

    workload (arrival_s, prompt ids, max_tokens)
       at each arrival:  POST /v1/completions {"prompt": [ids], "max_tokens": n, "stream": true,
                                               "ignore_eos": true, "temperature": 0, ...}
       <── SSE chunks:   data: {"choices": [{"text": ...}]}   each timestamped here on arrival
                         ...
                         data: {"choices": [], "usage": {"completion_tokens": n, ...}}
                         data: [DONE]
    ──> one ClientRequest per request ──> run_metrics.summarize_run ──> the same RunSummary

This is what vLLM's ``benchmarks/benchmark_serving.py`` does (``backend_request_func.py``,
``async_request_openai_completions``), with these rules:

- A request's clock starts at its *scheduled* arrival, as in the in-process benchmark;
  ``queue_ms`` here is how late the client sent it (the server's own queue is inside TTFT).
- Tokens per chunk: ``len(token_ids)`` when the server sends them (vLLM's
  ``return_token_ids``), else ``len(logprobs.tokens)``, else 1 for a chunk whose text is
  not empty and 0 for one whose text is empty (a server holding back a partial UTF-8
  character or a possible stop string sends nothing visible yet). A token's time is when
  the chunk that carried it arrived: a chunk of k tokens gives k equal timestamps.
- The count is checked against the final ``usage.completion_tokens`` (the server's own
  count, asked for with ``stream_options: {"include_usage": true}``). When they differ
  (text held back and sent later with another token's), the usage wins: missing tokens
  are timed at the last chunk that carried text or tokens (their text had arrived by
  then), extra ones dropped from the end; such requests are counted (``n_count_mismatch``).
- TTFT: first token's time - arrival. TPOT: (e2e - TTFT) / (tokens - 1), tokens from the
  usage, as vLLM's bench. ITL: one gap per *token*, the gaps between consecutive token
  times. vLLM's bench appends one gap per *chunk*; the two agree when every chunk carries
  one token (minillm's server sends a chunk per token, vLLM's usually does); a chunk of k
  tokens adds k - 1 zero gaps here, so the mean ITL stays equal to the mean gap per token
  and the p99 still shows the long waits.
- A failed request (connection error, HTTP error status, an error event or a malformed
  event in the stream, a stream that ends with no finish_reason, the run's overall
  timeout) is counted in ``n_failed`` with its message, and enters the summary as
  ``finish_reason "abort"``: an SLO miss, outside every latency, as run_metrics treats
  aborted requests. A run never raises for a failed request; only the untimed warm-up
  request sent before it (:func:`warm_up`) stops it when it fails, since all would.

Against a server with a Prometheus ``/metrics`` (minillm's, vLLM's), the server's own
TTFT / ITL / e2e over the same run are read from two scrapes
(:mod:`minillm.bench.metrics_scrape`), so the client-side minus server-side gap shows what
HTTP, JSON, detokenization and queueing outside the engine cost.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from ..serving.run_metrics import RunSummary, request_metrics, span_s, summarize_run
from .metrics_scrape import ServerSideNumbers, scrape_delta
from .workload import WorkloadRequest

ERRORS_SHOWN = 5  # distinct failure messages kept in a result


@dataclass
class ClientRequest:
    """One request as the client saw it; what :func:`run_metrics.request_metrics` reads.

    Attributes:
        request_id: its index in the workload, as a string.
        max_tokens: what it asked for; with ignore_eos every completed request should get them all.
        arrival_s: scheduled arrival (``time.perf_counter()`` s): run start + the workload's arrival_s.
        first_scheduled_s: when the client sent it (perf_counter s); minus arrival_s: the client's lateness.
        num_prompt_tokens: ``usage.prompt_tokens``, else the workload's prompt length.
        token_times_s: one perf_counter time per output token (see the module docstring).
        num_cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` (prefix-cache hits), else 0.
        finish_reason: the server's ("length", "stop"), or "abort" for a failed request.
        error: why it failed ("HTTP 400: ...", "ConnectError: ..."); None when it did not.
        num_chunks: SSE events with a choice; chunk_tokens: the tokens counted from them.
        usage_completion_tokens: the server's count, None when it sent no usage.
        text: the streamed text, joined.
    """

    request_id: str
    arrival_s: float
    max_tokens: int = 0
    first_scheduled_s: float | None = None
    num_prompt_tokens: int = 0
    token_times_s: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    num_chunks: int = 0
    chunk_tokens: int = 0
    usage_completion_tokens: int | None = None
    text: str = ""


@dataclass
class HttpRunResult:
    """One workload sent to one server.

    Attributes:
        base_url, model: where it went, and the model name sent.
        summary: :func:`run_metrics.summarize_run` of the client-side records.
        requests: the :class:`ClientRequest` of every request, workload order.
        n_failed: requests that failed (their messages: ``errors``, message -> count, first few).
        n_count_mismatch: requests whose counted tokens differed from usage.completion_tokens.
        n_without_usage: requests that ended without a usage (their count is the client's own).
        n_short: completed requests with fewer tokens than their max_tokens (a server that
            ignores ``ignore_eos`` stops at EOS: less work than the in-process runs).
        server: the server-side numbers of the run; None when /metrics could not be read
            (``server_note`` says why).
    """

    base_url: str
    model: str
    summary: RunSummary
    requests: list[ClientRequest]
    n_failed: int
    errors: dict[str, int]
    n_count_mismatch: int
    n_without_usage: int
    n_short: int
    server: ServerSideNumbers | None = None
    server_note: str = ""

    def ttft_gap_ms(self) -> float | None:
        """Client minus server mean TTFT (ms): HTTP, JSON, detokenization and queueing outside the
        engine; None without both. Means only: the server's mean is exact (_sum / _count), its
        percentiles are bucket estimates (metrics_scrape), too coarse to subtract from exact
        client percentiles (a p50 gap came out at -816 ms with every client TTFT under the
        server's estimated p50)."""
        server = self.server.stats_ms("ttft").get("mean") if self.server else None
        client = self.summary.mean_ttft_ms
        return None if server is None or client is None else client - server

    def to_dict(self) -> dict:
        return {"base_url": self.base_url, "model": self.model, "summary": self.summary.to_dict(),
                "n_failed": self.n_failed, "errors": self.errors, "n_count_mismatch": self.n_count_mismatch,
                "n_without_usage": self.n_without_usage, "n_short": self.n_short,
                "ttft_gap_mean_ms": self.ttft_gap_ms(),
                "server": None if self.server is None else self.server.to_dict(), "server_note": self.server_note,
                "requests": [_request_dict(r) for r in self.requests]}


def _request_dict(r: ClientRequest) -> dict:
    """Per-request numbers for JSON; latencies (ms, from arrival) only for a completed request."""
    m = request_metrics(r) if r.error is None else None
    return {"request_id": r.request_id, "prompt_tokens": r.num_prompt_tokens, "output_tokens": len(r.token_times_s),
            "finish_reason": r.finish_reason, "error": r.error, "num_chunks": r.num_chunks,
            "usage_completion_tokens": r.usage_completion_tokens,
            **{k: None if m is None else getattr(m, k) for k in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms")}}


# -- one request ------------------------------------------------------------------------------------


def completion_body(model: str, request: WorkloadRequest) -> dict:
    """The JSON body of one benchmark request: greedy, exactly max_tokens (vLLM's ``ignore_eos``),
    streamed with the usage at the end (OpenAI's ``stream_options.include_usage``)."""
    return {"model": model, "prompt": list(request.prompt_ids), "max_tokens": request.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def chunk_token_count(choice: dict) -> int:
    """Tokens one streamed choice carries (rule in the module docstring)."""
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    return 1 if choice.get("text") else 0


async def send_request(client, url: str, body: dict, record: ClientRequest,
                       clock: Callable[[], float] = time.perf_counter) -> None:
    """POST one streaming completion and fill ``record`` from its chunks, each stamped with
    ``clock()`` (s) as it arrives; failures go in ``record.error`` (never raised), as does
    cancellation by the run's timeout."""
    import httpx

    last_seen_s = None
    try:
        record.first_scheduled_s = clock()
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {_error_message(await response.aread())}"
                return
            async for line in response.aiter_lines():
                now = clock()
                if not line.startswith("data:"):
                    continue  # SSE comments, blank separators
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                last_seen_s = _read_event(json.loads(data), now, record, last_seen_s)
                if record.error:
                    return
    except (httpx.HTTPError, ValueError) as e:  # ValueError: an event that is not JSON, or not OpenAI's shape
        record.error = f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        record.error = "cancelled: the run's overall timeout passed"
        raise
    finally:
        _finish(record, last_seen_s)


def _read_event(event, now: float, record: ClientRequest, last_seen_s: float | None) -> float | None:
    """Fold one SSE event into ``record``; returns the time of the last chunk that carried text or
    tokens. Raises ValueError for an event that is not OpenAI's chunk shape."""
    if not isinstance(event, dict) or not all(isinstance(c, dict) for c in event.get("choices") or []):
        raise ValueError(f"a streamed event that is not an OpenAI chunk: {json.dumps(event)[:200]}")
    if "error" in event:
        record.error = f"error event: {_error_message(json.dumps(event).encode())}"
        return last_seen_s
    for choice in event.get("choices") or []:
        record.num_chunks += 1
        n = chunk_token_count(choice)
        record.chunk_tokens += n
        record.token_times_s.extend([now] * n)
        record.text += choice.get("text") or ""
        if n or choice.get("text"):
            last_seen_s = now
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if isinstance(usage, dict):
        record.usage_completion_tokens = usage.get("completion_tokens")
        record.num_prompt_tokens = usage.get("prompt_tokens") or record.num_prompt_tokens
        record.num_cached_tokens = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return last_seen_s


def _finish(record: ClientRequest, last_seen_s: float | None) -> None:
    """The usage's count wins over the chunk count (module docstring); a failure ends as "abort"."""
    n = record.usage_completion_tokens
    if record.error is None and n is not None and n != len(record.token_times_s):
        del record.token_times_s[n:]
        if last_seen_s is not None:
            record.token_times_s.extend([last_seen_s] * (n - len(record.token_times_s)))
    if record.error is None and not record.token_times_s:
        record.error = "the stream ended without any output token"
    elif record.error is None and record.finish_reason is None:  # OpenAI's last choice always has one
        record.error = f"the stream ended with no finish_reason, after {len(record.token_times_s)} tokens (cut off?)"
    if record.error is not None:
        record.finish_reason = "abort"


def _error_message(body: bytes) -> str:
    """OpenAI's ``{"error": {"message": ...}}`` message, else the body's first 200 characters."""
    text = body.decode("utf-8", errors="replace")
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200].strip() or "(empty body)"


# -- a run ------------------------------------------------------------------------------------------


def auth_headers(api_key: str | None) -> dict[str, str]:
    """OpenAI's bearer-token header for a server started with an API key (``serve --api-key``)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(base_url: str, timeout_s: float = 10.0, api_key: str | None = None) -> str:
    """The first model id of ``GET /v1/models``. Raises ValueError (one line) when the server
    cannot be reached or lists no model."""
    import httpx

    try:
        response = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=timeout_s, headers=auth_headers(api_key))
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"cannot read the model from {base_url}/v1/models ({type(e).__name__}: {e}); "
                         "is the server running? give the model name with --model") from None


async def _scrape(client, base_url: str) -> str | None:
    import httpx

    try:
        response = await client.get(f"{base_url}/metrics")
        return response.text if response.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def run_http_bench_async(base_url: str, workload: Sequence[WorkloadRequest], model: str,
                               ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None,
                               timeout_s: float = 600.0, progress: Callable[[int, int], None] | None = None,
                               warm_up_first: bool = True, api_key: str | None = None,
                               clock: Callable[[], float] = time.perf_counter,
                               sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                               max_concurrency: int | None = None) -> HttpRunResult:
    """Send ``workload`` to ``base_url`` in real time and measure it; see :func:`run_http_bench`.

    ``clock`` (s) stamps arrivals, sends and chunks, and ``sleep(s)`` waits for each arrival: the
    seam a test replaces with a fake clock to check the schedule without depending on the
    machine's load (the overall ``timeout_s`` stays in real seconds)."""
    import httpx

    if not workload:
        raise ValueError("empty workload; make one with workload.make_workload(...)")
    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=len(workload), max_keepalive_connections=len(workload))
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits,
                                 headers=auth_headers(api_key)) as client:
        if warm_up_first:
            await warm_up(client, f"{base_url}/v1/completions", model, workload[0], clock)
        before = await _scrape(client, base_url)
        records = await _send_all(client, f"{base_url}/v1/completions", model, workload, timeout_s, progress,
                                  clock, sleep, max_concurrency)
        after = await _scrape(client, base_url) if before is not None else None
    return _result(base_url, model, records, ttft_slo_ms, tpot_slo_ms, before, after, clock)


async def warm_up(client, url: str, model: str, first: WorkloadRequest,
                  clock: Callable[[], float] = time.perf_counter) -> None:
    """One short untimed request before the run, as vLLM's bench's "initial test run": the server's
    first forward passes are slow, and a server that refuses the run's requests (an unknown
    model, a bad field) should stop the run in one line, not fail every request. Its prompt is
    4 of the first request's ids reversed: too short to fill a KV block, so it leaves nothing
    in a prefix cache for the run to hit. Raises ValueError when it fails."""
    record = ClientRequest("warm-up", clock(), 2)
    body = completion_body(model, WorkloadRequest(0.0, tuple(reversed(first.prompt_ids[:4])), 2))
    await send_request(client, url, body, record, clock)
    if record.error is not None:
        raise ValueError(f"the warm-up request to {url} failed: {record.error}")


async def _send_all(client, url, model, workload, timeout_s, progress, clock, sleep,
                    max_concurrency: int | None = None) -> list[ClientRequest]:
    """Each request sent at its arrival (vLLM's bench sleeps the gaps), or with ``max_concurrency`` when one of
    that many slots is free; all bounded by ``timeout_s``."""
    t0 = clock()
    records = [ClientRequest(str(i), t0 + w.arrival_s, w.max_tokens, num_prompt_tokens=len(w.prompt_ids))
               for i, w in enumerate(workload)]
    done = [0]
    slots = asyncio.Semaphore(max_concurrency or len(workload))

    async def one(w: WorkloadRequest, record: ClientRequest) -> None:
        await sleep(max(0.0, record.arrival_s - clock()))
        async with slots:
            if max_concurrency is not None:  # (vLLM's bench: its TTFT counts from here, not from the wait)
                record.arrival_s = clock()
            await send_request(client, url, completion_body(model, w), record, clock)
        done[0] += 1
        if progress is not None:
            progress(done[0], len(workload))

    tasks = [asyncio.create_task(one(w, r)) for w, r in zip(workload, records)]
    finished, late = await asyncio.wait(tasks, timeout=timeout_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    for task in finished:
        task.result()  # send_request keeps every failure of the request in its record: what is left is a bug
    for record in records:
        if record.finish_reason is None:  # cancelled before it was sent
            record.error, record.finish_reason = "not sent: the run's overall timeout passed", "abort"
    return records


def _result(base_url, model, records, ttft_slo_ms, tpot_slo_ms, before, after, clock) -> HttpRunResult:
    failed = [r for r in records if r.error is not None]
    has_tokens = any(r.token_times_s for r in records if r.error is None)
    duration = span_s(records) if has_tokens else max(clock() - records[0].arrival_s, 1e-9)
    result = HttpRunResult(
        base_url, model, summarize_run(records, duration, ttft_slo_ms, tpot_slo_ms), records, len(failed),
        dict(Counter(r.error for r in failed).most_common(ERRORS_SHOWN)),
        sum(1 for r in records if r.error is None and r.usage_completion_tokens is not None
            and r.usage_completion_tokens != r.chunk_tokens),
        sum(1 for r in records if r.error is None and r.usage_completion_tokens is None),
        sum(1 for r in records if r.error is None and len(r.token_times_s) < r.max_tokens))
    if before is None or after is None:
        result.server_note = "no /metrics on the server: server-side numbers skipped"
    else:
        try:
            result.server = scrape_delta(before, after)
            result.server_note = result.server.note
        except ValueError as e:
            result.server_note = f"{e}; server-side numbers skipped"
    return result


def run_http_bench(base_url: str, workload: Sequence[WorkloadRequest], model: str | None = None,
                   ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None, timeout_s: float = 600.0,
                   progress: Callable[[int, int], None] | None = None, warm_up_first: bool = True,
                   api_key: str | None = None, max_concurrency: int | None = None) -> HttpRunResult:
    """Send ``workload`` to an OpenAI-compatible server in real time; client-side and server-side numbers.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (the ``/v1/...`` paths are added).
        workload: from :func:`~minillm.bench.workload.make_workload`; prompts go as token ids.
        model: the model name to send; None: the first of ``GET /v1/models``.
        ttft_slo_ms, tpot_slo_ms: the SLOs of attainment and goodput (None: not checked).
        timeout_s: the whole run's limit (s); requests still running then are cancelled and
            count as failed. Also each request's read timeout.
        progress: called as (n_done, n_requests) after each request ends.
        warm_up_first: send one short untimed request first (:func:`warm_up`).
        api_key: sent as ``Authorization: Bearer KEY`` (a server started with ``--api-key``).
        max_concurrency: at most this many requests in flight (vLLM's ``--max-concurrency``); a request
            that arrives while all are busy waits, and its TTFT counts from when it is sent. None: no limit.

    Returns a :class:`HttpRunResult`; failed requests are counted in it, never raised.
    Raises ValueError for an empty workload, when no model is given and ``/v1/models``
    cannot be read (the server is not there), or when the untimed warm-up request
    (:func:`warm_up`) fails: then every request would.
    """
    model = model or served_model(base_url, api_key=api_key)
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (None: no limit), got {max_concurrency}")
    return asyncio.run(run_http_bench_async(base_url, workload, model, ttft_slo_ms, tpot_slo_ms, timeout_s, progress,
                                            warm_up_first, api_key, max_concurrency=max_concurrency))
