"""Prompt caching beyond the pool on two workloads, five ways, with the providers' bills and the side channel.

    python benchmarks/kv_tiers_workloads.py                 # SmolLM2-135M float32: 8 min on 2 busy cores
    python benchmarks/kv_tiers_workloads.py --conversations 6 --turns 6 --questions 8   # bigger
    python benchmarks/kv_tiers_workloads.py --threads 1      # on a busy machine (see BENCHMARKS.md)

Two workloads run one request at a time through :class:`~minillm.LLMEngine` (greedy), with a KV pool
too small to keep them (``--num-blocks``; the script prints the pool's blocks against the workload's
distinct blocks):

    multi-turn chat     C conversations of T turns, interleaved (turn 1 of each, then turn 2 of each, ...);
                        each opens with a system prompt of its own (a line naming its customer, then
                        prefix-demo's ~1,330-token support policy; --shared-system-prompt: the policy alone,
                        shared); turn t = turn t-1's prompt + its answer + a new user message (the chat template)
    shared document     one long document (Coriolanus, act 1: tests/data/coriolanus_act1.txt) and Q
                        questions after it; between two questions F other requests ("sort these words")
                        push the document out of the pool

each in five configurations: no cache (``enable_prefix_caching=False``), pool only, pool + host
(``kv_offload_memory``), pool + host + disk (``kv_offload_dir``), and after a restart (a new engine on
the same disk folder, the workload replayed: the page cache is warm). For each: prefill tokens computed
(prompt - cached), TTFT p50/p99 of the measured requests (chat: every turn; document: the questions),
output tok/s and wall seconds over the whole workload; the greedy outputs must be equal in all five.

Every request marks a cache point (Anthropic's ``cache_control``, 5 minutes; ``--no-cache-points``: none): a
chat turn its whole prompt, a question the end of the document. The engine pins a cache point's blocks in
the host and disk tiers. The measured token counts are then billed by two providers' rules:

    OpenAI     prompts of >= 1,024 tokens: the cached prefix, in 128-token increments from 1,024, at
               --openai-cached-price of the input price (0.5: GPT-4o's $1.25 against $2.50 a million;
               openai.com/index/api-prompt-caching, Oct 2024; later models discount more)
    Anthropic  cache reads 0.1x the base input price, cache writes 1.25x (5-minute lifetime) or 2x (1 hour)
               (platform.claude.com/docs/en/build-with-claude/prompt-caching)

Then the side channel of "Leaking Secrets from Prefix Caches" (arXiv 2411.18191): the TTFT of a guess whose
prefix another user cached against a wrong guess, shared cache, then with per-user ``cache_salt`` (vLLM's).
The 1-minute load average is printed before and after: timings on a busy machine are slower.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

import minillm
from minillm import LLMEngine, SamplingParams
from minillm.block_hash import block_hashes
from minillm.metrics import percentile
from minillm.prefix_demo import question, system_prompt
from minillm.serving.kv_tiers import CachePoint

DOCUMENT = Path(__file__).resolve().parent.parent / "tests" / "data" / "coriolanus_act1.txt"
CONFIGS = ("no cache", "pool", "pool + host", "pool + host + disk", "after a restart")
DOCUMENT_QUESTIONS = ["Who is the chief enemy of the people, according to the First Citizen?",
                      "What do the citizens want from the patricians?", "Which fable does Menenius tell?",
                      "Why are the citizens angry about the price of corn?", "Who speaks for the patricians?",
                      "What news does the messenger bring about the Volsces?", "How does Marcius treat the crowd?",
                      "Name two tribunes of the people mentioned in the scene."]
CUSTOMERS = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth"]
SORT_WORDS = "Sort these words alphabetically and say which comes first: "


# -- workloads: token ids only, nothing run ----------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """One request of a workload.

    Attributes:
        new_ids: token ids appended to the conversation's history (the whole prompt when
            ``conversation`` is None).
        conversation: a chat's name: its prompt is the previous turn's prompt + answer + new_ids.
        cache_point_tokens: the cache point covers the history and this many of new_ids (None: no point).
        max_new_tokens: the answer's length bound.
        measured: counted in TTFT (the document's fillers are not).
    """

    new_ids: list[int]
    conversation: str | None = None
    cache_point_tokens: int | None = None
    max_new_tokens: int = 16
    measured: bool = True


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The chat template's token ids of ``messages`` (plain "role: content" lines without a template)."""
    if tokenizer.has_chat_template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages)
                            + ("assistant:" if add_generation_prompt else ""))


