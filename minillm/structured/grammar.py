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

Admission: a constraint that cannot work is refused when the :class:`Grammar` is built (the
server's 400), not in the middle of a batch. The constructor walks the first two steps::

    text <= MAX_GRAMMAR_BYTES --> compile with LIMITS --> first mask ------------> one token, second mask
    "too large"                   syntax error, a limit    nothing allowed:          the first mask's forced
                                                           "no text matches"         prefix spent the fuel

The second step is there because llguidance computes the forced prefix of the output (every byte
the grammar leaves no choice about) inside the first mask: ``(a{1000}){1000}`` forces a million
'a's, spends the lexer fuel on them, and only the next step reports it. Sane grammars take well
under a millisecond for all of it (measured, see the limits below). A limit reached later, mid-stream
(a lexer that keeps growing states), is a ValueError from :meth:`GrammarMatcher.allowed` or
:meth:`GrammarMatcher.accept` naming the limit: the engine ends that request alone.
"""

from __future__ import annotations

import json
import re
import threading
import weakref

import torch

try:
    import llguidance
    import llguidance.torch as llguidance_torch
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax
except ImportError:  # an optional extra: pip install 'minillm[structured]'
    llguidance = None

# llguidance's resource limits, chosen here (not left to its defaults) so a refused request can name
# them. Measured on SmolLM2's vocabulary on a shared 2-core CPU (llguidance's own speed figures are a
# few times faster), for sane grammars (llama.cpp's GBNF corpus, JSON schemas up to 500 properties or a
# 5,000-string enum, regexes, choices) and for hostile ones. Beyond them a grammar is refused, the limit named.
INITIAL_LEXER_FUEL = 200_000  # building the lexer and the first mask's forced prefix. Sane grammars need: json_object
#   590, 500 properties 10,400, a 1,000-string enum 12,100, 5,000 strings 61,500, a 20,000-way choice 168,000.
#   (a{1000}){1000} burns all of it before it is refused: ~0.7 s at llguidance's default 1,000,000, ~0.13 s here.
STEP_LEXER_FUEL = 50_000  # regex work in one mask (llguidance's default: 200,000). Sane: <= 5,500 a step.
STEP_MAX_ITEMS = 50_000  # Earley items in one mask (its default; ~2.5 ms at its rate). Sane: <= 2,100
#   (500 optional properties).
MAX_ITEMS_IN_ROW = 10_000  # Earley items in one row of the parse. About 4 per optional property of an object:
#   llguidance's default 2,000 refused 500 optional properties; this takes 2,000 (a 12 ms mask), not 3,000.
MAX_LEXER_STATES = 50_000  # the lexer's DFA states, about 1-2 KB each: <= 100 MB a grammar (default 250,000).
#   Sane: <= 5,400 after 60 steps of a state-hungry pattern ([a-z]*a[a-z]{25}).
MAX_GRAMMAR_SIZE = 200_000  # symbols in the compiled grammar (default 500,000). 500 properties: 9,600.
MAX_GRAMMAR_BYTES = 256 * 1024  # the compiled grammar's text; bounds the compiler's recursion (next line).
COMPILE_STACK_BYTES = 256 * 2**20  # llguidance's compiler recurses about 3 KB of stack per nested rule: on
#   8 MB (a thread's usual stack) a chain of ~3,000 rules or of 2,000 schema $refs kills the process (SIGSEGV).
#   The deepest grammar within MAX_GRAMMAR_BYTES (a chain of ~30,000 one-symbol rules) fits in 100 MB:
#   compile on a thread with this much stack (address space; pages are touched only as deep as it goes).
# The whitespace a JSON grammar allows between two tokens: at most 20 spaces, tabs or newlines, so a model
# that likes newlines cannot spend max_tokens on them ("\n" plus 16 spaces of indent fits: 4 levels of 4).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"

LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=INITIAL_LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL, step_max_items=STEP_MAX_ITEMS,
    max_items_in_row=MAX_ITEMS_IN_ROW, max_lexer_states=MAX_LEXER_STATES, max_grammar_size=MAX_GRAMMAR_SIZE,
    verbose_errors=False) if llguidance else None  # verbose errors would print the parser state: many lines
# llguidance's error messages that mean a limit was reached (a fragment of each) -> the limit, by name
LIMIT_ERRORS = {
    "too many expressions constructed": f"the lexer fuel limit (initial_lexer_fuel {INITIAL_LEXER_FUEL:,} at the "
                                        f"start, step_lexer_fuel {STEP_LEXER_FUEL:,} a step)",
    "initial lexer configuration (grammar) too big": f"the initial lexer fuel limit (initial_lexer_fuel "
                                                     f"{INITIAL_LEXER_FUEL:,})",
    "too many states": f"the lexer state limit (max_lexer_states {MAX_LEXER_STATES:,})",
    "Too many items": f"the parser item limit (step_max_items {STEP_MAX_ITEMS:,} a step)",
    "Current row has": f"the parser row limit (max_items_in_row {MAX_ITEMS_IN_ROW:,})",
    "grammar size (number of symbols) too big": f"the grammar size limit (max_grammar_size {MAX_GRAMMAR_SIZE:,} "
                                                "symbols)",
}
NO_MATCH_ERRORS = ("NoExtension",)  # llguidance's stop reason when no byte can come next

_BITS = 2 ** torch.arange(32, dtype=torch.int64)
_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # minillm Tokenizer -> {key: LLTokenizer}
_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide: set it, start one thread, set it back


class Grammar:
    """A compiled constraint: a JSON schema, a regex, a list of choices or a Lark (or GBNF) grammar, on
    one tokenizer's vocabulary. Build it with :meth:`json_schema`, :meth:`regex`, :meth:`choice` or
    :meth:`lark`; pass it as ``SamplingParams(allowed_tokens=grammar)``.

    Args (of every constructor):
        tokenizer: the model's :class:`~minillm.tokenizer.Tokenizer`.
        vocab_size: the model's vocabulary (its logits' width; default the tokenizer's).
        eos_token_ids: the ids that end generation: the grammar allows them once it is complete
            (default the tokenizer's EOS ids; give the model's when they differ).

    Attributes: kind ("json_schema", "regex", "choice", "lark"), source (what was compiled).
    Raises ValueError, one line, for a constraint that cannot work: one that does not compile, that
    is over a limit (MAX_GRAMMAR_BYTES, or llguidance's :data:`LIMITS` in its first two steps, the
    limit named), or that no text matches. ImportError without llguidance.
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
        if len(grammar) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"the {self.what} is too large: {len(grammar):,} bytes compiled, over the limit of "
                             f"{MAX_GRAMMAR_BYTES:,} (MAX_GRAMMAR_BYTES)")
        self._grammar = grammar
        self._admit()

    @property
    def what(self) -> str:
        """The constraint in words, for errors: "json schema", "regex", "choice" or "grammar"."""
        return {"json_schema": "json schema", "lark": "grammar"}.get(self.kind, self.kind)

    def _admit(self) -> None:
        """Compile, then walk the first two steps (module docstring); ValueError if a step fails."""
        probe = self.matcher()
        try:
            text = probe.allowed()  # a grammar that did not compile fails here
            text[list(self.eos_token_ids)] = False  # the tokens that are text, not EOS
            if not text.any():
                if probe.is_complete:
                    return  # it matches only the empty text: the answer is "" (EOS first)
                raise ValueError(f"no text matches the {self.what}")
            probe.accept(int(text.nonzero()[0]))
            probe.allowed()
        except ValueError as error:  # one line: llguidance's error (a limit, no match) as compiled, else ours
            errored = probe._matcher.is_error()
            raise ValueError(_failure(self.what, probe._matcher.get_error()) if errored else str(error)) from None

    @classmethod
    def json_schema(cls, schema: dict | str, tokenizer, *, whitespace_pattern: str | None = JSON_WHITESPACE,
                    **kwargs) -> Grammar:
        """Outputs that parse as JSON and validate against ``schema`` (a dict or its JSON text).
        ``{"type": "object"}`` is any JSON object (OpenAI's ``json_object``). ``whitespace_pattern``:
        the regex for the whitespace allowed between two JSON tokens (none before or after the value);
        the default, :data:`JSON_WHITESPACE`, is at most 20 spaces, tabs or newlines, so a long run
        of whitespace cannot use up max_tokens; None allows none, ``{"a":1,"b":2}`` (vLLM's
        ``disable_any_whitespace``)."""
        if whitespace_pattern not in (None, JSON_WHITESPACE) and llguidance:
            error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(whitespace_pattern))
            if error:
                raise ValueError(f"whitespace_pattern {whitespace_pattern!r:.60} is not a regex: {_one_line([error])}")
        text = schema if isinstance(schema, str) else json.dumps(schema)
        options = {"whitespace_flexible": False} if whitespace_pattern is None else {
            "whitespace_pattern": whitespace_pattern}
        try:
            json.loads(text)
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
        """Outputs of a Lark grammar (llguidance's dialect, rules from ``start``) or of a GBNF grammar
        (llama.cpp's, rules with ``::=`` from ``root``: converted to Lark by llguidance's gbnf_to_lark)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a grammar must be non-empty text")
        if len(text) > MAX_GRAMMAR_BYTES:
            raise ValueError(f"the grammar is too large: {len(text):,} bytes, over the limit of "
                             f"{MAX_GRAMMAR_BYTES:,} (MAX_GRAMMAR_BYTES)")
        if "::=" in text and llguidance and not is_lark_syntax(text):
            try:
                text = gbnf_to_lark(text)
            except RecursionError:
                raise ValueError("cannot convert the GBNF grammar to Lark: it is nested too deeply") from None
            except Exception as e:  # noqa: BLE001 - the converter raises bare Exception for a missing rule
                raise ValueError(f"cannot convert the GBNF grammar to Lark: {_one_line([e])}") from None
        grammar = llguidance.LLMatcher.grammar_from_lark(text) if llguidance else text
        return cls("lark", text, grammar, tokenizer, **kwargs)

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the output, one per sequence."""
        return GrammarMatcher(self)

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, {json.dumps(self.source)[:60]}, vocab={self.vocab_size})"


