"""Every logits row the engine samples from equals a single-request run's (within 1e-4, float32).

Tiny random models of several families (GQA, MQA with tied embeddings, GPT-2's learned
positions, an explicit head_dim) go through the engine with requests arriving at
different steps, chunked prefill, a prefix-cache hit and preemption. The oracle for each
request is :func:`~minillm.phases.prefill` of its prompt on a plain ``KVCache``, then
:func:`~minillm.phases.decode_step` of each token the engine chose.
"""

from collections import defaultdict

import pytest
import torch

import minillm.serving.engine as engine_module
from minillm import KVCache, LLMEngine, SamplingParams, decode_step, prefill
from minillm.serving.model_runner import run_model

MAX_NEW = 6
CONFIG_NAMES = ["llama_gqa", "llama_mqa_tied", "gpt2", "llama_head_dim", "llama3_scaling"]


def record_logits(monkeypatch) -> dict[str, list[torch.Tensor]]:
    """Wrap the engine's forward pass: request id -> the logits rows it sampled from, in order."""
    rows = defaultdict(list)

    def recording_run_model(model, cache, scheduled):
        sampling, logits = run_model(model, cache, scheduled)
        for request, row in zip(sampling, logits):
            rows[request.request_id].append(row.clone())
        return sampling, logits

    monkeypatch.setattr(engine_module, "run_model", recording_run_model)
    return rows


def alone_logits(model, prompt, tokens) -> torch.Tensor:
    """[len(tokens), vocab]: prefill the prompt, then decode each given token, on a plain KV cache."""
    cache = KVCache.for_model(model, max_seq_len=len(prompt) + len(tokens))
    rows = [prefill(model, prompt, cache)[0]]
    for token in tokens[:-1]:
        rows.append(decode_step(model, token, cache)[0])
    return torch.stack(rows)


def run_engine(model, prompts, **knobs):
    """Two waves of requests: three at once, two steps, then the rest (one shares a prefix)."""
    engine = LLMEngine(model, block_size=4, eos_token_ids=(), **knobs)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    for p in prompts[:3]:
        engine.add_request(p, params)
    engine.step()
    engine.step()
    for p in prompts[3:]:
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def make_prompts(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 17, 16, 9, 30)]
    prompts.append(prompts[1][:13] + prompts[0])  # 3 full blocks of request 1: a prefix-cache hit
    return prompts


@pytest.mark.parametrize("knobs", [
    dict(num_blocks=64, max_num_batched_tokens=12),  # chunked prefill: 12-token steps
    dict(num_blocks=64, max_num_batched_tokens=64, enable_chunked_prefill=False),
    dict(num_blocks=12, max_num_batched_tokens=16),  # 48 positions for ~100: preemption
], ids=["chunked", "whole-prompts", "preemption"])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_engine_logits_equal_single_request_logits(tiny_model, monkeypatch, name, knobs):
    model = tiny_model(name)
    prompts = make_prompts(model.config.vocab_size)
    rows = record_logits(monkeypatch)
    engine = run_engine(model, prompts, **knobs)
    for rid, prompt in zip(engine.requests, prompts):
        request = engine.requests[rid]
        assert request.finish_reason == "length" and len(request.output_ids) == MAX_NEW
        expected = alone_logits(model, prompt, request.output_ids)
        got = torch.stack(rows[rid])
        for i, (g, e) in enumerate(zip(got, expected)):  # the first step that differs, by name
            torch.testing.assert_close(g, e, atol=1e-4, rtol=0, msg=lambda m: f"request {rid}, token {i}: {m}")
        assert request.output_ids == expected.argmax(-1).tolist()
    if knobs["num_blocks"] == 12:
        assert sum(r.num_preemptions for r in engine.requests.values()) > 0
    else:
        assert engine.requests["5"].num_cached_tokens == 12
    assert all(b.ref_count == 0 for b in engine.cache.allocator.blocks)