def followup_ids(tokenizer, system: str, user: str) -> list[int]:
    """The tokens a chat template puts between an assistant's answer and the next generation: the end of
    the answer's turn, the user's message, the generation prompt.

    Found as the template's text of [system, user "X", assistant "Y", user] after that of [system, user "X"]
    and "Y" (ChatML: "<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n").
    Raises ValueError when the template does not render earlier turns as a prefix of later ones.
    """
    first = [{"role": "system", "content": system}, {"role": "user", "content": "X"}]
    if not tokenizer.has_chat_template:
        return tokenizer.encode(f"\nuser: {user}\nassistant:", add_special_tokens=False)
    before = tokenizer.apply_chat_template(first) + "Y"
    after = tokenizer.apply_chat_template(first + [{"role": "assistant", "content": "Y"},
                                                   {"role": "user", "content": user}])
    if not after.startswith(before):
        raise ValueError("this chat template does not render a conversation's earlier turns as a prefix of "
                         "its later ones; the multi-turn workload needs one that does (ChatML, Llama 3)")
    return tokenizer.encode(after[len(before):], add_special_tokens=False)


def chat_workload(tokenizer, n_conversations: int, n_turns: int, answer_tokens: int,
                  system: str | None = None, per_customer: bool = True) -> list[Turn]:
    """C conversations of T turns, interleaved by turn; each turn's cache point is its whole prompt.

    The system prompt is prefix-demo's support policy (~1,330 tokens) unless ``system`` is given. With
    ``per_customer`` it opens with a line naming the conversation's customer, so no two conversations
    share a block (every user brings their own context); without, all share the policy's blocks.
    Conversation c's k-th user message is prefix-demo's question c + k·C (cycled, numbered past the list),
    so all differ. Returns C·T turns: [c0 t0, c1 t0, ..., c0 t1, ...].
    """
    system = system_prompt() if system is None else system
    turns = []
    for t in range(n_turns):
        for c in range(n_conversations):
            own = f"The customer is {CUSTOMERS[c % len(CUSTOMERS)]} (account {c + 1:06d}).\n\n" + system \
                if per_customer else system
            user = question(c + t * n_conversations)
            ids = (chat_ids(tokenizer, [{"role": "system", "content": own}, {"role": "user", "content": user}])
                   if t == 0 else followup_ids(tokenizer, own, user))
            turns.append(Turn(ids, f"chat {c}", len(ids), answer_tokens))
    return turns


def document_workload(tokenizer, document_tokens: int, n_questions: int, fillers_per_question: int,
                      filler_tokens: int, answer_tokens: int, filler_answer_tokens: int = 4,
                      text: str | None = None) -> list[Turn]:
    """One document of about ``document_tokens`` tokens asked ``n_questions`` questions, with
    ``fillers_per_question`` other requests of about ``filler_tokens`` tokens after each question.

    The document is the text's first lines (whole lines, up to the token count); each question's cache
    point is the document's end (its tokens before the question). A filler sorts a seeded shuffle of the
    text's words: every filler differs from the first token of its list on. Fillers are not measured.
    Raises ValueError when the text is shorter than ``document_tokens``.
    """
    text = DOCUMENT.read_text() if text is None else text
    document = _first_lines(tokenizer, text, document_tokens)
    words, rng = text.split(), random.Random(0)
    turns = []
    for q in range(n_questions):
        head = chat_ids(tokenizer, [{"role": "user", "content": f"{document}\n\nQuestion: "}], False)
        ask = chat_ids(tokenizer, [{"role": "user", "content":
                                    f"{document}\n\nQuestion: {DOCUMENT_QUESTIONS[q % len(DOCUMENT_QUESTIONS)]}"}])
        shared = _common_prefix(head, ask)
        turns.append(Turn(ask, cache_point_tokens=shared, max_new_tokens=answer_tokens))
        for _ in range(fillers_per_question):
            rng.shuffle(words)
            turns.append(Turn(_filler(tokenizer, words, filler_tokens), max_new_tokens=filler_answer_tokens,
                              measured=False))
    return turns


