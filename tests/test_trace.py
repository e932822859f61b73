"""The trace recorder: counts, timings, top-k candidates, layers, kept activations, export.

A tiny random-weight Llama (GQA) stands in for a real model: the trace's bookkeeping
does not depend on the weights. The real model is exercised in test_render.py.
"""

import json
import math

import pytest
import torch

from minillm import KVCache, SamplingParams, decode_step, generate, load_model, prefill
from minillm.costs import decode_cost, prefill_cost
from minillm.hardware import PROFILES
from minillm.trace import Event, Trace
from minillm.views.html import show, trace_html

from tiny_models import CONFIGS, build_hf, save_hf

PROMPT = [5, 17, 99, 3, 42, 8, 61]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    family, kwargs = CONFIGS["llama_gqa"]
    folder = save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("llama_gqa"))
    return load_model(folder, device="cpu")


def run(model, trace, prompt=PROMPT, **params):
    params.setdefault("max_new_tokens", 5)
    steps = list(generate(model, prompt, SamplingParams(**params), trace=trace, eos_token_ids=[]))
    return steps


# -- counts and timings ------------------------------------------------------------------------


@pytest.mark.parametrize("n_new", [1, 2, 6])
@pytest.mark.parametrize("prompt", [[7], PROMPT])
def test_counts_agree(model, n_new, prompt):
    trace = Trace()
    steps = run(model, trace, prompt, max_new_tokens=n_new)
    assert len(steps) == n_new
    assert len(trace.of("prefill")) == 1
    decode = trace.decode_steps
    assert len(decode) == len(steps) - 1
    pre = trace.prefill
    assert (pre["cache_length_before"], pre["cache_length_after"], pre["n_tokens"]) == (0, len(prompt), len(prompt))
    assert (pre["position_first"], pre["position_last"]) == (0, len(prompt) - 1)
    previous = pre["cache_length_after"]
    for e in decode:  # the cache grows by exactly one per decode step, at the next position
        assert e["cache_length_before"] == previous == e["position"]
        assert e["cache_length_after"] == previous + 1
        assert e["kv_cache_shape"][2] == e["cache_length_after"]
        previous = e["cache_length_after"]
    assert [e["step"] for e in trace.steps] == list(range(n_new))
    assert [e["next_token_id"] for e in trace.steps] == [s.token_id for s in steps]
    assert [e["input_token_id"] for e in decode] == [s.token_id for s in steps[:-1]]


@pytest.mark.parametrize("n_new", [1, 2, 6])
def test_ttft_is_prefill_end_and_tpot_is_mean_decode_gap(model, n_new):
    trace = Trace()
    steps = run(model, trace, max_new_tokens=n_new)
    m = trace.metrics
    ends = [e["end_ms"] for e in trace.steps]
    assert m["ttft_ms"] == pytest.approx(trace.prefill["end_ms"], abs=1e-6)
    assert m["e2e_ms"] == pytest.approx(ends[-1], abs=1e-6)
    # each token's end_ms is the GenerationStep's time, on the trace's clock
    assert ends == pytest.approx([(s.time_s - trace.start_s) * 1e3 for s in steps], abs=1e-6)
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    if n_new == 1:
        assert m["tpot_ms"] is None
    else:
        assert m["tpot_ms"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-9)
        assert m["itl_ms"] == pytest.approx(gaps, abs=1e-6)
    assert (m["n_prompt_tokens"], m["n_output_tokens"], m["finish_reason"]) == (len(PROMPT), n_new, "length")
    for e in trace.steps:  # the pass comes first, then sampling; all inside the request
        assert 0 <= e["start_ms"] <= e["start_ms"] + e["time_ms"] <= e["end_ms"]
        assert e["sample_ms"] >= 0


def test_costs_are_the_cost_model_of_each_pass(model):
    trace = Trace()
    run(model, trace, max_new_tokens=3)
    cfg, b = model.config, 4
    pre = trace.prefill
    expect = prefill_cost(cfg, len(PROMPT), b)
    assert (pre["flops"], pre["bytes"]) == (expect.flops, expect.bytes)
    assert pre["arithmetic_intensity_flop_per_byte"] == pytest.approx(expect.arithmetic_intensity)
    assert pre["kv_written_shape"] == [1, cfg.n_kv_heads, len(PROMPT), cfg.head_dim]
    assert pre["kv_written_bytes"] == len(PROMPT) * cfg.kv_bytes_per_token(b)
    for e in trace.decode_steps:
        expect = decode_cost(cfg, e["cache_length_after"], b)
        assert (e["flops"], e["bytes"]) == (expect.flops, expect.bytes)
        assert e["kv_bytes"] == e["cache_length_after"] * cfg.kv_bytes_per_token(b)
        assert e["attained_bytes_per_s"] == pytest.approx(e["bytes"] / (e["time_ms"] / 1e3))


