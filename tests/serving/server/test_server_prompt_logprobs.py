"""/v1/completions' ``echo`` and ``logprobs: N`` in OpenAI's legacy format (vLLM's), ``max_tokens: 0``,
and vLLM's /tokenize, /detokenize and /tokenizer_info. The oracle for every logprob is transformers'
log_softmax on the same random weights (a tiny Llama with SmolLM2's vocabulary and tokenizer).
"""

import json

import httpx
import openai
import pytest
import torch
from live_server import live_server
from tiny_models import CONFIGS, build_hf, save_hf

import minillm

TIMEOUT_S = 60.0
MODEL = "minillm-test"
PROMPT = "The quick brown fox jumps over the lazy dog. The cat"


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """(transformers model, minillm model, tokenizer) with the same random weights."""
    family, kwargs = CONFIGS["llama_gqa"]
    kwargs = dict(kwargs, vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    hf = build_hf(family, kwargs, seed=7)
    folder = save_hf(hf, tmp_path_factory.mktemp("echo_logprobs"))
    return hf, minillm.load_model(folder, device="cpu"), minillm.load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def server(weights):
    _, model, tokenizer = weights
    # a small token budget: a long prompt runs in chunks; block_size 4: short prompts hit the prefix cache
    with live_server(model, tokenizer, model_name=MODEL, num_blocks=256, block_size=4,
                     max_num_batched_tokens=16) as url:
        yield url


def complete(server, **body):
    r = httpx.post(f"{server}/v1/completions", json=dict(model=MODEL, temperature=0, **body), timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def hf_logprobs(hf, ids) -> torch.Tensor:
    """[len(ids), vocab]: row j is log p(. | ids[:j + 1])."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_legacy_logprobs(logprobs, ids, hf, tokenizer, n, echo=True):
    """The legacy object's four lists for ``ids`` (prompt then output), against transformers."""
    expected = hf_logprobs(hf, ids)
    strings = tokenizer.token_strings(ids)
    shown = ids if echo else ids[len(ids) - len(logprobs["tokens"]):]
    first = len(ids) - len(shown)
    assert logprobs["tokens"] == strings[first:]
    assert logprobs["text_offset"] == [sum(map(len, strings[first:j])) for j in range(first, len(ids))]
    if echo:
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for j in range(max(first, 1), len(ids)):
        got, top = logprobs["token_logprobs"][j - first], logprobs["top_logprobs"][j - first]
        row = expected[j - 1]
        assert got == pytest.approx(row[ids[j]].item(), abs=1e-4), f"token {j}"
        best = row.topk(n)
        want = {strings[j]: row[ids[j]].item(), **dict(zip(tokenizer.token_strings(best.indices.tolist()),
                                                           best.values.tolist()))}
        assert top.keys() == want.keys() and len(top) in (n, n + 1)
        assert list(top.values()) == pytest.approx(list(want.values()), abs=1e-4)


@pytest.mark.server
def test_echo_with_logprobs_is_the_legacy_format_with_transformers_values(server, weights):
    hf, _, tokenizer = weights
    out = complete(server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3)
    choice = out["choices"][0]
    prompt_ids = tokenizer.encode(PROMPT)
    assert choice["text"].startswith(PROMPT) and len(choice["logprobs"]["tokens"]) == len(prompt_ids) + 3
    generated = choice["logprobs"]["tokens"][len(prompt_ids):]
    assert "".join(generated) == choice["text"][len(PROMPT):]  # the text is the tokens' text
    ids = list(prompt_ids)  # the server decodes greedily: so does transformers here
    for _ in range(3):
        ids.append(int(hf_logprobs(hf, ids)[-1].argmax()))
    check_legacy_logprobs(choice["logprobs"], ids, hf, tokenizer, 2)
    assert out["usage"]["prompt_tokens"] == len(prompt_ids) and out["usage"]["completion_tokens"] == 3


@pytest.mark.server
def test_a_long_prompt_in_chunks_and_a_cached_prompt_keep_their_logprobs(server, weights):
    hf, _, tokenizer = weights
    ids = tokenizer.encode(PROMPT * 5)
    assert len(ids) > 3 * 16  # four chunks or more of the 16-token budget
    first = complete(server, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    plain = complete(server, prompt=ids, max_tokens=1)  # no logprobs: takes the prefix cache's hits
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 40
    again = complete(server, prompt=ids, echo=True, logprobs=1, max_tokens=0)  # a cached prompt: recomputed
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]
    check_legacy_logprobs(first["choices"][0]["logprobs"], ids, hf, tokenizer, 1)


@pytest.mark.server
def test_max_tokens_0_with_echo_returns_the_prompt_only(server, weights):
    hf, _, tokenizer = weights
    ids = tokenizer.encode(PROMPT)
    out = complete(server, prompt=[ids], echo=True, logprobs=0, max_tokens=0)  # lm-eval's batch of one
    choice = out["choices"][0]
    assert choice["text"] == tokenizer.decode(ids) == PROMPT and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                            "prompt_tokens_details": {"cached_tokens": 0},
                            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    check_legacy_logprobs(choice["logprobs"], ids, hf, tokenizer, 0)
    no_logprobs = complete(server, prompt=PROMPT, echo=True, max_tokens=0)["choices"][0]
    assert (no_logprobs["text"], no_logprobs["logprobs"]) == (PROMPT, None)


@pytest.mark.eval
def test_lm_eval_payload_scores_the_continuation(server, weights):
    """lm-eval's local-completions loglikelihood request (lm_eval/models/openai_completions.py):
    prompt ids as a batch of one, echo, logprobs 1, max_tokens 1, temperature 0, a seed; it sums
    ``token_logprobs[ctxlen:-1]`` and calls the continuation greedy when each equals its top's max."""
    hf, _, tokenizer = weights
    context, continuation = tokenizer.encode("Question: what colour is the sky?\nAnswer:"), tokenizer.encode(" blue")
    payload = {"model": MODEL, "prompt": [context + continuation], "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}
    out = httpx.post(f"{server}/v1/completions", json=payload, timeout=TIMEOUT_S).json()
    logprobs = out["choices"][0]["logprobs"]
    ctxlen = len(context)
    got = sum(logprobs["token_logprobs"][ctxlen:-1])
    is_greedy = all(t == max(top.values()) for t, top in zip(logprobs["token_logprobs"][ctxlen:-1],
                                                             logprobs["top_logprobs"][ctxlen:-1]))
    ids = context + continuation
    expected = hf_logprobs(hf, ids)
    want = sum(expected[j - 1, ids[j]].item() for j in range(ctxlen, len(ids)))
    want_greedy = all(expected[j - 1].argmax().item() == ids[j] for j in range(ctxlen, len(ids)))
    assert got == pytest.approx(want, abs=1e-4) and is_greedy == want_greedy


@pytest.mark.server
def test_logprobs_without_echo_cover_the_output_only(server, weights):
    hf, _, tokenizer = weights
    ids = tokenizer.encode(PROMPT)
    out = complete(server, prompt=ids, logprobs=3, max_tokens=4)
    choice = out["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == 4 and not choice["text"].startswith(PROMPT)
    full = list(ids)
    for _ in range(4):
        full.append(int(hf_logprobs(hf, full)[-1].argmax()))
    check_legacy_logprobs(choice["logprobs"], full, hf, tokenizer, 3, echo=False)
    assert choice["logprobs"]["text_offset"][0] == 0  # vLLM's: offsets into the returned text


@pytest.mark.server
def test_streaming_echo_sends_the_prompt_in_the_first_chunk(server):
    body = dict(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0)
    whole = complete(server, **{k: v for k, v in body.items() if k not in ("model", "temperature")})
    with httpx.stream("POST", f"{server}/v1/completions", json=dict(body, stream=True), timeout=TIMEOUT_S) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((c["logprobs"][field] for c in choices), []) == whole["choices"][0]["logprobs"][field], field
    zero = dict(body, stream=True, max_tokens=0)
    with httpx.stream("POST", f"{server}/v1/completions", json=zero, timeout=TIMEOUT_S) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [(PROMPT, "length")]


@pytest.mark.server
def test_openai_client_reads_echo_and_logprobs(server, weights):
    _, _, tokenizer = weights
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as client:
        r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    logprobs = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT and logprobs.tokens == tokenizer.token_strings(tokenizer.encode(PROMPT))
    assert logprobs.token_logprobs[0] is None and all(lp < 0 for lp in logprobs.token_logprobs[1:])
    assert len(logprobs.text_offset) == len(logprobs.top_logprobs) == len(logprobs.tokens)
    assert r.usage.completion_tokens == 0


@pytest.mark.server
def test_tokenize_and_detokenize_round_trip(server, weights):
    _, _, tokenizer = weights
    text = "Hello, wörld! 🙂 <|im_start|>"
    r = httpx.post(f"{server}/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=TIMEOUT_S).json()
    ids = tokenizer.encode(text)
    assert r == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": tokenizer.token_strings(ids)}
    back = httpx.post(f"{server}/detokenize", json={"tokens": r["tokens"]}, timeout=TIMEOUT_S).json()
    assert back == {"prompt": text}
    lm_eval_style = httpx.post(f"{server}/tokenize", json={"prompt": "test", "add_special_tokens": False},
                               timeout=TIMEOUT_S).json()
    assert lm_eval_style["tokens"] == tokenizer.encode("test", add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{server}/tokenize", json={"messages": messages}, timeout=TIMEOUT_S).json()
    assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    info = httpx.get(f"{server}/tokenizer_info", timeout=TIMEOUT_S).json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 512


@pytest.mark.server
@pytest.mark.parametrize("path, body, param, fragment", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages", "one of them"),
    ("/tokenize", {}, "messages", "one of them"),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, "model", "does not exist"),
    ("/detokenize", {"tokens": [10**9]}, "tokens", "not in the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, "tokens", "array"),
])
def test_bad_tokenize_requests_are_openai_errors(server, path, body, param, fragment):
    r = httpx.post(f"{server}{path}", json=body, timeout=TIMEOUT_S)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"]
