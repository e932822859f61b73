"""The Chrome trace export: validate() against malformed events, a real Trace's timeline
checked against the Trace's own events (the oracle), and `generate --trace-out FILE.json`.

A tiny random-weight Llama stands in for a real model: the export only reads the trace.
"""

import json
import shutil

import pytest

from minillm import SamplingParams, generate, load_model
from minillm.cli import main
from minillm.formats import trace_events as te
from minillm.prefix_cache import PrefixCache
from minillm.trace import Trace
from minillm.views import chrome_trace as ct

from tiny_models import CONFIGS, LLAMA_BASE, build_hf, save_hf

PROMPT = [5, 17, 99, 3, 42, 8, 61, 7, 12]
GOOD = te.complete("prefill", 0.0, 10.0, 1, 2)


# -- validate() --------------------------------------------------------------------------------------


def _without(event, key):
    return {k: v for k, v in event.items() if k != key}


BAD_EVENTS = {
    "not a dict": (["prefill"], "must be a JSON object"),
    "no ph": (_without(GOOD, "ph"), "unknown phase ph=None"),
    "unknown ph": (dict(GOOD, ph="Q"), "unknown phase ph='Q'"),
    "X without name": (_without(GOOD, "name"), "missing name"),
    "X without ts": (_without(GOOD, "ts"), "missing ts"),
    "X without dur": (_without(GOOD, "dur"), "missing dur"),
    "X without pid": (_without(GOOD, "pid"), "missing pid"),
    "X without tid": (_without(GOOD, "tid"), "missing tid"),
    "negative dur": (dict(GOOD, dur=-1.0), "dur must be >= 0"),
    "ts a string": (dict(GOOD, ts="12"), "ts must be a finite number"),
    "ts NaN": (dict(GOOD, ts=float("nan")), "ts must be a finite number"),
    "ts a bool": (dict(GOOD, ts=True), "ts must be a finite number"),
    "dur infinite": (dict(GOOD, dur=float("inf")), "dur must be a finite number"),
    "pid a string": (dict(GOOD, pid="1"), "pid must be an int"),
    "tid a float": (dict(GOOD, tid=2.0), "tid must be an int"),
    "name not a str": (dict(GOOD, name=3), "name must be a str"),
    "args a list": (dict(GOOD, args=[1]), "args must be a dict"),
    "instant without tid": (_without(te.instant("hit", 1.0, 1, 5), "tid"), "missing tid"),
    "instant bad scope": (te.instant("hit", 1.0, 1, 5, scope="x"), "instant scope s must be one of g, p, t"),
    "counter without args": (_without(te.counter("kv", 1.0, 1, {"bytes": 1}), "args"), "missing args"),
    "counter empty": (te.counter("kv", 1.0, 1, {}), "counter values must be numbers"),
    "counter a string": (te.counter("kv", 1.0, 1, {"bytes": "1 KiB"}), "counter values must be numbers"),
    "metadata unknown": (dict(te.process_name(1, "p"), name="process_colour"), "unknown metadata event"),
    "thread_name without tid": (_without(te.thread_name(1, 2, "t"), "tid"), "missing tid"),
    "thread_name not a str": (te.thread_name(1, 2, 7), "args.name must be a str"),
    "process_name without args": (_without(te.process_name(1, "p"), "args"), "missing args"),
    "sort_index a str": (te.thread_sort_index(1, 2, "1"), "args.sort_index must be an int"),
}


@pytest.mark.parametrize("event, message", BAD_EVENTS.values(), ids=BAD_EVENTS.keys())
def test_validate_names_the_first_bad_event(event, message):
    good_after = te.instant("later", 5.0, 1, 2)
    with pytest.raises(ValueError) as info:
        te.validate({"traceEvents": [GOOD, event, good_after], "displayTimeUnit": "ms"})
    text = str(info.value)
    assert text.startswith("trace event 1 ") and message in text and "\n" not in text


@pytest.mark.parametrize("obj, message", [
    ({"events": []}, "traceEvents"),
    ({"traceEvents": {}}, "traceEvents"),
    ("[]", "traceEvents"),
    ({"traceEvents": [], "displayTimeUnit": "s"}, "displayTimeUnit"),
])
def test_validate_rejects_a_malformed_container(obj, message):
    with pytest.raises(ValueError, match=message):
        te.validate(obj)


