"""`minillm generate`'s structured-output and logit-bias flags: --json-schema, --regex, --choice, --logit-bias.

    minillm generate "Pick a colour." --json-schema colour.json      the answer parses and validates
    minillm generate "Is water wet?" --choice yes --choice no          one of the choices, exactly
    minillm generate "Phone:" --regex '[0-9]{3}-[0-9]{4}'              a full match of the regex
    minillm generate "Hi" --logit-bias 28=-100                         token 28 never comes

The grammar (minillm/structured/, llguidance) becomes ``SamplingParams.allowed_tokens``; with
--trace each step shows how many tokens the mask allowed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..sampling import SamplingParams
from .common import UsageError


def add_structured_options(p) -> None:
    g = p.add_argument_group("structured output (constrained decoding, minillm/structured/) and logit bias "
                             "(default: none, the answer is free)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", help="the answer is JSON valid against this JSON schema file "
                                                          "('{\"type\": \"object\"}': any JSON object)")
    one.add_argument("--regex", metavar="PATTERN", help="the answer matches this regex in full (Rust regex syntax)")
    one.add_argument("--choice", action="append", metavar="TEXT", help="the answer is exactly one of these; repeat "
                                                                      "for each choice")
    g.add_argument("--logit-bias", action="append", metavar="ID=BIAS",
                   help="add BIAS (-100..100) to token ID's logit before sampling (OpenAI's logit_bias; -100 in "
                        "effect bans it, unless a constraint allows no other token); repeat for several")


def check_structured_args(args) -> None:
    """Reads --json-schema and parses --logit-bias now, before the model loads (usage errors: exit 2)."""
    args.schema = None
    if getattr(args, "json_schema", None) is not None:
        path = Path(args.json_schema)
        if path.is_dir():
            raise UsageError(f"--json-schema: {path} is a folder, not a schema file")
        if not path.is_file():
            raise UsageError(f"--json-schema: no file {path}")
        try:
            args.schema = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise UsageError(f"--json-schema: {path} is not JSON ({e})") from None
    args.logit_bias_map = None
    if getattr(args, "logit_bias", None):
        bias = {}
        for item in args.logit_bias:
            token, _, value = item.partition("=")
            try:
                token_id, token_bias = int(token), float(value)
            except ValueError:
                raise UsageError(f"--logit-bias takes ID=BIAS (e.g. 28=-100), got {item!r}") from None
            if token_id in bias:
                raise UsageError(f"--logit-bias: token {token_id} given twice; give each token id once")
            bias[token_id] = token_bias
        try:
            SamplingParams(logit_bias=bias)
        except ValueError as e:
            raise UsageError(f"--logit-bias: {e}") from None
        args.logit_bias_map = bias
    constrained = args.schema is not None or getattr(args, "regex", None) or getattr(args, "choice", None)
    if (constrained or args.logit_bias_map) and getattr(args, "speculative", None):
        raise UsageError("--speculative does not go with --json-schema, --regex, --choice or --logit-bias yet")


def constrain(params, args, model, tokenizer, eos_token_ids):
    """``params`` with the grammar and the logit bias the flags ask for (unchanged without them)."""
    grammar = None
    if args.schema is not None or args.regex or args.choice:
        from ..structured import Grammar

        kind, source = (("json_schema", args.schema) if args.schema is not None else
                        ("regex", args.regex) if args.regex else ("choice", args.choice))
        flag = {"json_schema": "--json-schema", "regex": "--regex", "choice": "--choice"}[kind]
        try:
            grammar = getattr(Grammar, kind)(source, tokenizer, vocab_size=model.config.vocab_size,
                                             eos_token_ids=sorted(eos_token_ids))
        except ImportError as e:
            raise UsageError(f"{flag}: {e}") from None
        except ValueError as e:
            raise UsageError(f"{flag}: {e}") from None
    if grammar is None and not args.logit_bias_map:
        return params
    vocab = model.config.vocab_size
    if args.logit_bias_map and max(args.logit_bias_map) >= vocab:
        raise UsageError(f"--logit-bias: token {max(args.logit_bias_map)} is not in the vocabulary "
                         f"(size {vocab}: ids 0..{vocab - 1})")
    try:
        return dataclasses.replace(params, allowed_tokens=grammar, logit_bias=args.logit_bias_map)
    except ValueError as e:
        raise UsageError(f"--logit-bias: {e}") from None
