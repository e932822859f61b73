"""A multi-turn chat that keeps its KV cache between turns: only each new turn is prefilled.

Every turn renders the whole conversation with the model's chat template, as a
stateless server would, then compares it with the token ids the KV cache already
holds. The longest common prefix is reused; the cache is truncated there and only
the rest is prefilled (prompt caching, as in vLLM's automatic prefix caching, but
for one conversation and at token rather than block granularity)::

    cache holds   [ system | user 1 | assistant 1 ]                 (turn 1's prompt + answer)
    turn 2 needs  [ system | user 1 | assistant 1 <|im_end|> | user 2 | assistant header ]
                  |<------------- reused: no compute ------------->|<--- prefilled --->|

The cache never holds the last token of an answer (it was sampled, not fed back),
and re-tokenising an answer's text may differ from the sampled ids, so the reused
part is computed, not assumed. At least one token is always prefilled: the logits
of the last prompt position are needed to pick the first answer token.

With a block store (``kv_store``, anything with ``get(hash)`` and ``put(hash, k, v)``:
``minillm chat --kv-offload-dir DIR`` passes the serving engine's disk tier) the cache
outlives the process too. After each turn the full blocks of what the cache holds are
put there, named by their chained hashes (:mod:`minillm.block_hash`, the names the
prefix cache and the engine use); :meth:`ChatSession.resume` reads a saved conversation
back and gets its blocks, so the first turn after a restart prefills only the new message::

    process 1, turn n   cache [ b0 | b1 | b2 | b3 | .. ]  ──put──>  store: h0 h1 h2 h3
    process 2, resume   store: h0 h1 h2 h3  ──get──>  cache [ b0 | b1 | b2 | b3 ]   (no compute)
                        (up to the first block the store lacks: h_i names all tokens before it)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .block_hash import block_hashes, model_seed
from .errors import CacheFullError
from .generate import GenerationStep, generate
from .kv_cache import KVCache
from .sampling import SamplingParams

DEFAULT_MAX_CONTEXT = 2048  # positions of the chat's KV cache unless asked otherwise (~90 MiB for SmolLM2 in float32)
BLOCK_SIZE = 16  # positions per block put in a kv_store: the serving engine's default block size


@dataclass(frozen=True)
class ChatTurn:
    """What one turn cost and produced.

    Attributes:
        prompt_tokens: tokens of the rendered conversation the answer was generated from.
        reused_tokens: of those, the ones whose K/V the cache already held (no compute).
        prefill_tokens: the ones this turn's prefill computed (prompt_tokens - reused_tokens).
        token_ids: the generated ids (the EOS included, when the answer ended with it).
        text: the answer's text (special tokens and a matched stop string left out), as
            appended to the history.
        finish_reason: "eos", "stop", "length" or "cache_full" (see :class:`GenerationStep`).
        dropped_messages: old messages dropped before this turn so the prompt and
            ``max_new_tokens`` fit in the context (0 normally).
        ttft_ms: time from the start of the turn (rendering included) to the first token, ms.
        start_s, end_s: ``time.perf_counter()`` at the start of the turn and at its last token.
    """

    prompt_tokens: int
    reused_tokens: int
    prefill_tokens: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    dropped_messages: int
    ttft_ms: float
    start_s: float
    end_s: float


def common_prefix_len(a, b) -> int:
    """Length of the longest common prefix of two token id sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatSession:
    """A conversation: its messages, one KV cache, and the token ids that cache holds.

    Args:
        model: the transformer. tokenizer: a :class:`~minillm.tokenizer.Tokenizer` with a chat template.
        system: optional system message (the first message of the conversation).
        params: sampling and stopping per answer (default: the checkpoint's generation_config.json
            defaults, else greedy with 256 tokens). Stop strings (``params.stop``) end an answer
            and are left out of its text, as in :func:`~minillm.generate.generate`.
        max_context: positions of the KV cache, the conversation's whole budget (prompt
            and answers); default min(model context, 2048). When a turn's prompt plus
            ``params.max_new_tokens`` does not fit, the oldest user/assistant messages are
            dropped (the system message stays), and the turn reports how many.
        chat_template_kwargs: extra chat template variables for every turn, e.g.
            ``{"enable_thinking": False}`` (Qwen3 then answers without its <think> reasoning).
        kv_store: where the cache's full blocks go after each turn and come back from on
            :meth:`resume`: ``get(block_hash) -> (k, v) | None`` and ``put(block_hash, k, v)``,
            k and v each ``[n_layers, BLOCK_SIZE, n_kv_heads, head_dim]`` in the model's dtype
            (a block of the paged pool); None: the cache lives as long as the session.

    Attributes:
        messages: ``[{"role", "content"}, ...]``, the conversation so far.
        cache: the :class:`KVCache`. cache_ids: the ids whose K/V it holds, ``len == cache.length``.
        last_turn: the :class:`ChatTurn` of the last finished turn, or None.
        kv_store: the block store, or None.

    Raises ValueError when the tokenizer has no chat template or max_context is out of range.
    """

    def __init__(self, model, tokenizer, system: str | None = None, params: SamplingParams | None = None,
                 max_context: int | None = None, chat_template_kwargs: dict | None = None, kv_store=None):
        if not tokenizer.has_chat_template:
            raise ValueError("this model has no chat template, so it cannot chat; use `minillm generate` instead")
        self.model = model
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        gen = getattr(model, "generation_config", None)  # load_model's: generation_config.json's stop ids, defaults
        self.params = params or (gen.sampling_params() if gen else SamplingParams())
        self.eos_token_ids = set(tokenizer.eos_token_ids) | set((gen or model.config).eos_token_ids)
        if max_context is None:
            max_context = min(model.config.max_seq_len, DEFAULT_MAX_CONTEXT)
        if not 1 <= max_context <= model.config.max_seq_len:
            raise ValueError(f"max_context must be in [1, {model.config.max_seq_len}] (the model's context), "
                             f"got {max_context}")
        self.cache = KVCache.for_model(model, max_seq_len=max_context)
        self.cache_ids: list[int] = []
        self.messages: list[dict] = []
        self.last_turn: ChatTurn | None = None
        self.kv_store = kv_store
        self._seed = model_seed(model) if kv_store is not None else None  # the root of the block hash chain
        self._stored: set[bytes] = set()  # blocks this session put in (or got from) kv_store
        self.set_system(system)

    def __repr__(self) -> str:
        return (f"ChatSession(messages={len(self.messages)}, cache_ids={len(self.cache_ids)}, "
                f"max_context={self.cache.max_seq_len})")

    @property
    def max_context(self) -> int:
        return self.cache.max_seq_len

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and empty the KV cache."""
        self.messages = self.messages[:1] if self._has_system() else []
        self.cache.reset()
        self.cache_ids = []
        self.last_turn = None

    def set_system(self, system: str | None) -> None:
        """Set (or with None remove) the system message; the rest of the conversation stays.

        An empty string is sent as an empty system message, as ``generate --system ""`` does:
        many templates insert a default persona only when there is no system message at all.

        The next turn reuses the cache only up to the first token where the old and new
        system messages differ, so it prefills nearly the whole conversation again.
        """
        if self._has_system():
            self.messages = self.messages[1:]
        if system is not None:
            self.messages = [{"role": "system", "content": system}] + self.messages

    def prompt_ids(self, messages: list[dict] | None = None, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` (default: the conversation) rendered with the chat
        template and the assistant header: what the model sees before answering
        (``add_generation_prompt=False``: without the header, the conversation as it stands)."""
        text = self.tokenizer.apply_chat_template(self.messages if messages is None else messages,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **self.chat_template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def send(self, text: str, trace=None) -> Iterator[GenerationStep]:
        """Add a user message and generate the answer, yielding one step per token.

        The answer is appended to :attr:`messages` and :attr:`last_turn` is set once the
        generator finishes. Closed early (the user pressed Ctrl-C), the conversation is
        left as it was; the cache keeps what it computed, reusable by the next turn.
        ``trace``: an optional :class:`~minillm.trace.Trace` for this turn's request.

        Raises ValueError for an empty message, CacheFullError when the message alone
        does not fit in the context.
        """
        if not text.strip():
            raise ValueError("the message is empty; type some text")
        start = time.perf_counter()
        messages, dropped = self._fit(self.messages + [{"role": "user", "content": text}])
        prompt = self.prompt_ids(messages)
        reused = min(common_prefix_len(self.cache_ids, prompt), len(prompt) - 1)
        self.cache.truncate(reused)
        generated: list[int] = []
        pieces: list[str] = []
        first_s = None
        try:
            for step in generate(self.model, prompt[reused:], self.params, cache=self.cache,
                                 eos_token_ids=self.eos_token_ids, trace=trace, tokenizer=self.tokenizer):
                generated.append(step.token_id)
                pieces.append(step.text)
                first_s = first_s or step.time_s
                yield step
        finally:  # the cache holds the prompt and every generated token fed back so far
            self.cache_ids = (prompt + generated)[: self.cache.length]
        answer = "".join(pieces)  # the answer's text, special tokens and a matched stop string left out
        self.messages = messages + [{"role": "assistant", "content": answer}]
        self.last_turn = ChatTurn(len(prompt), reused, len(prompt) - reused, tuple(generated), answer,
                                  step.finish_reason, dropped, (first_s - start) * 1e3, start, step.time_s)
        self._put_blocks()

    # -- a conversation that outlives the process ----------------------------------------

    def save(self, path) -> None:
        """Write the conversation to ``path`` as JSON (``{"messages": [...]}``), atomically: a temporary
        file, then ``os.replace``, so a crash mid-write leaves the previous save, never half a file."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"messages": self.messages}, ensure_ascii=False, indent=1))
        os.replace(tmp, path)

    def resume(self, path) -> int:
        """Continue the conversation saved at ``path`` (:meth:`save`): its messages replace this one's,
        and the K/V of its blocks that ``kv_store`` holds is loaded into the emptied cache, from the
        first block on, up to the first block it lacks. Returns the tokens loaded (0 without a store);
        the next turn reuses them (:attr:`ChatTurn.reused_tokens`) as if this process had computed them.

        Raises ValueError (naming the file) when ``path`` holds no saved conversation.
        """
        self.reset()
        self.messages = _read_messages(path)
        if self.kv_store is None or not self.messages:
            return 0
        ids = self.prompt_ids(add_generation_prompt=False)[: self.max_context]
        for i, block_hash in enumerate(block_hashes(ids, BLOCK_SIZE, self._seed)):
            block = self.kv_store.get(block_hash)
            if block is None:
                break
            positions = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
            # stored: [n_layers, BLOCK_SIZE, n_kv_heads, head_dim]; the cache: [n_layers, 1, n_kv_heads, T, head_dim]
            for cached, stored in zip((self.cache.k, self.cache.v), block):
                cached[:, 0, :, positions] = stored.transpose(1, 2)
            self.cache.advance(BLOCK_SIZE)
            self._stored.add(block_hash)
        self.cache_ids = ids[: self.cache.length]
        return self.cache.length

    def _put_blocks(self) -> None:
        """Put the cache's full blocks that ``kv_store`` does not have from this session yet."""
        if self.kv_store is None:
            return
        for i, block_hash in enumerate(block_hashes(self.cache_ids, BLOCK_SIZE, self._seed)):
            if block_hash not in self._stored:
                positions = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
                k, v = (kv[:, 0, :, positions].transpose(1, 2).to("cpu", memory_format=torch.contiguous_format,
                                                                         copy=True)
                        for kv in (self.cache.k, self.cache.v))
                self.kv_store.put(block_hash, k, v)
                self._stored.add(block_hash)

    def _has_system(self) -> bool:
        return bool(self.messages) and self.messages[0]["role"] == "system"

    def _fit(self, messages: list[dict]) -> tuple[list[dict], int]:
        """Drop the oldest user/assistant pairs until prompt + max_new_tokens fits; (messages, dropped).

        The messages after the system message alternate user, assistant, ..., user (an
        interrupted turn adds neither), so dropping two at a time keeps a user first.
        """
        keep = 1 if messages[0]["role"] == "system" else 0
        dropped = 0
        while len(self.prompt_ids(messages)) + self.params.max_new_tokens > self.max_context:
            if len(messages) - keep <= 1:  # only the new message is left
                break
            messages = messages[:keep] + messages[keep + 2:]
            dropped += 2
        n = len(self.prompt_ids(messages))
        if n >= self.max_context:
            raise CacheFullError(
                f"this message makes a {n}-token prompt but the chat's context is {self.max_context} tokens; "
                "send a shorter message or use a larger max_context (--max-context)"
            )
        return messages, dropped


def _read_messages(path) -> list[dict]:
    """The messages of a conversation :meth:`ChatSession.save` wrote; ValueError naming ``path`` otherwise."""
    try:
        messages = json.loads(Path(path).read_text())["messages"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} holds no saved conversation ({type(error).__name__}: {error}); "
                         "remove it, or start fresh in another folder") from None
    if not (isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                and isinstance(m.get("content"), str) for m in messages)):
        raise ValueError(f"{path} holds no saved conversation (its messages are not role/content pairs); "
                         "remove it, or start fresh in another folder")
    return messages