class GrammarMatcher:
    """One sequence's position in a :class:`Grammar`: which tokens may come next; told each token.
    Both methods raise ValueError, one line, when a limit is reached mid-stream.

    Each has its own llguidance matcher, compiled from the grammar's text (about a millisecond for
    sane grammars) on a large stack (COMPILE_STACK_BYTES): llguidance's copies of one matcher would
    share its lexer, and a limit one of them reached would end every other sequence of the grammar."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._matcher = _on_large_stack(lambda: llguidance.LLMatcher(grammar._tokenizer, grammar._grammar, log_level=0,
                                                                     limits=LIMITS))  # errors: is_error(), below
        self._bitmask = llguidance_torch.allocate_token_bitmask(1, grammar.vocab_size)  # int32 [1, ceil(V / 32)]
        self.num_accepted = 0

    def allowed(self) -> torch.Tensor:
        """bool [vocab]: True for each token the grammar accepts next (EOS once it is complete)."""
        if not self._matcher.is_error():
            llguidance_torch.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        if self._matcher.is_error():  # a limit reached in this step, or no byte can come next
            raise ValueError(self._error())
        return unpack_bitmask(self._bitmask[0], self.grammar.vocab_size)

    def accept(self, token_id: int) -> None:
        """Move past ``token_id``; ValueError if the grammar does not allow it (a bug: sampling masks
        it) or a limit is reached."""
        if not self._matcher.consume_token(int(token_id)):
            error = self._matcher.get_error()
            if any(fragment in error for fragment in LIMIT_ERRORS):
                raise ValueError(self._error())
            raise ValueError(f"token {token_id} is not allowed here by the {self.grammar.what} "
                             f"(after {self.num_accepted} tokens): {_one_line([error])}")
        self.num_accepted += 1

    @property
    def is_complete(self) -> bool:
        """True when the output so far is a whole match (EOS would be allowed, or was taken)."""
        return self._matcher.is_accepting() or self._matcher.is_stopped()

    def _error(self) -> str:
        return _failure(self.grammar.what, self._matcher.get_error(), self.num_accepted)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A packed int32 bitmask (bit j of word w: token 32 w + j) as a bool tensor [vocab_size]."""
    return ((words.to(torch.int64)[:, None] & _BITS) != 0).reshape(-1)[:vocab_size]


