"""minillm serve on the real default model: greedy output through HTTP equals generate token for token,
streamed without cutting a character (each 🐦 is three byte-level tokens in SmolLM2's vocabulary)."""

import openai
import pytest
from live_server import live_server

import minillm

TIMEOUT_S = 120.0


@pytest.mark.server
def test_greedy_stream_equals_generate_token_for_token(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "Write three emojis of animals."}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    steps = list(minillm.generate(model, prompt_ids, minillm.SamplingParams(max_new_tokens=12), tokenizer=tokenizer))
    ids = [s.token_id for s in steps]
    assert sum("\ufffd" in tokenizer.decode([i]) for i in ids) >= 8  # most tokens are pieces of a character

    with live_server(model, tokenizer, model_name="smollm2", kv_cache_memory="64MiB") as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as client:
            chunks = list(client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=12, temperature=0, logprobs=True, stream=True,
                stream_options={"include_usage": True}))
    token_chunks = [c for c in chunks[1:] if c.choices]
    assert [c.choices[0].logprobs.content[0].token for c in token_chunks] == tokenizer.token_strings(ids)
    raw = b"".join(bytes(c.choices[0].logprobs.content[0].bytes) for c in token_chunks)
    assert raw.decode() == tokenizer.decode(ids)  # the tokens' bytes, joined, are the answer's UTF-8
    assert [c.choices[0].delta.content or "" for c in token_chunks] == [s.text for s in steps]  # same pieces
    assert all("\ufffd" not in (c.choices[0].delta.content or "") for c in token_chunks)
    assert any(len(char.encode()) == 4 for char in "".join(s.text for s in steps))  # an emoji came through whole
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == len(prompt_ids)
