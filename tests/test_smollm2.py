"""The default model, SmolLM2-135M-Instruct converted from its GGUF, against transformers
loading the same GGUF file: logits, greedy tokens, chat prompt and streamed text."""

import pytest
import torch

from minillm import SamplingParams, StreamDecoder, generate, load_model, load_tokenizer

pytestmark = pytest.mark.large

pytest.importorskip("transformers")  # the oracle


@pytest.fixture(scope="module")
def model(smollm2_dir):
    return load_model(smollm2_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def chat_ids(tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def test_logits_on_a_30_token_prompt_match_transformers(model, tokenizer, hf_smollm2):
    ids = tokenizer.encode("The KV cache stores keys and values so that decoding one token does not recompute "
                           "the whole prompt again and again, which would make every new token slower than the last.")[:30]
    assert len(ids) == 30
    ids = torch.tensor([ids])
    with torch.no_grad():
        diff = (model(ids) - hf_smollm2(ids).logits).abs().max().item()
    assert diff <= 1e-3


def test_32_greedy_tokens_match_transformers(model, hf_smollm2, chat_ids):
    prompt = torch.tensor([chat_ids])
    with torch.no_grad():
        hf_out = hf_smollm2.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = hf_out[0, len(chat_ids):].tolist()
    ours = [s.token_id for s in generate(model, chat_ids, SamplingParams(max_new_tokens=32), eos_token_ids=())]
    assert ours == expected


def test_answers_paris(model, tokenizer, chat_ids):
    steps = list(generate(model, chat_ids, SamplingParams(max_new_tokens=20)))
    assert steps[-1].finish_reason == "eos"
    assert "Paris" in tokenizer.decode([s.token_id for s in steps])


def test_streamed_text_equals_one_shot_decode(model, tokenizer):
    prompt = tokenizer.encode("Write three emoji and a Japanese greeting: ")
    params = SamplingParams(temperature=0.9, seed=4, max_new_tokens=40)
    ids = [s.token_id for s in generate(model, prompt, params, eos_token_ids=())]
    stream = StreamDecoder(tokenizer)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces[:-1])


def test_chat_prompt_equals_transformers(tokenizer, hf_smollm2_tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    expected = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages) == expected