# -- top-k candidates and how the token was chosen --------------------------------------------------


def test_topk_probabilities_match_a_softmax_of_the_step_logits(model):
    trace = Trace(keep=["logits"], n_candidates=5)
    steps = run(model, trace, max_new_tokens=6, temperature=0.9, top_k=4, seed=1)
    for e in trace.steps:
        logits = trace.activation("logits", e["step"])[0]
        probs = torch.softmax(logits.double(), dim=-1)
        top = torch.topk(probs, 5)
        got = [c["prob"] for c in e["candidates"]]
        assert sum(got) <= 1 + 1e-6
        assert got == pytest.approx(top.values.tolist(), abs=1e-6)
        assert [c["token_id"] for c in e["candidates"]] == top.indices.tolist()
        assert got == sorted(got, reverse=True)
        assert e["next_token_prob"] == pytest.approx(probs[e["next_token_id"]].item(), abs=1e-6)
        assert e["next_token_rank"] < 4  # top_k=4 sampling never picks beyond the 4th
        assert e["sampling"] == {"method": "sampled", "temperature": 0.9, "top_k": 4, "top_p": 1.0, "seed": 1}
    # the logits kept are the model's: an uncached full pass over the same tokens agrees
    ids = torch.tensor([PROMPT + [s.token_id for s in steps[:-1]]])
    with torch.inference_mode():
        full = model(ids)[0, len(PROMPT) - 1 :].float()
    kept = torch.stack([trace.activation("logits", i)[0] for i in range(len(steps))])
    torch.testing.assert_close(kept, full, atol=1e-4, rtol=1e-4)


def test_greedy_steps_say_greedy_and_pick_the_top_candidate(model):
    trace = Trace()
    run(model, trace, max_new_tokens=4)
    for e in trace.steps:
        assert e["sampling"] == {"method": "greedy"}
        assert e["next_token_rank"] == 0 and e["next_token_id"] == e["candidates"][0]["token_id"]
        assert e["next_token_logprob"] == pytest.approx(math.log(e["next_token_prob"]), abs=1e-6)


# -- no cost without a trace; tracing changes nothing -----------------------------------------------


def test_tracing_does_not_change_the_tokens(model):
    plain = [s.token_id for s in run(model, None, max_new_tokens=6)]
    for trace in (Trace(), Trace("layers", keep=["blocks.1.attn.hook_pattern", "blocks.*.hook_resid_post"])):
        assert [s.token_id for s in run(model, trace, max_new_tokens=6)] == plain
    assert model.attn_impl == "sdpa"  # switched to eager for the pattern, then restored


def test_without_a_trace_no_hook_is_installed(model, monkeypatch):
    seen = []
    original = type(model).forward

    def spy(self, token_ids, cache=None, hook=None, last_only=False):
        seen.append(hook)
        return original(self, token_ids, cache=cache, hook=hook, last_only=last_only)

    monkeypatch.setattr(type(model), "forward", spy)
    run(model, None, max_new_tokens=3)
    run(model, Trace(), max_new_tokens=3)  # level "steps": timing only, still no hook
    assert len(seen) >= 2 and seen == [None] * len(seen)  # (each prefill; a decode step the model's path replays
    # skips forward, and replays only without a hook)


# -- level "layers" and kept activations -----------------------------------------------------------


def test_layer_events_name_the_shapes_of_each_pass(model):
    cfg = model.config
    trace = Trace("layers")
    run(model, trace, max_new_tokens=3)
    layers = trace.layers()
    assert len(layers) == cfg.n_layers * 3
    for e in layers:
        T = len(PROMPT) if e["phase"] == "prefill" else 1
        S = len(PROMPT) + e["step"]
        assert e["name"] == f"blocks.{e['layer']}"
        assert e["attn_in_shape"] == e["attn_out_shape"] == e["mlp_in_shape"] == e["mlp_out_shape"] \
            == e["resid_post_shape"] == [1, T, cfg.d_model]
        assert e["q_shape"] == [1, cfg.n_heads, T, cfg.head_dim]
        assert e["k_shape"] == e["v_shape"] == [1, cfg.n_kv_heads, T, cfg.head_dim]
        assert e["k_cache_shape"] == e["v_cache_shape"] == [1, cfg.n_kv_heads, S, cfg.head_dim]
        assert e["time_ms"] >= 0
    assert sum(e["time_ms"] for e in trace.layers(0)) <= trace.prefill["time_ms"]


