"""Stop strings on streamed text: emit what is safe, hold back what could start a stop string.

Text arrives in pieces (one per token, from :class:`~minillm.tokenizer.StreamDecoder`),
and a stop string can be split across pieces. The matcher holds back the longest end
of the text that is the start of some stop string, so the emitted text never shows one:

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
        """Length of the longest end of ``text`` that is a proper start of a stop string."""
        return max((n for s in self.stop for n in range(1, min(len(s), len(text) + 1))
                    if text.endswith(s[:n])), default=0)
