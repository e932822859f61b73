"""The engine stops a request exactly where ``generate`` does: EOS, a stop id, max_tokens,
and stop strings (with a tokenizer: the same text as generate's steps joined, the stop
string and what follows cut out, a partial match at the end released)."""

import pytest
import torch

from minillm import LLMEngine, SamplingParams, generate


def alone(model, prompt, params, eos=(), tokenizer=None):
    steps = list(generate(model, prompt, params, eos_token_ids=eos, tokenizer=tokenizer))
    text = "".join(s.text for s in steps) if tokenizer else None
    return [s.token_id for s in steps], steps[-1].finish_reason, steps[-1].stop_reason, text


def test_eos_stop_ids_and_max_tokens_equal_generate(tiny_model):
    model = tiny_model("llama_gqa")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 9, 13)]
    free_run = [alone(model, p, SamplingParams(max_new_tokens=10))[0] for p in prompts]
    cases = [  # (prompt, params, eos ids)
        (prompts[0], SamplingParams(max_new_tokens=10), [free_run[0][4]]),  # ends on EOS
        (prompts[1], SamplingParams(max_new_tokens=10, stop_token_ids=[free_run[1][3]]), []),
        (prompts[2], SamplingParams(max_new_tokens=5), []),
    ]
    for prompt, params, eos in cases:
        engine = LLMEngine(model, num_blocks=32, block_size=4, eos_token_ids=eos)
        out = engine.generate([prompts[0], prompt, prompts[2]], params)[1]  # in a batch of three
        tokens, reason, stop_reason, _ = alone(model, prompt, params, eos)
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (tokens, reason, stop_reason)
    assert [c[1].max_new_tokens for c in cases] == [10, 10, 5]


STOP_CASES = [  # (prompt text, stop strings): what generate gives, the engine must give
    ("1, 2, 3, 4, 5,", ["8,"]),  # the stop string spans two tokens ('8', ',')
    ("1, 2, 3, 4, 5,", ["9, 10"]),  # never completed: '9,' held back, then released at max_tokens
    ("The capital of France is", ["swer is", "Paris!"]),  # inside a token (' answer'); the other never
    ("def add(a, b):\n", ["function"]),
]


@pytest.fixture
def stop_cases(smollm2):
    """(prompts, params, generate's (tokens, finish_reason, stop_reason, text) for each)."""
    model, tok = smollm2
    prompts = [tok.encode(text) for text, _ in STOP_CASES]
    params = [SamplingParams(max_new_tokens=12, stop=stop) for _, stop in STOP_CASES]
    return prompts, params, [alone(model, p, sp, eos=None, tokenizer=tok) for p, sp in zip(prompts, params)]


@pytest.mark.large
def test_stop_strings_give_generate_text(smollm2, stop_cases):
    model, tok = smollm2
    prompts, params, expected = stop_cases
    engine = LLMEngine(model, tok, num_blocks=16, block_size=16, max_num_batched_tokens=16)  # prompts in chunks
    outs = engine.generate(prompts, params)
    for out, want in zip(outs, expected):
        assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == want
    assert [o.finish_reason for o in outs] == ["stop", "length", "stop", "stop"]
    assert outs[0].text.endswith("7, ") and outs[1].text.endswith("9,")