def test_every_helper_makes_a_valid_event():
    events = [te.process_name(1, "engine"), te.thread_name(1, 2, "scheduler"), te.thread_sort_index(1, 2, 0),
              te.complete("step", 1.5, 0.0, 1, 2, cat="sched", args={"n": 3}), te.instant("hit", 2, 1, 2),
              te.counter("kv", 3.0, 1, {"bytes": 10, "tokens": 2})]
    te.validate({"traceEvents": events})
    te.validate(events)  # the JSON Array Format too
    assert [e["ph"] for e in events] == ["M", "M", "M", "X", "i", "C"]


def test_write_is_the_json_object_format(tmp_path):
    path = te.write(tmp_path / "t.json", [GOOD], metadata={"run": "a"})
    obj = json.loads(path.read_text())
    assert obj == {"traceEvents": [GOOD], "displayTimeUnit": "ms", "otherData": {"run": "a"}}


@pytest.mark.parametrize("events, message", [
    ([dict(GOOD, dur=-1)], "dur must be >= 0"),
    ([dict(GOOD, args={"x": float("nan")})], "not plain JSON"),
])
def test_write_refuses_a_bad_trace_and_writes_nothing(tmp_path, events, message):
    with pytest.raises(ValueError, match=message):
        te.write(tmp_path / "t.json", events)
    assert not (tmp_path / "t.json").exists()


def test_write_refuses_a_missing_folder_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="folder .*nope does not exist; create it"):
        te.write(tmp_path / "nope" / "t.json", [GOOD])


# -- a real Trace, exported --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    return load_model(save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("llama_gqa")), device="cpu")


def exported(trace, tmp_path):
    """The trace written with write_trace and read back as a user's viewer reads it."""
    with ct.write_trace(trace, tmp_path / "run.json").open() as f:
        obj = json.load(f)
    te.validate(obj)
    return obj["traceEvents"]


def on_track(events, name):
    tid = next(e["tid"] for e in events if e["name"] == "thread_name" and e["args"]["name"] == name)
    return [e for e in events if e.get("tid") == tid and e["ph"] != "M"]


@pytest.mark.parametrize("n_new", [1, 4])
def test_passes_are_the_traces_own_times(model, tmp_path, n_new):
    trace = Trace()
    list(generate(model, PROMPT, SamplingParams(max_new_tokens=n_new), trace=trace, eos_token_ids=[]))
    events = exported(trace, tmp_path)
    assert {e["pid"] for e in events} == {1}
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    passes = on_track(events, "prefill / decode")
    assert [e["name"] for e in passes] == ["prefill"] + ["decode"] * (n_new - 1)
    oracle = trace.steps  # one event per pass, in order
    assert [e["ts"] / 1e3 for e in passes] == pytest.approx([e["start_ms"] for e in oracle], abs=1e-9)
    assert [e["dur"] / 1e3 for e in passes] == pytest.approx([e["time_ms"] for e in oracle], abs=1e-9)
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(passes, passes[1:]))  # prefill before the first decode
    assert passes[0]["args"]["n_tokens"] == len(PROMPT) and passes[0]["args"]["flops"] == oracle[0]["flops"]
    samples = on_track(events, "sampling")
    assert [e["dur"] / 1e3 for e in samples] == pytest.approx([e["sample_ms"] for e in oracle], abs=1e-9)
    assert [e["args"]["next_token_id"] for e in samples] == [e["next_token_id"] for e in oracle]
    (request,) = [e for e in on_track(events, "request") if e["name"] == "request"]
    assert (request["ts"], request["dur"] / 1e3) == (0.0, pytest.approx(trace.metrics["e2e_ms"], abs=1e-9))


def test_kv_cache_counters_follow_the_cache_length(model, tmp_path):
    trace = Trace()
    list(generate(model, PROMPT, SamplingParams(max_new_tokens=3), trace=trace, eos_token_ids=[]))
    events = exported(trace, tmp_path)
    lengths = [e["args"]["tokens"] for e in events if e["name"] == "KV cache length"]
    assert lengths == [0] + [e["cache_length_after"] for e in trace.steps]
    kv_bytes = [e["args"]["bytes"] for e in events if e["name"] == "KV cache size"]
    assert kv_bytes == [0] + [e["kv_bytes"] for e in trace.steps]


