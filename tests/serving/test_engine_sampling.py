"""Seeded sampling in a batch draws the same tokens as the same seed alone with ``generate``.

Each request carries its own ``torch.Generator`` (seeded from its ``SamplingParams.seed``)
across steps, so what else is in the batch, and in which order requests arrive, cannot
change its draws. Penalties read each request's own prompt and output.
"""

import pytest
import torch

from minillm import LLMEngine, SamplingParams, generate

MAX_NEW = 8


def alone(model, prompt, params):
    return [s.token_id for s in generate(model, prompt, params, eos_token_ids=())]


def params_for(kind, seed):
    if kind == "top-p":
        return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_new_tokens=MAX_NEW)
    if kind == "penalties":
        return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.3, presence_penalty=0.5,
                              frequency_penalty=0.3, seed=seed, max_new_tokens=MAX_NEW)
    return SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, max_new_tokens=MAX_NEW)  # greedy + penalties


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
def test_seeded_requests_in_a_batch_draw_their_alone_tokens(tiny_model, name):
    model = tiny_model(name)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 11, 20, 6, 14, 9)]
    kinds = ["top-p", "penalties", "greedy-penalties"] * 2
    params = [params_for(kind, seed=100 + i) for i, kind in enumerate(kinds)]
    expected = [alone(model, p, sp) for p, sp in zip(prompts, params)]
    assert len({tuple(t) for t in expected[:2]}) == 2

    for order in (range(6), reversed(range(6))):  # the batch's order must not matter
        engine = LLMEngine(model, num_blocks=64, block_size=4, max_num_batched_tokens=16, eos_token_ids=())
        ids = {i: engine.add_request(prompts[i], params[i]) for i in list(order)[:3]}
        engine.step()
        ids |= {i: engine.add_request(prompts[i], params[i]) for i in list(order)[3:]}
        while engine.has_unfinished_requests():
            engine.step()
        for i, rid in ids.items():
            assert engine.requests[rid].output_ids == expected[i], f"prompt {i} ({kinds[i]}), order {list(order)}"


def test_the_same_seed_in_two_requests_draws_the_same_tokens(tiny_model):
    model = tiny_model("llama_gqa")
    engine = LLMEngine(model, num_blocks=32, block_size=4, eos_token_ids=())
    sp = params_for("top-p", seed=7)
    a, b, c = engine.generate([[1, 2, 3], [1, 2, 3], [1, 2, 3]], [sp, sp, params_for("top-p", seed=8)])
    assert a.token_ids == b.token_ids == alone(model, [1, 2, 3], sp)
    assert c.token_ids == alone(model, [1, 2, 3], params_for("top-p", seed=8))