def test_kept_attention_pattern_is_causal_and_normalised(model):
    cfg = model.config
    trace = Trace("layers", keep=["blocks.1.attn.hook_pattern"])
    run(model, trace, max_new_tokens=3)
    assert sorted(trace.activations) == ["blocks.1.attn.hook_pattern"]
    pattern = trace.activation("blocks.1.attn.hook_pattern", step=0)  # [B, heads, T, S]
    T = len(PROMPT)
    assert pattern.shape == (1, cfg.n_heads, T, T)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(1, cfg.n_heads, T))
    assert torch.all(pattern.triu(diagonal=1) == 0)  # no query looks ahead
    assert trace.activation("blocks.1.attn.hook_pattern", step=2).shape == (1, cfg.n_heads, 1, T + 2)
    assert {e["attn_impl"] for e in trace.steps} == {"eager"}
    with pytest.raises(KeyError, match="was not kept"):
        trace.activation("blocks.0.attn.hook_pattern")


def test_kept_cache_is_a_copy_not_a_view(model):
    trace = Trace(keep=["blocks.0.attn.hook_k_cache"])
    run(model, trace, max_new_tokens=3)
    kept = trace.activations["blocks.0.attn.hook_k_cache"]
    first, last = kept[0], kept[-1]
    assert first.shape[2] == len(PROMPT) and last.shape[2] == len(PROMPT) + 2
    torch.testing.assert_close(last[:, :, : len(PROMPT)], first)


def test_the_users_hook_still_runs_when_tracing(model):
    names = []
    cache = KVCache.for_model(model, max_seq_len=16)
    prefill(model, PROMPT, cache, hook=lambda name, t: names.append(name), trace=Trace("layers"))
    assert names[0] == "hook_embed" and "blocks.1.hook_resid_post" in names and names[-1] == "ln_final.hook_normalized"


# -- prefill and decode_step on their own ---------------------------------------------------------


def test_prefill_and_decode_step_record_their_own_events(model):
    trace = Trace()
    cache = KVCache.for_model(model, max_seq_len=16)
    logits = prefill(model, PROMPT[:3], cache, trace=trace)
    prefill(model, PROMPT[3:], cache, trace=trace)  # a suffix onto a filled cache
    decode_step(model, logits.argmax(-1), cache, trace=trace)
    first, second = trace.of("prefill")
    assert (second["cached_tokens"], second["position_first"], second["cache_length_after"]) == (3, 3, len(PROMPT))
    assert trace.decode_steps[0]["position"] == len(PROMPT)
    assert "next_token_id" not in trace.decode_steps[0]  # no sampling happened
    assert trace.metrics is None
    kinds = [e["kind"] for e in trace.events]
    assert kinds == ["trace", "model", "prefill", "prefill", "decode"]


def test_batched_passes_are_traced(model):
    trace = Trace()
    cache = KVCache.for_model(model, batch_size=2, max_seq_len=8)
    logits = prefill(model, [[1, 2, 3], [4, 5, 6]], cache, trace=trace)
    decode_step(model, logits.argmax(-1), cache, trace=trace)
    assert trace.prefill["token_ids"] == [[1, 2, 3], [4, 5, 6]] and trace.prefill["batch_size"] == 2
    assert trace.prefill["flops"] == prefill_cost(model.config, 3, 4, batch_size=2).flops
    assert len(trace.decode_steps[0]["input_token_id"]) == 2


# -- other events, export, display ---------------------------------------------------------------


def test_any_kind_can_be_recorded(model):
    trace = Trace()
    event = trace.record("prefix_lookup", n_tokens=40, blocks_matched=2)
    assert isinstance(event, Event) and event.kind == "prefix_lookup" and "t_ms" in event
    with trace.span("tokenize", text="hi") as e:
        e["n_tokens"] = 1
    assert trace.first("tokenize")["time_ms"] >= 0
    assert [r["kind"] for r in trace.to_records()] == ["trace", "prefix_lookup", "tokenize"]


def test_roofline_verdicts_with_a_hardware_profile(model):
    trace = Trace(hardware=PROFILES["laptop-cpu"])
    run(model, trace, max_new_tokens=3)
    verdicts = trace.rooflines
    assert set(verdicts) == {"prefill", "decode"}
    assert verdicts["decode"]["n_passes"] == 2
    for r in verdicts.values():
        assert r["bound"] in ("compute-bound", "memory-bound", "overhead-bound") and r["explanation"]
        assert r["cpu_share"] > 0 and r["torch_threads"] == torch.get_num_threads()
    assert trace.metrics["mbu"] is not None


