"""A workload: the requests a serving benchmark sends, and when it sends them.

A serving engine is judged on a stream of requests, not on one. A workload fixes
three things for each request, all drawn from a seeded RNG so a run can be repeated:

    request i:  arrival_s       when it reaches the server (s after the run starts)
                prompt_ids      what it asks (its length: the prefill work)
                max_tokens      how much it may answer (the decode work)

Arrivals. Online serving is usually modelled as a Poisson process: requests come
independently at an average ``rate`` per second, so the gaps between them are
exponential with mean 1/rate. vLLM's ``benchmarks/benchmark_serving.py`` (``get_request``)
sends the first request at once, then sleeps a gap drawn from a gamma distribution
before each next one; its ``--burstiness`` is the gamma shape (1.0 = exponential =
Poisson; < 1 burstier, > 1 more even). Offline (``rate`` None or inf): all at 0::

    rate = 2 req/s  (mean gap 0.5 s)
    t (s)  0        0.5        1.0        1.5        2.0
           |r0 r1   |    r2 r3 r4   |          |   r5     |     gaps vary, mean 1/rate
    offline
           |r0..r5 all at t = 0: the engine decides the order, the queue is full at once

Lengths. Prompt and output lengths come from a named distribution, parsed from a
string a CLI user can type (:func:`parse_lengths`):

    "128" / "fixed:128"   every request 128 tokens
    "uniform:32-512"      an integer uniform in [32, 512], both ends included
    "random:256,0.5"      vLLM's random dataset, ``--random-input-len 256
                          --random-range-ratio 0.5``: uniform in
                          [floor(256·(1-0.5)), ceil(256·(1+0.5))] = [128, 384]
    "normal:256,64"       round(N(256, 64²)), clipped to >= 1

Prompts are random token ids (:func:`make_workload`), or real text read from a JSONL
file and tokenized (:func:`load_jsonl`). Random ids have no meaning but exercise the
engine exactly like text of the same length; keep special ids (BOS, EOS, chat markers)
out of them, since an EOS in a prompt can change what a model does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

LENGTH_FORMS = ("N", "fixed:N", "uniform:LO-HI", "random:N,RATIO (0 <= RATIO < 1)", "normal:MEAN,STD")


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload.

    Attributes:
        arrival_s: when it is sent, seconds after the run starts (>= 0).
        prompt_ids: the prompt's token ids (at least one).
        max_tokens: the most output tokens it may get (>= 1), vLLM's ``max_tokens``.
    """

    arrival_s: float
    prompt_ids: tuple[int, ...]
    max_tokens: int

    def __post_init__(self):
        if not self.arrival_s >= 0:
            raise ValueError(f"arrival_s must be >= 0 s after the run starts, got {self.arrival_s}")
        if not self.prompt_ids:
            raise ValueError("prompt_ids is empty; a request needs at least one prompt token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class LengthDistribution:
    """A distribution of token counts, as parsed by :func:`parse_lengths`.

    Attributes:
        spec: the string it was parsed from (shown by :func:`describe`).
        low, high: the smallest and largest length it can draw (tokens, inclusive);
            high is None for "normal" (unbounded above).
        mean, std: of the normal before rounding and clipping; None for the uniform forms.
    """

    spec: str
    low: int
    high: int | None
    mean: float | None = None
    std: float | None = None

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        """Draw n lengths (tokens, each >= 1) with ``rng`` (``np.random.default_rng(seed)``)."""
        if self.std is None:
            return rng.integers(self.low, self.high + 1, size=n).tolist()
        drawn = np.rint(rng.normal(self.mean, self.std, size=n))
        return np.maximum(drawn, self.low).astype(int).tolist()


def parse_lengths(spec: str) -> LengthDistribution:
    """Parse a length distribution: "128", "fixed:128", "uniform:32-512", "random:256,0.5"
    or "normal:256,64" (see the module docstring for what each draws).

    Raises ValueError (one line naming the accepted forms) for anything else, for a
    length < 1, LO > HI, a negative STD or a RATIO outside [0, 1).
    """
    try:
        dist = _parse(spec.strip())
    except (ValueError, AttributeError):
        dist = None
    if dist is None:
        raise ValueError(f"bad length spec {spec!r}: use one of {', '.join(LENGTH_FORMS)}; lengths >= 1 token")
    return dist


def _parse(spec: str) -> LengthDistribution | None:
    """The distribution of a stripped spec, or None when it is malformed."""
    kind, _, args = spec.partition(":") if ":" in spec else ("fixed", ":", spec)
    if kind == "fixed":
        low = high = int(args)
    elif kind == "uniform":
        low, high = (int(a) for a in args.split("-"))
    elif kind == "random":  # vLLM's RandomDataset: [floor(N·(1-r)), ceil(N·(1+r))]
        n, ratio = args.split(",")
        n, ratio = int(n), float(ratio)
        if not 0 <= ratio < 1 or n < 1:
            return None
        low, high = max(1, math.floor(n * (1 - ratio))), math.ceil(n * (1 + ratio))
    elif kind == "normal":
        mean, std = (float(a) for a in args.split(","))
        ok = mean >= 1 and std >= 0 and math.isfinite(mean + std)
        return LengthDistribution(spec, 1, None, mean, std) if ok else None
    else:
        return None
    return LengthDistribution(spec, low, high) if 1 <= low <= high else None


def poisson_arrivals(
    n: int, rate_per_s: float | None, seed: int | np.random.SeedSequence = 0, burstiness: float = 1.0
) -> list[float]:
    """Arrival times (s after the start) of n requests sent at ``rate_per_s`` on average.

    As vLLM's ``benchmarks/benchmark_serving.py`` (``get_request``) sends them: the first
    request at 0.0, each next one a gap later, gaps drawn from Gamma(shape=burstiness,
    scale=1/(rate·burstiness)), whose mean is 1/rate. burstiness 1.0 makes the gaps
    exponential: a Poisson process. ``rate_per_s`` None or inf: offline, all at 0.0.

    Raises ValueError for n < 0, rate_per_s <= 0 or burstiness <= 0.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0 requests, got {n}")
    if rate_per_s is not None and not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0 requests/s (None or inf: offline), got {rate_per_s}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1.0: Poisson), got {burstiness}")
    if rate_per_s is None or math.isinf(rate_per_s) or n == 0:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate_per_s * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def safe_token_ids(tokenizer) -> list[int]:
    """Every id of ``tokenizer`` that is not special: 0..vocab_size-1 minus its special
    ids, BOS and EOS ids. Pass it as ``make_workload(token_ids=...)``."""
    special = set(getattr(tokenizer, "special_ids", ()))
    special |= set(getattr(tokenizer, "eos_token_ids", ()))
    special.add(getattr(tokenizer, "bos_token_id", None))
    return [i for i in range(tokenizer.vocab_size) if i not in special]


def make_workload(
    n_requests: int,
    prompt_lengths: str | LengthDistribution,
    output_lengths: str | LengthDistribution,
    rate: float | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    low: int = 0,
    high: int | None = None,
    token_ids: Sequence[int] | None = None,
    burstiness: float = 1.0,
    shared_prefix_len: int = 0,
) -> list[WorkloadRequest]:
    """n_requests random prompts, deterministic for a seed, sorted by arrival.

    Args:
        n_requests: how many requests (>= 1).
        prompt_lengths, output_lengths: length specs (:func:`parse_lengths`) or
            distributions; output lengths become each request's ``max_tokens``.
        rate: mean arrival rate (requests/s); None or inf: offline, all at 0.0.
        seed: seeds lengths, token ids and arrivals. The arrivals use their own stream,
            so the same seed at another rate gives the same prompts.
        vocab_size, low, high: prompt ids are drawn uniformly from [low, high), high
            defaulting to vocab_size. Keep special ids outside: e.g. GPT-2's only special
            id is its last (50256), so ``vocab_size=50256`` avoids it.
        token_ids: instead, the ids to draw from, e.g. ``safe_token_ids(tokenizer)``.
        burstiness: gamma shape of the arrival gaps (1.0: Poisson), see :func:`poisson_arrivals`.
        shared_prefix_len: tokens of one random prefix put before every prompt (vLLM's
            ``--random-prefix-len``; what a prefix cache can reuse). A prompt's length is
            shared_prefix_len + its sampled length.

    Raises ValueError for n_requests < 1, a bad length spec, no id range or an empty one.
    """
    if n_requests < 1:
        raise ValueError(f"n_requests must be >= 1, got {n_requests}")
    pool = _id_pool(vocab_size, low, high, token_ids)
    content_seed, arrival_seed = np.random.SeedSequence(seed).spawn(2)
    rng = np.random.default_rng(content_seed)
    prompt_lens = _as_dist(prompt_lengths).sample(n_requests, rng)
    max_tokens = _as_dist(output_lengths).sample(n_requests, rng)
    prefix = tuple(rng.choice(pool, size=shared_prefix_len).tolist())
    arrivals = poisson_arrivals(n_requests, rate, arrival_seed, burstiness)
    return [
        WorkloadRequest(t, prefix + tuple(rng.choice(pool, size=n_p).tolist()), n_out)
        for t, n_p, n_out in zip(arrivals, prompt_lens, max_tokens)
    ]


def _as_dist(lengths: str | LengthDistribution) -> LengthDistribution:
    return lengths if isinstance(lengths, LengthDistribution) else parse_lengths(lengths)


def _id_pool(vocab_size: int | None, low: int, high: int | None, token_ids: Sequence[int] | None) -> np.ndarray:
    """The token ids prompts are drawn from (see :func:`make_workload`)."""
    if token_ids is not None:
        pool = np.asarray(list(token_ids), dtype=np.int64)
        if pool.size == 0:
            raise ValueError("token_ids is empty; pass the ids prompts may use, e.g. safe_token_ids(tokenizer)")
        return pool
    high = vocab_size if high is None else high
    if high is None:
        raise ValueError("no token id range: pass vocab_size, high or token_ids=safe_token_ids(tokenizer)")
    if not 0 <= low < high:
        raise ValueError(f"token id range [low, high) = [{low}, {high}) is empty or negative")
    return np.arange(low, high, dtype=np.int64)


def load_jsonl(
    path: str | Path, tokenizer, rate: float | None = None, seed: int = 0, burstiness: float = 1.0
) -> list[WorkloadRequest]:
    """A workload of real prompts: one JSON object a line, ``{"prompt": str, "max_tokens": int}``.

    Each prompt becomes ``tokenizer.encode(prompt)`` (with the BOS/EOS the tokenizer adds
    by default; any object with ``encode(str) -> list[int]`` works). Blank lines are
    skipped. Arrivals as :func:`poisson_arrivals` (rate None: offline, all at 0.0).

    Raises ValueError "path:LINE: ..." for bad JSON, a missing key, a prompt that is not
    a non-empty string (or encodes to no tokens), a max_tokens that is not an int >= 1;
    and for a file with no requests.
    """
    prompts: list[tuple[int, ...]] = []
    max_tokens: list[int] = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            ids, n_out = _parse_line(line, tokenizer, f"{path}:{lineno}")
            prompts.append(ids)
            max_tokens.append(n_out)
    if not prompts:
        raise ValueError(f'{path}: no requests; write one {{"prompt": ..., "max_tokens": ...}} object a line')
    arrivals = poisson_arrivals(len(prompts), rate, seed, burstiness)
    return [WorkloadRequest(t, ids, n) for t, ids, n in zip(arrivals, prompts, max_tokens)]


def _parse_line(line: str, tokenizer, where: str) -> tuple[tuple[int, ...], int]:
    """(prompt ids, max_tokens) of one JSONL line; ``where`` ("path:LINE") starts each error."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f'{where}: expected an object {{"prompt": str, "max_tokens": int}}, got {type(obj).__name__}')
    for key in ("prompt", "max_tokens"):
        if key not in obj:
            raise ValueError(f"{where}: missing key {key!r} (keys: prompt, max_tokens)")
    prompt, n_out = obj["prompt"], obj["max_tokens"]
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: prompt must be a non-empty string, got {prompt!r}")
    if not isinstance(n_out, int) or isinstance(n_out, bool) or n_out < 1:
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {n_out!r}")
    ids = tuple(tokenizer.encode(prompt))
    if not ids:
        raise ValueError(f"{where}: prompt {prompt!r} encodes to no tokens")
    return ids, n_out


def describe(workload: Sequence[WorkloadRequest]) -> dict[str, float | int]:
    """Summary of a workload for a CLI to print, lengths in tokens.

    Keys: n_requests; arrival_span_s (last arrival, s); arrival_rate_req_s, measured as
    (n - 1) / arrival_span_s (inf when all arrive at once: offline); prompt_len_min,
    prompt_len_mean, prompt_len_max; max_tokens_min, max_tokens_mean, max_tokens_max;
    total_prompt_tokens, total_max_tokens, total_tokens (prompt + max_tokens, the most
    the run can process).

    Raises ValueError for an empty workload.
    """
    if not workload:
        raise ValueError("describe: empty workload; make one with make_workload(...) or load_jsonl(...)")
    span = max(r.arrival_s for r in workload) - min(r.arrival_s for r in workload)
    prompt = [len(r.prompt_ids) for r in workload]
    out = [r.max_tokens for r in workload]
    return {
        "n_requests": len(workload),
        "arrival_span_s": span,
        "arrival_rate_req_s": (len(workload) - 1) / span if span > 0 else math.inf,
        **_min_mean_max("prompt_len", prompt),
        **_min_mean_max("max_tokens", out),
        "total_prompt_tokens": sum(prompt),
        "total_max_tokens": sum(out),
        "total_tokens": sum(prompt) + sum(out),
    }


def _min_mean_max(name: str, values: list[int]) -> dict[str, float | int]:
    return {f"{name}_min": min(values), f"{name}_mean": sum(values) / len(values), f"{name}_max": max(values)}
