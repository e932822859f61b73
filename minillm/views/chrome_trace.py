"""A generate request's :class:`~minillm.trace.Trace` as a Chrome trace, for Perfetto or chrome://tracing.

``write_trace(trace, "run.json")`` (``minillm generate --trace-out run.json``) writes it in
Chrome's Trace Event Format (:mod:`minillm.formats.trace_events`: the events, their phases,
times in MICROSECONDS). One process, one track (tid) per kind of work
(:func:`trace_to_chrome_events`)::

    pid 1 "minillm generate"
      tid 1 request            |================ request: 0 .. e2e ================|
                               |tokenize|                                  ^detokenize
      tid 2 prefill / decode            |-- prefill --|   |decode|   |decode|
      tid 3 sampling                                  |s|        |s|        |s|
      tid 4 layers (level "layers")     |b0|b1|...|   |..|       |..|
      tid 5 prefix cache           ^lookup        ^insert
      tid 6 all-reduce (tensor parallel)  |||||||||    | | |      | | |    (each collective of rank 0)
      counters: KV cache length {tokens}, KV cache size {bytes} (Perfetto: "KV cache length tokens")
"""

from __future__ import annotations

from pathlib import Path

from ..formats.trace_events import complete, counter, instant, process_name, thread_name, thread_sort_index, write

PID = 1
TRACKS = {"request": 1, "passes": 2, "sampling": 3, "layers": 4, "prefix cache": 5, "collectives": 6}
TRACK_NAMES = {"request": "request", "passes": "prefill / decode", "sampling": "sampling",
               "layers": "layers", "prefix cache": "prefix cache", "collectives": "all-reduce (tensor parallel)"}
_COLLECTIVES = ("all_reduce", "all_gather")
_TIMES = ("kind", "t_ms", "start_ms", "end_ms", "time_ms", "sample_ms")
_SAMPLING = ("next_token_id", "next_token_text", "next_token_prob", "next_token_logprob", "next_token_rank",
             "candidates", "sampling", "finish_reason")
_NOT_ON_A_TRACK = ("trace", "model", "metrics")  # header, model: otherData; metrics: the request box


def trace_to_chrome_events(trace) -> list[dict]:
    """The events of one request's :class:`~minillm.trace.Trace` as Chrome trace events.

    Process 1 "minillm generate", one track (tid) per kind of work (see the module docstring):

    - request: the whole request as a box from 0 to e2e_ms (args: the metrics), tokenize as a
      box (its span), detokenize and any other event as an instant at its ``t_ms``
      (detokenize's time_ms is spread over the steps, so it is an arg, not a box);
    - prefill / decode: one box per forward pass, ``start_ms`` lasting ``time_ms``, args its
      tokens, FLOPs, bytes, arithmetic intensity, K/V written and cache length;
    - sampling: from the pass's end to ``end_ms`` (``sample_ms``), args the chosen token;
    - layers (level "layers"): one box per layer per pass, ``start_ms`` lasting ``time_ms``;
    - prefix cache: lookup, hit, insert and evict as instants;
    - all-reduce (tensor parallel, :mod:`minillm.distributed`): each all-reduce and all-gather as a box;
    - counters "KV cache length" {"tokens"} and "KV cache size" {"bytes"}: before the first
      pass, then after each pass.

    Times are the trace's own (ms since ``trace.start_s``) in microseconds; none is made up.
    """
    events = [process_name(PID, "minillm generate")]
    passes = trace.steps
    for track in _tracks_used(trace):
        tid = TRACKS[track]
        events += [thread_name(PID, tid, TRACK_NAMES[track]), thread_sort_index(PID, tid, tid)]
    events += _request_events(trace)
    for e in passes:
        events += _pass_events(e, first=e is passes[0])
    events += [_layer_event(e, trace) for e in trace.of("layer")]
    return events


def write_trace(trace, path) -> Path:
    """Write one request's :class:`~minillm.trace.Trace` as a Chrome trace and return the path:
    open it in https://ui.perfetto.dev or chrome://tracing to see the request on a timeline, one
    track per kind of work (:func:`trace_to_chrome_events`). Raises ValueError when the folder
    of ``path`` does not exist (see :func:`~minillm.formats.trace_events.write`)."""
    return write(path, trace_to_chrome_events(trace), trace_metadata(trace))


