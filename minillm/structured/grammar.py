"""A grammar as an allowed-token mask, step by step: llguidance behind minillm's sampling hook.

Constrained decoding in one picture (a JSON schema with one enum field)::

    output so far            the grammar allows next          mask over 49,152 ids
    (nothing)                '{'                               1 allowed
    {"colour": "             'red' 'green' 'blue' 'r' 'gr'...  a handful
    {"colour": "green"       '}'                               1
    {"colour": "green"}      EOS                               1 -> the answer parses

The library (llguidance, microsoft/llguidance) compiles the grammar against the tokenizer's
vocabulary and, before each token, fills a bitmask: bit i of the mask says whether token i's
bytes can extend the text so far to something the grammar still accepts. :class:`Grammar` is the
compiled constraint (shared, :class:`~minillm.sampling.AllowedTokens`); :class:`GrammarMatcher`
is one sequence's position in it (:class:`~minillm.sampling.TokenMatcher`): ``allowed()`` is the
unpacked bitmask, ``accept(token)`` moves on. minillm.sampling sets the other logits to -inf.

Why llguidance (benchmarks/structured_mask_cost.py, in BENCHMARKS-HISTORY.md): its mask costs
tens of microseconds per token on SmolLM2's vocabulary, far below a decode step; it reads tokenizer.json
directly; and the wheel has no dependencies (xgrammar, as fast, pulls in triton: about 1 GB).
"""

from __future__ import annotations

import json
import re
import weakref

import torch

try:
    import llguidance
    import llguidance.torch as llguidance_torch
except ImportError:  # an optional extra: pip install 'minillm[structured]'
    llguidance = None

_BITS = 2 ** torch.arange(32, dtype=torch.int64)
_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # minillm Tokenizer -> {key: LLTokenizer}


class Grammar:
    """A compiled constraint: a JSON schema, a regex, a list of choices or a Lark grammar, on one
    tokenizer's vocabulary. Build it with :meth:`json_schema`, :meth:`regex`, :meth:`choice` or
    :meth:`lark`; pass it as ``SamplingParams(allowed_tokens=grammar)``.

    Args (of every constructor):
        tokenizer: the model's :class:`~minillm.tokenizer.Tokenizer`.
        vocab_size: the model's vocabulary (its logits' width; default the tokenizer's).
        eos_token_ids: the ids that end generation: the grammar allows them once it is complete
            (default the tokenizer's EOS ids; give the model's when they differ).

    Attributes: kind ("json_schema", "regex", "choice", "lark"), source (what was compiled).
    Raises ValueError for a grammar llguidance cannot compile, ImportError without llguidance.
    """

    def __init__(self, kind: str, source, grammar: str, tokenizer, vocab_size: int | None = None,
                 eos_token_ids=None):
        if llguidance is None:
            raise ImportError("structured output needs llguidance: pip install 'minillm[structured]' "
                              "(or pip install llguidance)")
        self.kind, self.source = kind, source
        self.vocab_size = vocab_size or tokenizer.vocab_size
        eos = sorted(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)
        if not eos:
            raise ValueError("the grammar needs the EOS ids (allowed once it is complete); give eos_token_ids")
        self.eos_token_ids = tuple(eos)
        self._tokenizer = _ll_tokenizer(tokenizer, self.vocab_size, self.eos_token_ids)
        self._grammar = grammar
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise ValueError(f"cannot compile the {kind.replace('_', ' ')}: {_one_line(messages)}")

    @classmethod
    def json_schema(cls, schema: dict | str, tokenizer, *, any_whitespace: bool = True, **kwargs) -> Grammar:
        """Outputs that parse as JSON and validate against ``schema`` (a dict or its JSON text).
        ``{"type": "object"}`` is any JSON object (OpenAI's ``json_object``). ``any_whitespace``:
        False allows no whitespace between tokens, ``{"a":1,"b":2}`` (vLLM's ``disable_any_whitespace``)."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            json.loads(text)
            options = None if any_whitespace else {"whitespace_flexible": False}
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=options) if llguidance else text
        except (ValueError, TypeError) as e:
            raise ValueError(f"not a usable JSON schema: {e}") from None
        return cls("json_schema", schema, grammar, tokenizer, **kwargs)

    @classmethod
    def regex(cls, pattern: str, tokenizer, **kwargs) -> Grammar:
        """Outputs that match ``pattern`` in full (Rust regex syntax, as vLLM's backends)."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"a regex must be a non-empty string, got {pattern!r:.60}")
        grammar = llguidance.LLMatcher.grammar_from_regex(pattern) if llguidance else pattern
        return cls("regex", pattern, grammar, tokenizer, **kwargs)

    @classmethod
    def choice(cls, choices, tokenizer, **kwargs) -> Grammar:
        """Outputs that are exactly one of ``choices`` (strings): a regex of the escaped alternatives."""
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choices must be a list of non-empty strings, got {choices!r:.80}")
        pattern = "|".join("".join(ch if ch.isalnum() else f"\\x{{{ord(ch):x}}}" for ch in c) for c in choices)
        grammar = llguidance.LLMatcher.grammar_from_regex(f"({pattern})") if llguidance else pattern
        return cls("choice", list(choices), grammar, tokenizer, **kwargs)

    @classmethod
    def lark(cls, text: str, tokenizer, **kwargs) -> Grammar:
        """Outputs of a Lark grammar (llguidance's dialect; a GBNF grammar, with ``::=``, is converted)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a grammar must be non-empty text")
        if "::=" in text and llguidance:
            text = llguidance.gbnf_to_lark(text)
        grammar = llguidance.LLMatcher.grammar_from_lark(text) if llguidance else text
        return cls("lark", text, grammar, tokenizer, **kwargs)

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the output (one per sequence)."""
        return GrammarMatcher(self)

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, {json.dumps(self.source)[:60]}, vocab={self.vocab_size})"


