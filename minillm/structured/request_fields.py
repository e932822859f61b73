"""The API fields that ask for structured output, as OpenAI and vLLM spell them, to one :class:`Grammar`.

    OpenAI (chat):  response_format {"type": "json_object"}                    -> any JSON object
                    response_format {"type": "json_object", "schema": {...}}   -> that schema (Together's
                                    and Anyscale's form; instructor <= 1.3's JSON_SCHEMA mode sends it)
                    response_format {"type": "json_schema",
                                     "json_schema": {"name", "schema", "strict"}} -> that schema
                    response_format {"type": "text"}                           -> no constraint
    vLLM today:     structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}
                    (vLLM >= 0.11's StructuredOutputsParams, one of them per request)
    vLLM before:    guided_json, guided_regex, guided_choice, guided_grammar (deprecated in 0.11,
                    still what older clients send; accepted as the same thing)

JSON's whitespace between tokens is at most 20 characters by default (grammar.JSON_WHITESPACE);
``structured_outputs.whitespace_pattern`` replaces that regex, ``disable_any_whitespace`` allows none.

At most one constraint per request; ValueError (a 400) for two, or for one that cannot work (it does
not compile, is over a limit, or no text matches it: see Grammar), the field named first.
"""

from __future__ import annotations

from .grammar import Grammar

# vLLM's StructuredOutputsParams fields that tune its backends: accepted; disable_any_whitespace and
# whitespace_pattern are honoured (JSON only), the others change nothing here
TUNING_FIELDS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                 "whitespace_pattern", "backend"}
LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def grammar_from_request(tokenizer, vocab_size: int, eos_token_ids, *, response_format: dict | None = None,
                         structured_outputs: dict | None = None, **legacy) -> Grammar | None:
    """The request's constraint, or None. ``legacy``: vLLM's older ``guided_*`` fields (None when absent)."""
    asked: list[tuple[str, str, object]] = []  # (field as the request named it, kind, value)
    if response_format is not None:
        kind = response_format.get("type")
        if response_format.get("schema") is not None and kind != "json_object":
            raise ValueError(f"response_format.schema goes with type 'json_object' (Together's form), not {kind!r}; "
                             "with 'json_schema' give the schema as json_schema.schema")
        if kind == "json_object":
            asked.append(("response_format", "json", response_format.get("schema", {"type": "object"})))
        elif kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema")
            if schema is None:  # vLLM also takes it under "json_schema"'s "schema"; OpenAI requires it
                raise ValueError("response_format.json_schema.schema is missing: give the JSON schema there")
            asked.append(("response_format", "json", schema))
        elif kind != "text":
            raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    for name, value in (structured_outputs or {}).items():
        if name in TUNING_FIELDS or value is None or value is False:
            continue
        if name == "json_object":
            asked.append(("structured_outputs.json_object", "json", {"type": "object"}))
        elif name in ("json", "regex", "choice", "grammar"):
            asked.append((f"structured_outputs.{name}", name, value))
        else:
            raise ValueError(f"structured_outputs.{name} is not supported by minillm; use json, regex, choice, "
                             "grammar or json_object")
    for name, value in legacy.items():
        if value is not None:
            asked.append((name, LEGACY[name], value))
    if len(asked) > 1:
        raise ValueError(f"{asked[1][0]}: give one structured output constraint, got {len(asked)}: "
                         f"{', '.join(a[0] for a in asked)}; drop all but one")
    field, kind, value = asked[0] if asked else ("unconstrained text", None, None)
    if kind != "json" and (structured_outputs or {}).get("whitespace_pattern") is not None:
        raise ValueError(f"structured_outputs.whitespace_pattern applies to JSON output (json, json_object or "
                         f"response_format), not to {field}")
    if not asked:
        return None
    build = {"json": Grammar.json_schema, "regex": Grammar.regex, "choice": Grammar.choice, "grammar": Grammar.lark}
    options = {"vocab_size": vocab_size, "eos_token_ids": eos_token_ids}
    if kind == "json":
        options.update(_whitespace(structured_outputs or {}))
    try:
        return build[kind](value, tokenizer, **options)
    except ValueError as error:  # named by the field it came from
        named = "structured_outputs" if str(error).startswith("whitespace_pattern") else field
        raise ValueError(f"{named}: {error}") from None


def _whitespace(structured_outputs: dict) -> dict:
    """Grammar.json_schema's whitespace_pattern from vLLM's two knobs (nothing: its bounded default)."""
    pattern, compact = structured_outputs.get("whitespace_pattern"), structured_outputs.get("disable_any_whitespace")
    if pattern is not None and compact:
        raise ValueError("structured_outputs: give whitespace_pattern or disable_any_whitespace, not both")
    if compact:
        return {"whitespace_pattern": None}
    return {} if pattern is None else {"whitespace_pattern": pattern}