def _failure(what: str, error: str, after: int | None = None) -> str:
    """llguidance's ``error`` as one line, for the constraint ``what`` when compiled (``after`` None)
    or ``after`` that many tokens: the limit it reached, by name; "no text matches"; or its message."""
    message = _one_line([error])
    where = "" if after is None else f" after {after} token{'s' if after != 1 else ''}"
    limit = next((name for fragment, name in LIMIT_ERRORS.items() if fragment in error), None)
    if limit:
        return f"the {what} exceeds {limit}{where}: {message}"
    if any(error.startswith(reason) for reason in NO_MATCH_ERRORS):
        return f"no text matches the {what}{where}"
    return f"cannot compile the {what}: {message}" if after is None else f"the {what} failed{where}: {message}"


def _one_line(messages) -> str:
    """llguidance's messages on one line: the caret diagrams, the echoed source lines and the
    ``<non-verbose/>`` marker left out."""
    lines = [line.strip() for message in messages for line in str(message).splitlines()]
    return " ".join(line for line in lines if line and set(line) != {"^"} and not re.match(r"\d+ \|", line)
                    and line != "<non-verbose/>")


def _on_large_stack(fn):
    """``fn()`` on a new thread with COMPILE_STACK_BYTES of stack (its result, or its exception
    raised here): llguidance's compiler recurses once per nested rule (see COMPILE_STACK_BYTES)."""
    outcome = []

    def run():
        try:
            outcome.append((True, fn()))
        except BaseException as error:  # noqa: BLE001 - handed back to the caller's thread
            outcome.append((False, error))

    with _STACK_LOCK:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="minillm-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _ll_tokenizer(tokenizer, vocab_size: int, eos: tuple[int, ...]):
    """llguidance's view of the vocabulary (built from tokenizer.json once per tokenizer, vocab and EOS ids)."""
    per_tokenizer = _LL_TOKENIZERS.setdefault(tokenizer, {})
    key = (vocab_size, eos)
    if key not in per_tokenizer:
        per_tokenizer[key] = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                    eos_token=list(eos))
    return per_tokenizer[key]