def _filler(tokenizer, words: list[str], n_tokens: int) -> list[int]:
    """A "sort these words" request of about ``n_tokens`` tokens (the words cut to fit, then templated)."""
    overhead = len(chat_ids(tokenizer, [{"role": "user", "content": SORT_WORDS}]))
    cut = tokenizer.encode(" ".join(words), add_special_tokens=False)[: max(n_tokens - overhead, 1)]
    return chat_ids(tokenizer, [{"role": "user", "content": SORT_WORDS + tokenizer.decode(cut)}])


def _first_lines(tokenizer, text: str, n_tokens: int) -> str:
    lines, kept = text.splitlines(keepends=True), ""
    for line in lines:
        if len(tokenizer.encode(kept + line, add_special_tokens=False)) > n_tokens:
            return kept
        kept += line
    raise ValueError(f"the document has {len(tokenizer.encode(text, add_special_tokens=False))} tokens, fewer "
                     f"than --document-tokens {n_tokens}; give a smaller number")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# -- running one configuration ------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestResult:
    """One request as run: token counts (OpenAI's and Anthropic's usage fields) and its TTFT (ms)."""

    prompt_ids: tuple[int, ...]
    cached_tokens: int
    cache_write_tokens: int
    output_ids: tuple[int, ...]
    ttft_ms: float
    measured: bool


    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class RunResult:
    """One configuration over a whole workload."""

    config: str
    requests: list[RequestResult]
    wall_s: float
    tier_counts: dict

    @property
    def prefill_tokens(self) -> int:
        return sum(r.prompt_tokens - r.cached_tokens for r in self.requests)

    @property
    def output_tok_s(self) -> float:
        return sum(len(r.output_ids) for r in self.requests) / self.wall_s

    def ttft_ms(self, p: float) -> float:
        return percentile([r.ttft_ms for r in self.requests if r.measured], p)


def run_workload(engine: LLMEngine, turns: Sequence[Turn], config: str, cache_points: bool = True,
                 ttl_s: float = 300.0) -> RunResult:
    """Run the turns one at a time (each to its end before the next arrives), greedy; returns what each did.

    A conversation's next prompt is its previous prompt + the answer's tokens (an end-of-sequence token
    left out: the template's follow-up closes the turn) + the turn's new ids.
    """
    history: dict[str, list[int]] = {}
    results = []
    start = time.perf_counter()
    for turn in turns:
        prior = history.get(turn.conversation, []) if turn.conversation else []
        prompt = prior + list(turn.new_ids)
        point = (CachePoint(len(prior) + turn.cache_point_tokens, ttl_s)
                 if cache_points and turn.cache_point_tokens else None)
        request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=turn.max_new_tokens),
                                        cache_point=point)
        out = _run_one(engine)
        request = engine.requests[request_id]
        answer = [t for t in out.token_ids if t not in engine.eos_token_ids]
        if turn.conversation:
            history[turn.conversation] = prompt + answer
        results.append(RequestResult(tuple(prompt), out.num_cached_tokens, out.num_cache_write_tokens,
                                     tuple(out.token_ids), (request.token_times_s[0] - request.arrival_s) * 1e3,
                                     turn.measured))
    counts = dict(engine.offload.counts) if engine.offload is not None else {}
    return RunResult(config, results, time.perf_counter() - start, counts)


def _run_one(engine: LLMEngine):
    while True:
        for out in engine.step():
            if out.finished:
                return out


def run_configs(model, turns: Sequence[Turn], num_blocks: int, block_size: int, host_memory: str,
                folder: Path, cache_points: bool = True) -> list[RunResult]:
    """The workload in the five configurations of :data:`CONFIGS`; the disk ones share ``folder``.
    ``cache_points``: the turns' cache points are sent (never in "no cache")."""
    results = []
    for config in CONFIGS:
        engine = LLMEngine(model, num_blocks=num_blocks, block_size=block_size,
                           enable_prefix_caching=config != "no cache",
                           kv_offload_memory=host_memory if "host" in config or "restart" in config else None,
                           kv_offload_dir=folder if "disk" in config or "restart" in config else None)
        results.append(run_workload(engine, turns, config, cache_points=cache_points and config != "no cache"))
        engine.close()
    return results