def trace_metadata(trace) -> dict:
    """The ``otherData`` of a Trace's Chrome file: the trace level and the model's fields
    (prefixed "model_"), flat values as viewers show them best."""
    data = {"generator": "minillm", "trace_level": trace.level}
    model = trace.first("model") or {}
    data.update({f"model_{k}": v for k, v in model.items() if k not in ("kind", "t_ms")})
    return data


def _tracks_used(trace) -> list[str]:
    kinds = {e["kind"] for e in trace.events}
    used = ["request", "passes"]
    if any("sample_ms" in e for e in trace.steps):
        used.append("sampling")
    if "layer" in kinds:
        used.append("layers")
    if any(k.startswith("prefix_") for k in kinds):
        used.append("prefix cache")
    if kinds & set(_COLLECTIVES):
        used.append("collectives")
    return used


def _request_events(trace) -> list[dict]:
    """The request box, tokenize, prefix cache events and the other records (not passes or layers)."""
    events = []
    metrics = trace.metrics
    if metrics is not None:
        events.append(complete("request", 0.0, _us(metrics["e2e_ms"]), PID, TRACKS["request"], "request",
                               _args(metrics)))
    for e in trace.events:
        kind = e["kind"]
        if kind in _NOT_ON_A_TRACK or kind in ("prefill", "decode", "layer"):
            continue
        track = TRACKS["prefix cache"] if kind.startswith("prefix_") else \
            TRACKS["collectives"] if kind in _COLLECTIVES else TRACKS["request"]
        if "start_ms" in e and "time_ms" in e:  # a span: it has its own start
            events.append(complete(kind, _us(e["start_ms"]), _us(e["time_ms"]), PID, track, kind, _args(e)))
        else:
            events.append(instant(kind, _us(e["t_ms"]), PID, track, args=_args(e, keep_time=True)))
    return events


def _pass_events(e, first: bool) -> list[dict]:
    """One prefill or decode pass: its box, its sampling box, the KV cache counters after it."""
    start, pass_end = _us(e["start_ms"]), _us(e["start_ms"] + e["time_ms"])
    args = {k: v for k, v in _args(e).items() if k not in _SAMPLING}
    events = [complete(e["kind"], start, _us(e["time_ms"]), PID, TRACKS["passes"], e["kind"], args)]
    if "sample_ms" in e:
        sampled = {k: e[k] for k in _SAMPLING if k in e}
        events.append(complete("sample", pass_end, _us(e["sample_ms"]), PID, TRACKS["sampling"], "sampling", sampled))
    if first:  # where the cache stood before the first pass (a prefix cache hit starts it above 0)
        before = e["cache_length_before"]
        bytes_before = e["kv_bytes"] * before // e["cache_length_after"]  # bytes are proportional to length
        events += [counter("KV cache length", start, PID, {"tokens": before}),
                   counter("KV cache size", start, PID, {"bytes": bytes_before})]
    events += [counter("KV cache length", pass_end, PID, {"tokens": e["cache_length_after"]}),
               counter("KV cache size", pass_end, PID, {"bytes": e["kv_bytes"]})]
    return events


def _layer_event(e, trace) -> dict:
    """One layer of one pass. Traces written before layers had a start_ms are laid out back to
    back from their pass's start (args "start": "approximate"); the durations are measured."""
    args = _args(e)
    if e.get("start_ms") is not None:
        start = e["start_ms"]
    else:
        pass_event = next(p for p in trace.steps if p["step"] == e["step"])
        earlier = [x["time_ms"] or 0.0 for x in trace.layers(e["step"]) if x["layer"] < e["layer"]]
        start = pass_event["start_ms"] + sum(earlier)
        args["start"] = "approximate"
    return complete(e["name"], _us(start), _us(e["time_ms"] or 0.0), PID, TRACKS["layers"], e["phase"], args)


def _args(event, keep_time: bool = False) -> dict:
    """An event's fields as Chrome args, less the times that became ts and dur."""
    drop = ("kind", "t_ms") if keep_time else _TIMES
    return {k: v for k, v in event.items() if k not in drop}


def _us(ms: float) -> float:
    """Milliseconds (the Trace's unit) to microseconds (the Trace Event Format's)."""
    return ms * 1e3