class GrammarMatcher:
    """One sequence's position in a :class:`Grammar`: which tokens may come next; told each token."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._matcher = llguidance.LLMatcher(grammar._tokenizer, grammar._grammar, log_level=0)  # errors: raised here
        self._bitmask = llguidance_torch.allocate_token_bitmask(1, grammar.vocab_size)  # int32 [1, ceil(V / 32)]
        self.num_accepted = 0

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: True for each token the grammar accepts next (EOS once it is complete)."""
        if self._matcher.is_error():
            raise ValueError(f"the grammar matcher failed: {self._matcher.get_error()}")
        llguidance_torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        return unpack_bitmask(self._bitmask[0], self.grammar.vocab_size)

    def accept(self, token_id: int) -> None:
        """Move past ``token_id``; ValueError if the grammar does not allow it (a bug: sampling masks it)."""
        if not self._matcher.consume_token(int(token_id)):
            raise ValueError(f"token {token_id} is not allowed here by the {self.grammar.kind.replace('_', ' ')} "
                             f"(after {self.num_accepted} tokens): {_one_line([self._matcher.get_error()])}")
        self.num_accepted += 1

    @property
    def is_complete(self) -> bool:
        """True when the output so far is a whole match (EOS would be allowed, or was taken)."""
        return self._matcher.is_accepting() or self._matcher.is_stopped()


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A packed int32 bitmask (bit j of word w: token 32 w + j) as a bool tensor [vocab_size]."""
    return ((words.to(torch.int64)[:, None] & _BITS) != 0).reshape(-1)[:vocab_size]


def _one_line(messages) -> str:
    """llguidance's messages on one line: the caret diagrams and the echoed source lines left out."""
    lines = [line.strip() for message in messages for line in str(message).splitlines()]
    return " ".join(line for line in lines if line and set(line) != {"^"} and not re.match(r"\d+ \|", line))


def _ll_tokenizer(tokenizer, vocab_size: int, eos: tuple[int, ...]):
    """llguidance's view of the vocabulary (built from tokenizer.json once per tokenizer, vocab and EOS ids)."""
    per_tokenizer = _LL_TOKENIZERS.setdefault(tokenizer, {})
    key = (vocab_size, eos)
    if key not in per_tokenizer:
        per_tokenizer[key] = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                    eos_token=list(eos))
    return per_tokenizer[key]
