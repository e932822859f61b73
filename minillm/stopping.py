"""Stopping: when a request ends, why, and the text it shows until then.

One copy of the rules, used by :func:`~minillm.generate.generate`, speculative decoding
(minillm/speculative.py) and the serving engine (minillm/serving/engine.py). After each
sampled token the first rule that applies ends the request (vLLM's names):

    finish_reason  stop_reason  when
    "eos"          None         the token is an EOS id (unless params.ignore_eos)
    "stop"         the id       the token is one of params.stop_token_ids
    "length"       None         max_new_tokens tokens generated
    "cache_full"   None         no room left to decode the token (the engine calls it "length":
                                its limit is the model's context, as vLLM's max_model_len)
    "stop"         the string   the text now holds one of params.stop; checked on text, after
                                the token rules, and it wins over them (the text ends before it)

(The engine adds "abort", for :meth:`~minillm.serving.engine.LLMEngine.abort_request`.)

Stop strings are matched on text that arrives in pieces (one per token, from
:class:`StreamDecoder`), and a stop string can be split across pieces.
:class:`StopStringMatcher` holds back the longest end of the text that is the start of some
stop string, so the text shown never holds one:

    stop = ["\\n\\nUser:"]
    push("Paris.")      -> "Paris."      nothing could start the stop string
    push("\\n")          -> ""            "\\n" could: held back
    push("\\nUser")      -> ""            "\\n\\nUser" still could
    push(":")           -> "" , matched  the stop string itself is never emitted

As vLLM with ``include_stop_str_in_output=False``: generation stops at the first piece
after which the text holds a whole stop string, and the output ends just before the
earliest stop string in that text (a longer one still incomplete then never completes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .sampling import SamplingParams

_REPLACEMENT = "\ufffd"  # what a UTF-8 decoder emits for an incomplete or invalid byte sequence


@dataclass(frozen=True)
class GenerationStep:
    """One generated token, as :func:`~minillm.generate.generate` yields it.

    Attributes:
        token_id: the token.
        logprob: its log-probability under the model (natural log).
        phase: "prefill" for the first token (from the prompt's logits), "decode" after.
        cache_length: positions in the KV cache after the forward pass that produced it.
        time_s: ``time.perf_counter()`` when the token was known (seconds).
        finish_reason: None while generating; on the last step "eos", "stop"
            (a stop id or a stop string), "length" (max_new_tokens) or "cache_full".
        cached_tokens: prompt tokens whose K/V came from the prefix cache (0 without
            one); the same on every step of a request.
        prefill_tokens: prompt tokens the prefill computed (the prompt minus cached_tokens).
        text: with a tokenizer, the text this step adds to the answer: "" while a character
            is incomplete or the text could be the start of a stop string (held back, then
            released by a later step); a matched stop string and what follows are never
            included. The steps' texts joined are the answer. None without a tokenizer.
        stop_reason: the stop string or stop id that ended generation (vLLM's name), else None.
        proposed, accepted: with ``speculative=``, on the first token of each verification pass:
            the draft tokens it checked and how many the model accepted (its later tokens carry
            None, so sums over the steps are the request's totals); None without speculation.
            (``cache_length`` is then the length plain decoding would have at that token.)
    """

    token_id: int
    logprob: float
    phase: str
    cache_length: int
    time_s: float
    finish_reason: str | None = None
    cached_tokens: int = 0
    prefill_tokens: int = 0
    text: str | None = None
    stop_reason: int | str | None = None
    proposed: int | None = None
    accepted: int | None = None


def finish_reason(token_id: int, n_generated: int, eos: set[int], params: SamplingParams,
                  cache_full: bool) -> tuple[str | None, int | None]:
    """The token rules of the table above: (finish_reason, stop_reason) after ``token_id``.

    ``n_generated`` counts ``token_id``; ``cache_full``: no room is left to decode this token.
    Returns (None, None) to go on. Stop strings are :func:`check_stop`'s (they need the text).
    """
    if token_id in eos and not params.ignore_eos:
        return "eos", None
    if token_id in params.stop_token_ids:
        return "stop", token_id
    if n_generated >= params.max_new_tokens:
        return "length", None
    if cache_full:
        return "cache_full", None
    return None, None


def check_stop(token_id: int, n_generated: int, eos: set[int], params: SamplingParams, cache_full: bool,
               text: TextStream | None) -> tuple[str | None, int | str | None, str | None]:
    """Every rule of the table, after one sampled token: (finish_reason, stop_reason, piece).

    :func:`finish_reason` first; then, with a :class:`TextStream`, the token's text is pushed
    (all of it released if a token rule ended the request) and a stop string found in it
    makes the reason "stop", its stop_reason the string. ``piece``: the text this token adds
    (None without ``text``). What generate, speculative decoding and the engine call per token.
    """
    reason, stop_reason = finish_reason(token_id, n_generated, eos, params, cache_full)
    if text is None:
        return reason, stop_reason, None
    piece = text.push(token_id, last=reason is not None)
    if text.matched is not None:
        reason, stop_reason = "stop", text.matched
    return reason, stop_reason, piece


class StreamDecoder:
    """Turns token ids into text one token at a time, never splitting a character.

    One character can span several tokens (an emoji is 4 UTF-8 bytes, often 2-4
    byte-level tokens), so text is held back while it ends in U+FFFD. A byte-fallback
    tokenizer (``<0xE6><0x97><0xA5>`` for "日") is also held back while the last token
    shown is a byte token: its decoder turns a whole run of byte tokens into text at once,
    and one invalid byte makes every byte of the run U+FFFD (``tokenizers``' ByteFallback,
    as transformers decodes), so a run's text is known only once a non-byte token ends it.

    Each push decodes only a short window (the vLLM / TGI "prefix offset, read offset" scheme),
    so a token costs O(1) amortised instead of re-decoding the whole sequence:

        ids:  t0 t1 t2 t3 | t4 t5 | t6 t7
                          ^prefix  ^read
        prefix text = decode(t4 t5)          already emitted; context for the next piece
        new text    = decode(t4 t5 t6 t7)    emit new_text[len(prefix_text):] if complete

    The context token(s) matter for decoders (SentencePiece) that drop a leading
    space at the start of a decode. Concatenating every push() and flush() equals
    ``tokenizer.decode(all_ids, skip_special_tokens)``. ``tokenizer``: a
    :class:`~minillm.tokenizer.Tokenizer` (``decode``, ``check_ids``, ``special_ids``,
    ``byte_fallback_ids``).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def __repr__(self) -> str:
        offsets = f"prefix_offset={self.prefix_offset}, read_offset={self.read_offset}"
        return f"StreamDecoder(tokens={len(self.ids)}, {offsets})"

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is still partial).

        Raises ValueError (and keeps its state) for an id that is not an integer in the vocabulary.
        """
        self.ids.extend(self.tokenizer.check_ids([token_id]))
        prefix_text, new_text = self._window_texts()
        held = new_text.endswith(_REPLACEMENT) or self._in_byte_run()
        if len(new_text) <= len(prefix_text) or held:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def _in_byte_run(self) -> bool:
        """Whether the last token that shows in the text is a byte-fallback token. Skipped special
        tokens do not end a run: decode drops them before it joins the byte tokens."""
        hidden = self.tokenizer.special_ids if self.skip_special_tokens else frozenset()
        last_shown = next((i for i in reversed(self.ids) if i not in hidden), None)
        return last_shown in self.tokenizer.byte_fallback_ids

    def flush(self) -> str:
        """Return whatever is held back (U+FFFD if the ids really end mid-character)."""
        prefix_text, new_text = self._window_texts()
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    def _window_texts(self) -> tuple[str, str]:
        window = self.ids[self.prefix_offset :]
        emitted = self.read_offset - self.prefix_offset
        decode = lambda ids: self.tokenizer.decode(ids, self.skip_special_tokens)  # noqa: E731
        return decode(window[:emitted]), decode(window)


class TextStream:
    """Token ids -> the text each adds: UTF-8-safe streaming decode, then stop-string hold-back.

    Attributes:
        decoder: the :class:`StreamDecoder` (never splits a character).
        stop: the :class:`StopStringMatcher` over ``params.stop``.
        text: the text released so far (the answer, without its stop string).
        time_s: seconds spent decoding and matching (a trace's "detokenize" event).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = StopStringMatcher(stop)
        self.text = ""
        self.time_s = 0.0

    def __repr__(self) -> str:
        return f"TextStream(text={self.text!r}, held={self.stop.held!r}, matched={self.matched!r})"

    @property
    def matched(self) -> str | None:
        """The stop string found, or None."""
        return self.stop.matched

    def push(self, token_id: int, last: bool) -> str:
        """The text ``token_id`` releases; ``last``: generation ends here, so release everything."""
        start = time.perf_counter()
        piece = self.stop.push(self.decoder.push(token_id))
        if last and self.matched is None:
            piece += self.stop.push(self.decoder.flush())
        if last and self.matched is None:
            piece += self.stop.flush()
        self.text += piece
        self.time_s += time.perf_counter() - start
        return piece


class StopStringMatcher:
    """Finds the first stop string in text that arrives piece by piece.

    Attributes:
        stop: the stop strings (non-empty).
        held: text received but not emitted yet (a possible start of a stop string).
        matched: the stop string found, or None.
    """

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(stop)
        self.held = ""
        self.matched: str | None = None

    def __repr__(self) -> str:
        return f"StopStringMatcher(stop={self.stop!r}, held={self.held!r}, matched={self.matched!r})"

    def push(self, piece: str) -> str:
        """Add ``piece``; return the text now safe to show (never part of a stop string).

        Once a stop string is found, ``matched`` is set, the text before it is returned,
        and everything after it is dropped.
        """
        if self.matched is not None:
            return ""
        text = self.held + piece
        hits = [(text.find(s), n, s) for n, s in enumerate(self.stop) if s in text]
        if hits:
            start, _, self.matched = min(hits)  # the earliest; on a tie, the first listed
            self.held = ""
            return text[:start]
        keep = self._longest_partial_match(text)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held text, at the end of generation (no stop string can complete any more)."""
        held, self.held = self.held, ""
        return held

    def _longest_partial_match(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a proper start of a stop string.

        Each stop string s is tried from the longest candidate down: the places in the last
        len(s) - 1 characters where s's first character occurs (``str.find`` jumps between them),
        stopping at the first whose rest starts s. Per token that is about len(s) steps, not the
        len(s)² of comparing every prefix of s (a 1 MB stop string stalled a server's every step)."""
        longest = 0
        for s in self.stop:
            tail = text[len(text) - min(len(s) - 1, len(text)) :]
            start = tail.find(s[0])
            while start != -1 and len(tail) - start > longest:
                if s.startswith(tail[start:]):
                    longest = len(tail) - start
                    break
                start = tail.find(s[0], start + 1)
        return longest
