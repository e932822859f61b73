"""Chrome's Trace Event Format: a run as a timeline that Perfetto or chrome://tracing opens.

The format is defined in "Trace Event Format" (Google doc by Duncan Mak et al.,
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU). Its
JSON Object Format is one object holding a list of events::

    {"traceEvents": [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "minillm generate"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "prefill / decode"}},
        {"name": "prefill", "ph": "X", "ts": 120.0, "dur": 5300.0, "pid": 1, "tid": 2, "args": {"n_tokens": 7}},
        {"name": "KV cache length", "ph": "C", "ts": 5420.0, "pid": 1, "args": {"tokens": 7}}],
     "displayTimeUnit": "ms", "otherData": {"model_n_layers": 30}}

Every event has a phase ``ph``: "X" a complete event (a box from ``ts`` lasting ``dur``),
"i" an instant (a tick at ``ts``), "C" a counter (a line chart of ``args``' numbers) and
"M" metadata (the names and order of processes and threads). ``ts`` and ``dur`` are
MICROSECONDS. ``pid`` and ``tid`` are ints: the viewer draws one track per (pid, tid),
and a box lying inside another on the same track is drawn nested under it.

The helpers below build single events as plain dicts; :func:`validate` checks a whole
trace and :func:`write` writes one. They know nothing of minillm, so the serving engine uses
them for its own tracks (:mod:`minillm.serving.step_trace`: one tid per request, one for the
scheduler) and :mod:`minillm.views.chrome_trace` for a generate request's Trace.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

DISPLAY_TIME_UNIT = "ms"

# The fields each phase needs ("ph" is always needed). "i" is the instant's phase, "I" its old
# spelling; "B"/"E" (begin/end pairs) are accepted so that traces made elsewhere validate too.
REQUIRED = {
    "X": ("name", "ts", "dur", "pid", "tid"),
    "B": ("name", "ts", "pid", "tid"),
    "E": ("ts", "pid", "tid"),
    "i": ("name", "ts", "pid", "tid"),
    "I": ("name", "ts", "pid", "tid"),
    "C": ("name", "ts", "pid", "args"),
    "M": ("name", "pid", "args"),
}
INSTANT_SCOPES = ("g", "p", "t")  # global, process, thread
# Metadata events: their name, whether they need a tid, and the one field their args must hold.
METADATA = {
    "process_name": (False, "name", str),
    "process_sort_index": (False, "sort_index", int),
    "thread_name": (True, "name", str),
    "thread_sort_index": (True, "sort_index", int),
}


# -- building events (all times in microseconds) ----------------------------------------------------


def complete(name: str, ts_us: float, dur_us: float, pid: int, tid: int, cat: str = "",
             args: dict | None = None) -> dict:
    """A complete event (ph "X"): a box on track (pid, tid) from ``ts_us`` lasting ``dur_us``
    microseconds; ``cat`` a comma-separated category, ``args`` shown when the box is selected."""
    event = {"name": name, "ph": "X", "ts": ts_us, "dur": dur_us, "pid": pid, "tid": tid}
    return _with(event, cat, args)


def instant(name: str, ts_us: float, pid: int, tid: int, scope: str = "t", args: dict | None = None) -> dict:
    """An instant event (ph "i"): a tick at ``ts_us`` microseconds; ``scope`` "t" marks the
    thread's track, "p" the whole process, "g" every process."""
    return _with({"name": name, "ph": "i", "ts": ts_us, "pid": pid, "tid": tid, "s": scope}, "", args)


def counter(name: str, ts_us: float, pid: int, values: dict) -> dict:
    """A counter event (ph "C"): from ``ts_us`` microseconds on, the counter ``name`` of
    process ``pid`` holds ``values`` ({series: number}; one line per series, until the next)."""
    return {"name": name, "ph": "C", "ts": ts_us, "pid": pid, "args": dict(values)}


def process_name(pid: int, name: str) -> dict:
    """A metadata event (ph "M") naming process ``pid`` (the label above its tracks)."""
    return {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}


