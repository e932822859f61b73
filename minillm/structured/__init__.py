"""Structured output by constrained decoding: a grammar decides which tokens may come next.

The core (minillm/sampling.py) takes a plain hook, ``SamplingParams(allowed_tokens=...)``: any
object whose ``matcher()`` gives each sequence a matcher with ``allowed()`` (a bool mask over the
vocabulary) and ``accept(token_id)``. Sampling sets the disallowed logits to -inf first, so greedy
takes the best allowed token and sampling draws only among allowed ones. This package builds
such objects with a grammar library (llguidance):

    grammar.py         Grammar (JSON schema, regex, choices, Lark or GBNF) and GrammarMatcher: the mask;
                       a constraint that cannot work (over a limit, no text matches) refused when built
    request_fields.py  OpenAI's response_format and vLLM's structured_outputs / guided_* -> Grammar

Imported by the CLI and the server only; the engine and generate() see just the hook.

    >>> grammar = Grammar.json_schema({"enum": ["yes", "no"]}, tokenizer)
    >>> generate(model, ids, SamplingParams(allowed_tokens=grammar), tokenizer=tokenizer)
"""

from .grammar import Grammar, GrammarMatcher, unpack_bitmask
from .request_fields import grammar_from_request

__all__ = ["Grammar", "GrammarMatcher", "grammar_from_request", "unpack_bitmask"]