def distinct_blocks(result: RunResult, block_size: int) -> int:
    """Full blocks of the workload's prompts without repeats (by chained hash): what a pool must hold to
    keep all of it."""
    hashes = set()
    for r in result.requests:
        hashes.update(block_hashes(r.prompt_ids, block_size, b""))
    return len(hashes)


def differing_outputs(results: Sequence[RunResult]) -> list[str]:
    """The configurations whose outputs differ from the first's (greedy: there must be none)."""
    first = [r.output_ids for r in results[0].requests]
    return [res.config for res in results[1:] if [r.output_ids for r in res.requests] != first]


# -- the providers' bills ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prices:
    """An example price list, dollars a million input tokens, and the providers' cache multipliers.

    Attributes:
        input_per_mtok: the base input price (an example: $3.00, Claude Sonnet's list price in 2025).
        openai_cached: OpenAI's cached-input price over its input price (0.5: GPT-4o, $1.25 vs $2.50).
        anthropic_read: Anthropic's cache read multiplier (0.1x base input).
        anthropic_write: Anthropic's cache write multiplier by lifetime ("5m": 1.25x, "1h": 2x).
    """

    input_per_mtok: float = 3.00
    openai_cached: float = 0.5
    anthropic_read: float = 0.1
    anthropic_write: tuple[tuple[str, float], ...] = (("5m", 1.25), ("1h", 2.0))


def openai_cached_tokens(prompt_tokens: int, cached_tokens: int, min_tokens: int = 1024, increment: int = 128) -> int:
    """OpenAI's ``cached_tokens`` for a prompt whose longest cached prefix is ``cached_tokens`` long.

    OpenAI caches "the longest prefix of a prompt that has been previously computed, starting at 1,024 tokens
    and increasing in 128-token increments" (openai.com/index/api-prompt-caching): 0 below 1,024, else
    1,024 + a multiple of 128, never more than the cached prefix. openai_cached_tokens(2006, 1990) == 1920.
    """
    if prompt_tokens < min_tokens or cached_tokens < min_tokens:
        return 0
    return min_tokens + (cached_tokens - min_tokens) // increment * increment


def openai_input_usd(requests: Sequence[RequestResult], prices: Prices) -> float:
    """The input bill, dollars: OpenAI's cached tokens at ``openai_cached`` of the price, the rest at it."""
    total = 0.0
    for r in requests:
        cached = openai_cached_tokens(r.prompt_tokens, r.cached_tokens)
        total += (r.prompt_tokens - cached) + cached * prices.openai_cached
    return total * prices.input_per_mtok / 1e6


def anthropic_input_usd(requests: Sequence[RequestResult], prices: Prices, ttl: str = "5m") -> float:
    """The input bill, dollars: ``cache_read_input_tokens`` at 0.1x, ``cache_creation_input_tokens`` at 1.25x
    ("5m") or 2x ("1h"), the other input tokens at 1x. Raises ValueError for another ttl."""
    write = dict(prices.anthropic_write)
    if ttl not in write:
        raise ValueError(f"ttl must be one of {sorted(write)}, got {ttl!r}")
    total = 0.0
    for r in requests:
        plain = r.prompt_tokens - r.cached_tokens - r.cache_write_tokens
        total += plain + r.cached_tokens * prices.anthropic_read + r.cache_write_tokens * write[ttl]
    return total * prices.input_per_mtok / 1e6


# -- the side channel ------------------------------------------------------------------------------------