def thread_name(pid: int, tid: int, name: str) -> dict:
    """A metadata event (ph "M") naming the track of thread ``tid`` in process ``pid``."""
    return {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def thread_sort_index(pid: int, tid: int, index: int) -> dict:
    """A metadata event (ph "M") placing track ``tid`` among its process's tracks (lower: higher up)."""
    return {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": index}}


def _with(event: dict, cat: str, args: dict | None) -> dict:
    if cat:
        event["cat"] = cat
    if args:
        event["args"] = dict(args)
    return event


# -- checking and writing -----------------------------------------------------------------------------


def validate(obj) -> None:
    """Check a trace: the JSON Object Format ``{"traceEvents": [...], ...}`` or a bare list of events.

    Checks what viewers rely on: each event's ``ph`` is known and it has the fields its phase
    needs (see REQUIRED); ``ts`` and ``dur`` are finite numbers (microseconds), ``dur >= 0``;
    ``pid`` and ``tid`` are ints; ``args`` is a dict; counters hold numbers; instants have a
    known scope; metadata events are one of METADATA with the args field it needs.

    Raises ValueError, one line naming the first bad event (its index, name and phase).
    """
    events = _events_of(obj)
    for i, event in enumerate(events):
        problem = _problem(event)
        if problem:
            label = f"{event.get('name')!r}, ph {event.get('ph')!r}" if isinstance(event, dict) else "not a dict"
            raise ValueError(f"trace event {i} ({label}): {problem}")


def _events_of(obj) -> list:
    if isinstance(obj, list):
        return obj
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        raise ValueError(f"a Chrome trace is {{\"traceEvents\": [...]}} or a list of events, got {type(obj).__name__}"
                         + (f" with keys {sorted(obj)}" if isinstance(obj, dict) else ""))
    unit = obj.get("displayTimeUnit", "ms")
    if unit not in ("ms", "ns"):
        raise ValueError(f"displayTimeUnit must be 'ms' or 'ns', got {unit!r}")
    return obj["traceEvents"]


def _problem(event) -> str | None:
    """What is wrong with one event, or None."""
    if not isinstance(event, dict):
        return "an event must be a JSON object (dict)"
    ph = event.get("ph")
    if ph not in REQUIRED:
        return f"unknown phase ph={ph!r}; known: {', '.join(REQUIRED)}"
    missing = [key for key in REQUIRED[ph] if key not in event]
    if ph == "M" and METADATA.get(event.get("name"), (False,))[0] and "tid" not in event:
        missing.append("tid")
    if missing:
        return f"missing {', '.join(missing)}"
    return (_number_problem(event, "ts") or _number_problem(event, "dur") or _id_problem(event)
            or _args_problem(event) or _phase_problem(event))


def _number_problem(event: dict, key: str) -> str | None:
    if key not in event:
        return None
    value = event[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"{key} must be a finite number of microseconds, got {value!r}"
    if key == "dur" and value < 0:
        return f"dur must be >= 0 microseconds, got {value!r}"
    return None


def _id_problem(event: dict) -> str | None:
    for key in ("pid", "tid"):
        if key in event and (isinstance(event[key], bool) or not isinstance(event[key], int)):
            return f"{key} must be an int, got {event[key]!r}"
    return None


def _args_problem(event: dict) -> str | None:
    if "args" in event and not isinstance(event["args"], dict):
        return f"args must be a dict, got {type(event['args']).__name__}"
    if "name" in event and not isinstance(event["name"], str):
        return f"name must be a str, got {event['name']!r}"
    return None


def _phase_problem(event: dict) -> str | None:
    ph, args = event["ph"], event.get("args", {})
    if ph == "C":
        bad = {k: v for k, v in args.items() if isinstance(v, bool) or not isinstance(v, (int, float))}
        return f"counter values must be numbers, got {bad}" if bad or not args else None
    if ph in ("i", "I") and event.get("s", "t") not in INSTANT_SCOPES:
        return f"instant scope s must be one of {', '.join(INSTANT_SCOPES)}, got {event['s']!r}"
    if ph == "M":
        if event["name"] not in METADATA:
            return f"unknown metadata event; known: {', '.join(METADATA)}"
        _, field, kind = METADATA[event["name"]]
        value = args.get(field)
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"args.{field} must be {'a str' if kind is str else 'an int'}, got {value!r}"
    return None


def write(path, events, metadata: dict | None = None) -> Path:
    """Write ``events`` as a Chrome trace in the JSON Object Format and return the path.

    The file is ``{"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata}``:
    open it in https://ui.perfetto.dev or chrome://tracing. ``metadata`` (JSON-ready, flat
    values are shown best) describes the run.

    Raises ValueError when the events do not pass :func:`validate`, a value is not JSON
    (NaN, infinity, an object), or the folder of ``path`` does not exist; nothing is written then.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"cannot write {path}: folder {path.parent} does not exist; create it "
                         f"(mkdir -p {path.parent}) or pick another path")
    obj = {"traceEvents": list(events), "displayTimeUnit": DISPLAY_TIME_UNIT, "otherData": dict(metadata or {})}
    validate(obj)
    try:
        text = json.dumps(obj, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the Chrome trace is not plain JSON: {e}") from None
    path.write_text(text)
    return path