def test_jsonl_round_trips(model, tmp_path):
    trace = Trace("layers", keep=["logits"], hardware=PROFILES["laptop-cpu"])
    run(model, trace, max_new_tokens=4)
    trace.record("prefix_hit", blocks=["ab12"], positions=[0, 16])
    path = trace.to_jsonl(tmp_path / "trace.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == len(trace.events)
    assert all("kind" in json.loads(line) for line in lines)
    loaded = Trace.from_jsonl(path)
    assert loaded.to_records() == trace.to_records()
    assert (loaded.level, loaded.keep) == ("layers", ("logits",))
    assert len(loaded.decode_steps) == 3 and loaded.metrics["ttft_ms"] == trace.metrics["ttft_ms"]


def test_html_and_repr(model):
    trace = Trace()
    run(model, trace, max_new_tokens=3)
    page = show(trace)._repr_html_()
    assert "TTFT" in page and page.count("class='minillm-step'") == 3
    assert not any(tag in page for tag in ("<script", "<style", "<link", "http"))  # self-contained, sanitiser-safe
    assert "next_token_id" in trace.prefill._repr_html_()
    assert trace.decode_steps._repr_html_().count("<tr>") == 3  # a header, then one row per decode step
    assert repr(trace).startswith("Trace(level='steps'") and "decode=2" in repr(trace)
    assert repr(show(trace)) == repr(trace) and page == trace_html(trace)  # a notebook shows the trace's repr too


def test_bad_level_is_a_value_error():
    with pytest.raises(ValueError, match="steps, layers"):
        Trace("everything")


# -- one trace, one request; arguments checked up front -------------------------------------------


def test_a_second_request_in_one_trace_is_refused(model):
    trace = Trace()
    run(model, trace, max_new_tokens=3)
    n_events = len(trace.events)
    with pytest.raises(ValueError, match=r"already holds a request \(its metrics are recorded\).*new Trace\(\)"):
        run(model, trace, max_new_tokens=3)
    assert len(trace.events) == n_events  # refused before the pass: the first request's record is intact
    stopped = Trace()
    next(generate(model, PROMPT, SamplingParams(max_new_tokens=5), trace=stopped))  # stopped after 1 token
    with pytest.raises(ValueError, match=r"a token was already sampled"):
        run(model, stopped, max_new_tokens=2)


def test_the_clock_starts_with_the_request_not_the_trace(model):
    import time

    trace = Trace()
    time.sleep(0.05)  # a notebook: the Trace made in one cell, generate() run in the next
    waited = time.perf_counter()
    run(model, trace, max_new_tokens=2)
    assert trace.metrics["ttft_ms"] == pytest.approx(trace.prefill["end_ms"], abs=1e-6)
    # the wait is not counted: the clock restarted after it (an order, whatever the machine's load)
    assert waited <= trace.start_s and trace.prefill["start_ms"] >= 0



@pytest.mark.parametrize("kwargs, message", [
    (dict(n_candidates=2.5), "n_candidates must be an int >= 0, got 2.5"),
    (dict(n_candidates=-1), "n_candidates must be an int >= 0, got -1"),
    (dict(keep=[3]), r"keep must be activation names or glob patterns \(str\), got \[3\]"),
    (dict(tokenizer=object()), r"tokenizer must be minillm's \(load_tokenizer\), got object"),
    (dict(hardware="h100"), "hardware must be a HardwareProfile"),
])
def test_bad_trace_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Trace(**kwargs)


@pytest.mark.parametrize("path, decode_impl", [("matvec", "c"), ("row-major+split", "sdpa"), (None, "sdpa")])
def test_a_decode_pass_names_the_attention_it_ran(model, path, decode_impl):
    """On the "matvec" decode path a decode step's attention is minillm/fast/kernels.py's C loop (was
    labelled "sdpa"); prefill stays SDPA, and so does every pass on the plain modules (path None).
    The tokens are the plain modules' either way."""
    from minillm.fast import kernels
    from minillm.fast.choose import apply_decode_path

    if path == "matvec" and not kernels.available():
        pytest.skip("needs the C kernels")
    pure = load_model(model.source, device="cpu", fast=False)
    traced = pure if path is None else apply_decode_path(load_model(model.source, device="cpu", fast=False), path)
    trace = Trace()
    steps = run(traced, trace, max_new_tokens=3)
    assert [s.token_id for s in steps] == [s.token_id for s in run(pure, None, max_new_tokens=3)]
    assert trace.first("model")["decode_path"] == path
    assert trace.prefill["attn_impl"] == "sdpa"
    assert [e["attn_impl"] for e in trace.decode_steps] == [decode_impl] * 2
