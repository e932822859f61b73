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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from .errors import CacheFullError
from .generate import GenerationStep, generate
from .kv_cache import KVCache
from .sampling import SamplingParams

DEFAULT_MAX_CONTEXT = 2048  # positions of the chat's KV cache unless asked otherwise (~90 MiB for SmolLM2 in float32)


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

    Attributes:
        messages: ``[{"role", "content"}, ...]``, the conversation so far.
        cache: the :class:`KVCache`. cache_ids: the ids whose K/V it holds, ``len == cache.length``.
        last_turn: the :class:`ChatTurn` of the last finished turn, or None.

    Raises ValueError when the tokenizer has no chat template or max_context is out of range.
    """

    def __init__(self, model, tokenizer, system: str | None = None, params: SamplingParams | None = None,
                 max_context: int | None = None, chat_template_kwargs: dict | None = None):
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

    def prompt_ids(self, messages: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` (default: the conversation) rendered with the chat
        template and the assistant header: what the model sees before answering."""
        text = self.tokenizer.apply_chat_template(self.messages if messages is None else messages,
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
