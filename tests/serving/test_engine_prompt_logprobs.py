"""Prompt logprobs (vLLM's ``prompt_logprobs``, what ``echo`` + ``logprobs`` serves): every prompt
token's logprob and top k equal transformers' log_softmax over the same weights, with the prompt
cut into chunked-prefill chunks and with its blocks already in the prefix cache.
"""

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

import minillm
import minillm.serving.engine as engine_module
from minillm import LLMEngine, SamplingParams
from minillm.serving.model_runner import run_model

K = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, minillm model) with the same random weights (llama_gqa: vocab 128)."""
    family, kwargs = CONFIGS["llama_gqa"]
    hf = build_hf(family, kwargs)
    folder = save_hf(hf, tmp_path_factory.mktemp("prompt_logprobs"))
    return hf, minillm.load_model(folder, device="cpu")


def hf_logprobs(hf, prompt) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: log_softmax of transformers' logits; row j scores token j + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def assert_prompt_logprobs_equal_hf(entries, hf, prompt, k=K):
    assert len(entries) == len(prompt) and entries[0] is None
    expected = hf_logprobs(hf, prompt)
    for j, (logprob, top) in enumerate(entries[1:]):
        assert logprob == pytest.approx(expected[j, prompt[j + 1]].item(), abs=1e-4), f"token {j + 1}"
        want = expected[j].topk(k)
        assert [i for i, _ in top] == want.indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(want.values.tolist(), abs=1e-4)


def run(engine, prompt, **kwargs):
    request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=kwargs.pop("max_new_tokens", 2)), **kwargs)
    last = None
    while engine.has_unfinished_requests():
        last = next((o for o in engine.step() if o.request_id == request_id), last)
    return last


def prompt_of(n, seed=1):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompt_logprobs_equal_transformers_with_chunked_prefill(models):
    hf, model = models
    prompt = prompt_of(45)
    engine = LLMEngine(model, num_blocks=64, block_size=4, max_num_batched_tokens=16, eos_token_ids=())
    out = run(engine, prompt, prompt_logprobs=K, logprobs=K)
    prefill_chunks = [n for step in engine.steps for _, n, _ in step.scheduled if n]
    assert prefill_chunks == [16, 16, 13]  # the prompt ran in three chunks
    assert_prompt_logprobs_equal_hf(out.prompt_logprobs, hf, prompt)
    # the output tokens' logprobs are still right: the first one's from the prompt's last position
    with torch.no_grad():
        last = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert out.logprobs[0][0] == pytest.approx(last[out.token_ids[0]].item(), abs=1e-4)


def test_a_cached_prompt_is_computed_again_for_its_logprobs(models):
    hf, model = models
    prompt = prompt_of(30, seed=2)
    engine = LLMEngine(model, num_blocks=64, block_size=4, eos_token_ids=())
    first = run(engine, prompt)
    assert first.prompt_logprobs is None  # not asked: not computed
    again = run(engine, prompt)
    assert again.num_cached_tokens == 28  # the prompt's blocks are in the prefix cache ...
    asked = run(engine, prompt, prompt_logprobs=K)
    assert asked.num_cached_tokens == 0  # ... but not taken by a request that needs their logits
    assert_prompt_logprobs_equal_hf(asked.prompt_logprobs, hf, prompt)
    assert asked.token_ids == first.token_ids
    # and in one batch with a request that does take the hits
    a = engine.add_request(prompt, SamplingParams(max_new_tokens=2))
    b = engine.add_request(prompt + [5, 6], SamplingParams(max_new_tokens=2), prompt_logprobs=1)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs[a].num_cached_tokens == 28 and outs[b].num_cached_tokens == 0
    assert_prompt_logprobs_equal_hf(outs[b].prompt_logprobs, hf, prompt + [5, 6], k=1)


def test_after_a_preemption_kept_prompt_logprobs_are_not_computed_twice(models):
    hf, model = models
    prompt = prompt_of(20, seed=3)
    engine = LLMEngine(model, num_blocks=64, block_size=4, eos_token_ids=())
    request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=4), prompt_logprobs=2)
    engine.step()  # the whole prompt and the first token
    request = engine.requests[request_id]
    assert len(request.prompt_logprobs) == 19 and request.prompt_logits_from is None
    engine.scheduler._preempt(request, engine.scheduler.schedule())  # as the scheduler does when the pool is short
    steps_before = len(engine.steps)
    while engine.has_unfinished_requests():
        engine.step()
    recompute = engine.steps[steps_before].scheduled
    assert [(rid, p + d) for rid, p, d in recompute] == [(request_id, 1)]  # its prompt's 5 blocks were hits
    final = engine._output(request, None)
    assert request.num_preemptions == 1 and len(final.token_ids) == 4
    assert_prompt_logprobs_equal_hf(final.prompt_logprobs, hf, prompt, k=2)  # kept once, not twice


def test_the_plain_path_computes_one_logits_row_per_sampling_request(models, monkeypatch):
    _, model = models
    shapes = []

    def recording(model, cache, scheduled):
        sampling, logits = run_model(model, cache, scheduled)
        shapes.append((len(sampling), logits.shape[0]))
        return sampling, logits

    monkeypatch.setattr(engine_module, "run_model", recording)
    engine = LLMEngine(model, num_blocks=64, block_size=4, eos_token_ids=())
    run(engine, prompt_of(25), max_new_tokens=3)
    assert shapes and all(rows == n for n, rows in shapes)
    shapes.clear()
    run(engine, prompt_of(25, seed=4), max_new_tokens=3, prompt_logprobs=0)
    assert shapes[0] == (1, 1 + 24) and all(rows == n for n, rows in shapes[1:])  # 24 prompt rows, once


@pytest.mark.parametrize("k", [-1, True, "3", 1.5])
def test_bad_prompt_logprobs_are_value_errors(models, k):
    engine = LLMEngine(models[1], num_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="prompt_logprobs must be None or a number of top tokens"):
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2), prompt_logprobs=k)
    assert not engine.requests