def side_channel(model, tokenizer, repetitions: int, salted: bool, context_tokens: int = 400,
                 block_size: int = 16) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """(TTFT ms, cached tokens) of an attacker's right guesses and of its wrong guesses.

    Each repetition, a victim sends a record with a fresh secret account number in its first block
    (then ``context_tokens`` of fixed text); the attacker then sends the same record with the right
    number and with a wrong one (in alternating order). With one shared cache the right guess hits the
    victim's blocks: a fast TTFT tells the attacker the guess was right (arXiv 2411.18191). With
    ``salted``, victim and attacker send different ``cache_salt`` values (vLLM's), so nothing is shared
    and both guesses are prefilled in full. The engine's pool holds everything: no eviction.
    """
    engine = LLMEngine(model, block_size=block_size, kv_cache_memory="256MiB")
    context = _first_lines(tokenizer, DOCUMENT.read_text(), context_tokens)
    rng = random.Random(1)
    right, wrong = [], []
    for r in range(repetitions):
        secret, other = (f"{rng.randrange(10**8):08d}" for _ in range(2))
        _ttft(engine, _record(tokenizer, secret, context), "victim" if salted else None)
        guesses = [(right, secret), (wrong, other)]
        for bucket, number in guesses if r % 2 == 0 else guesses[::-1]:
            bucket.append(_ttft(engine, _record(tokenizer, number, context), "attacker" if salted else None))
    return right, wrong


def _record(tokenizer, number: str, context: str) -> list[int]:
    system = f"Account {number}. Confidential: answer questions about this customer only."
    return chat_ids(tokenizer, [{"role": "system", "content": system},
                                {"role": "user", "content": f"{context}\n\nSummarise the text above."}])


def _ttft(engine: LLMEngine, prompt: list[int], cache_salt: str | None) -> tuple[float, int]:
    request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=1), cache_salt=cache_salt)
    out = _run_one(engine)
    request = engine.requests[request_id]
    return (request.token_times_s[0] - request.arrival_s) * 1e3, out.num_cached_tokens


# -- printing ----------------------------------------------------------------------------------------------