def test_layers_lie_inside_their_pass(model, tmp_path):
    trace = Trace("layers")
    list(generate(model, PROMPT, SamplingParams(max_new_tokens=3), trace=trace, eos_token_ids=[]))
    events = exported(trace, tmp_path)
    passes, layers = on_track(events, "prefill / decode"), on_track(events, "layers")
    assert len(layers) == model.config.n_layers * len(passes)
    assert [e["dur"] / 1e3 for e in layers] == pytest.approx([e["time_ms"] for e in trace.layers()], abs=1e-9)
    for layer in layers:
        outer = passes[layer["args"]["step"]]
        assert outer["ts"] <= layer["ts"] and layer["ts"] + layer["dur"] <= outer["ts"] + outer["dur"] + 1e-6


def test_an_older_trace_without_layer_starts_still_exports(model, tmp_path):
    trace = Trace("layers")
    list(generate(model, PROMPT, SamplingParams(max_new_tokens=2), trace=trace, eos_token_ids=[]))
    records = [{k: v for k, v in r.items() if not (r["kind"] == "layer" and k == "start_ms")} for r in trace.to_records()]
    layers = on_track(exported(Trace.from_records(records), tmp_path), "layers")
    assert len(layers) == 2 * model.config.n_layers and all(e["args"]["start"] == "approximate" for e in layers)
    assert layers[0]["ts"] / 1e3 == pytest.approx(trace.prefill["start_ms"], abs=1e-9)


def test_prefix_cache_events_have_their_track(model, tmp_path):
    cache = PrefixCache(model, block_size=4)
    list(generate(model, PROMPT, SamplingParams(max_new_tokens=1), prefix_cache=cache, eos_token_ids=[]))
    trace = Trace()
    list(generate(model, PROMPT, SamplingParams(max_new_tokens=2), trace=trace, prefix_cache=cache, eos_token_ids=[]))
    events = exported(trace, tmp_path)
    prefix = on_track(events, "prefix cache")
    assert [e["name"] for e in prefix] == [e["kind"] for e in trace.events if e["kind"].startswith("prefix_")]
    assert all(e["ph"] == "i" for e in prefix) and "prefix_hit" in [e["name"] for e in prefix]
    first_length = next(e for e in events if e["name"] == "KV cache length")
    assert first_length["args"]["tokens"] == trace.prefill["cached_tokens"] == 8  # the cache starts at the hit


# -- the CLI -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smollm2_dir):
    """A tiny random Llama with SmolLM2's tokenizer (its vocabulary size): a CLI run in under a second."""
    folder = save_hf(build_hf("llama", dict(LLAMA_BASE, vocab_size=49152)), tmp_path_factory.mktemp("tiny_cli"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder


@pytest.mark.parametrize("suffix", [".json", ".JSON"])
def test_trace_out_json_writes_a_chrome_trace(tiny_folder, tmp_path, capsys, suffix):
    out = tmp_path / f"run{suffix}"
    assert main(["generate", "--model", str(tiny_folder), "--max-new-tokens", "3", "--trace-out", str(out), "hi"]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    obj = json.loads(out.read_text())
    te.validate(obj)
    names = [e["name"] for e in obj["traceEvents"]]
    assert names.count("prefill") == 1 and names.count("decode") == 2 and "tokenize" in names
    assert obj["otherData"]["model_n_layers"] == LLAMA_BASE["num_hidden_layers"]


def test_trace_out_jsonl_is_still_one_event_a_line(tiny_folder, tmp_path):
    out = tmp_path / "run.jsonl"
    assert main(["generate", "--model", str(tiny_folder), "--max-new-tokens", "2", "--trace-out", str(out), "hi"]) == 0
    kinds = [json.loads(line)["kind"] for line in out.read_text().splitlines()]
    assert kinds[0] == "trace" and kinds.count("decode") == 1


def test_trace_out_with_another_suffix_is_a_usage_error(tmp_path, capsys):
    assert main(["generate", "hi", "--trace-out", str(tmp_path / "run.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must end in .jsonl" in err and ".json (a Chrome trace" in err