def results_table(results: Sequence[RunResult], prices: Prices) -> str:
    """The markdown table of one workload's five configurations."""
    lines = ["| configuration | prefill tokens | cached tokens | TTFT p50 ms | TTFT p99 ms | output tok/s | wall s "
             "| host / disk hits (blocks) | OpenAI input $ | Anthropic input $ (5m) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        hits = (f"{res.tier_counts['host_hits']} / {res.tier_counts['disk_hits']}" if res.tier_counts else "-")
        cached = sum(r.cached_tokens for r in res.requests)
        lines.append(f"| {res.config} | {res.prefill_tokens:,} | {cached:,} | {res.ttft_ms(50):,.0f} | "
                     f"{res.ttft_ms(99):,.0f} | {res.output_tok_s:.1f} | {res.wall_s:.1f} | {hits} | "
                     f"{openai_input_usd(res.requests, prices):.4f} | {anthropic_input_usd(res.requests, prices):.4f} |")
    return "\n".join(lines)


def bill_line(results: Sequence[RunResult], prices: Prices) -> str:
    """'This workload's bill' from the no-cache run and the pool + host + disk run's token counts."""
    plain, cached = results[0].requests, next(r for r in results if r.config == "pool + host + disk").requests
    uncached = sum(r.prompt_tokens for r in plain) * prices.input_per_mtok / 1e6
    return (f"this workload's input bill at ${prices.input_per_mtok:.2f} a million input tokens: "
            f"${uncached:.4f} uncached; with caching (pool + host + disk's counts) OpenAI ${openai_input_usd(cached, prices):.4f}"
            f" (cached input at {prices.openai_cached:g}x), Anthropic ${anthropic_input_usd(cached, prices):.4f} "
            f"(5-minute writes) / ${anthropic_input_usd(cached, prices, '1h'):.4f} (1-hour writes)")


def loadavg() -> str:
    return open("/proc/loadavg").read().strip()


def report(name: str, turns: Sequence[Turn], model, args, folder: Path, prices: Prices) -> None:
    """Run one workload's five configurations and print its table, bill and checks."""
    results = run_configs(model, turns, args.num_blocks, args.block_size, args.host_memory, folder,
                          not args.no_cache_points)
    per_block = LLMEngine(model, num_blocks=1, block_size=args.block_size).cache.bytes_per_block
    n_blocks = distinct_blocks(results[0], args.block_size)
    measured = sum(r.measured for r in results[0].requests)
    print(f"\n## {name}: {len(turns)} requests ({measured} measured), "
          f"{sum(r.prompt_tokens for r in results[0].requests):,} prompt tokens, {n_blocks} distinct full blocks "
          f"({n_blocks * per_block / 1e6:.0f} MB); pool {args.num_blocks} blocks ({args.num_blocks * per_block / 1e6:.0f} MB), "
          f"host tier {args.host_memory}, disk tier unbounded, "
          f"{'no cache points' if args.no_cache_points else 'cache points (5 minutes)'}\n")
    print(results_table(results, prices))
    differ = differing_outputs(results)
    print("\ngreedy outputs: " + (f"identical in all {len(results)} configurations ({len(turns)} requests each)"
                                 if not differ else f"DIFFERENT from no cache in {differ}"))
    print(bill_line(results, prices))
    if differ:
        raise SystemExit(1)


def warm_up(model, tokens: int) -> None:
    """One prefill of ``tokens`` tokens: the first pass over a long context pays one-time costs (buffers)."""
    LLMEngine(model, kv_cache_memory="256MiB").generate([list(range(1, tokens + 1))], SamplingParams(max_new_tokens=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=112, help="the KV pool (default 112 blocks, 1,792 tokens)")
    parser.add_argument("--host-memory", default="32MiB", help="the host tier (default 32MiB: 45 blocks)")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--shared-system-prompt", action="store_true",
                        help="the conversations share the system prompt (default: each opens with its customer)")
    parser.add_argument("--no-cache-points", action="store_true",
                        help="automatic caching only: no request marks a cache point (nothing is pinned)")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--document-tokens", type=int, default=1600)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--fillers", type=int, default=2, help="other requests after each question")
    parser.add_argument("--filler-tokens", type=int, default=600)
    parser.add_argument("--side-channel-reps", type=int, default=5)
    parser.add_argument("--price", type=float, default=3.00, help="example base input price, $ a million tokens")
    parser.add_argument("--openai-cached-price", type=float, default=0.5, help="cached over uncached input price")
    parser.add_argument("--workloads", nargs="+", default=["chat", "document", "side-channel"],
                        choices=["chat", "document", "side-channel"])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default torch's: one a core; on a busy machine 1 is faster)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"load before: {loadavg()} ({os.cpu_count()} cores), torch threads {torch.get_num_threads()}")
    model, tokenizer = minillm.load_model(args.model, device="cpu"), minillm.load_tokenizer(args.model)
    prices = Prices(args.price, args.openai_cached_price)
    warm_up(model, args.document_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        if "chat" in args.workloads:
            turns = chat_workload(tokenizer, args.conversations, args.turns, args.answer_tokens,
                                  per_customer=not args.shared_system_prompt)
            context = "one shared system prompt" if args.shared_system_prompt else "a system prompt each"
            report(f"multi-turn chat ({args.conversations} conversations x {args.turns} turns, {context})", turns,
                   model, args,
                   Path(tmp) / "chat", prices)
        if "document" in args.workloads:
            turns = document_workload(tokenizer, args.document_tokens, args.questions, args.fillers,
                                      args.filler_tokens, args.answer_tokens)
            report(f"shared document ({args.questions} questions, {args.fillers} fillers after each)", turns, model,
                   args, Path(tmp) / "document", prices)
    if "side-channel" in args.workloads:
        print_side_channel(model, tokenizer, args.side_channel_reps)
    print(f"\nload after: {loadavg()}")


def print_side_channel(model, tokenizer, repetitions: int) -> None:
    print(f"\n## the side channel ({repetitions} repetitions, medians)\n")
    for salted in (False, True):
        right, wrong = side_channel(model, tokenizer, repetitions, salted)
        r_ms, w_ms = statistics.median(t for t, _ in right), statistics.median(t for t, _ in wrong)
        label = "per-user cache_salt" if salted else "one shared cache  "
        print(f"{label}: right guess TTFT {r_ms:7.1f} ms (cached tokens {[c for _, c in right]}), wrong guess "
              f"{w_ms:7.1f} ms (cached {[c for _, c in wrong]}): gap {w_ms - r_ms:+.1f} ms")


if __name__ == "__main__":
    main()
