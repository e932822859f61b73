"""ChatSession (minillm/chat.py) on the real default model: a turn prefills only what the
KV cache does not already hold, and answers exactly as a fresh request on the whole
rendered conversation would (greedy, token for token)."""

import subprocess
import sys
from pathlib import Path

import pytest

from minillm import SamplingParams, generate, load_model, load_tokenizer
from minillm.chat import ChatSession, common_prefix_len
from minillm.errors import CacheFullError
from minillm.tokenizer import Tokenizer

PARAMS = SamplingParams(max_new_tokens=12)


@pytest.fixture(scope="module")
def model(smollm2_dir):
    return load_model(smollm2_dir)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def rendered(tokenizer, messages) -> list[int]:
    """The oracle prompt: the chat template over the whole conversation, as a stateless server renders it."""
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def fresh_answer(model, tokenizer, messages) -> list[int]:
    """Greedy tokens of a fresh request (empty cache) on the whole rendered conversation."""
    eos = tokenizer.eos_token_ids | set(model.config.eos_token_ids)
    return [s.token_id for s in generate(model, rendered(tokenizer, messages), PARAMS, eos_token_ids=eos)]


@pytest.mark.parametrize("a, b, expected", [
    ([], [1, 2], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2, 3], [1, 5, 3], 1), ([4], [1], 0),
])
def test_common_prefix_len(a, b, expected):
    assert common_prefix_len(a, b) == expected


def test_second_turn_reuses_the_cache_and_answers_like_a_fresh_request(model, tokenizer):
    chat = ChatSession(model, tokenizer, system="You are a geography teacher.", params=PARAMS)
    first = [s.token_id for s in chat.send("What is the capital of France?")]
    turn1 = chat.last_turn
    assert turn1.reused_tokens == 0
    assert turn1.prompt_tokens == turn1.prefill_tokens == len(rendered(tokenizer, chat.messages[:2]))
    # The cache holds the prompt and every answer token but the last (sampled, never fed back).
    assert chat.cache_ids == rendered(tokenizer, chat.messages[:2]) + first[:-1]
    assert chat.cache.length == len(chat.cache_ids)

    held = list(chat.cache_ids)
    second = [s.token_id for s in chat.send("And of Germany?")]
    turn2 = chat.last_turn
    conversation = [{"role": "system", "content": "You are a geography teacher."},
                    {"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": tokenizer.decode(first)},
                    {"role": "user", "content": "And of Germany?"}]
    prompt2 = rendered(tokenizer, conversation)
    assert turn2.prompt_tokens == len(prompt2)
    assert turn2.reused_tokens == common_prefix_len(held, prompt2) > turn1.prompt_tokens
    assert turn2.prefill_tokens == len(prompt2) - turn2.reused_tokens
    assert second == fresh_answer(model, tokenizer, conversation)
    assert chat.messages == conversation + [{"role": "assistant", "content": tokenizer.decode(second)}]


def test_reset_empties_the_cache_and_keeps_the_system_message(model, tokenizer):
    chat = ChatSession(model, tokenizer, system="Be brief.", params=PARAMS)
    list(chat.send("Hi!"))
    assert chat.cache.length > 0
    chat.reset()
    assert (chat.cache.length, chat.cache_ids, chat.last_turn) == (0, [], None)
    assert chat.messages == [{"role": "system", "content": "Be brief."}]
    list(chat.send("Hi!"))
    assert chat.last_turn.reused_tokens == 0


def test_new_system_message_reuses_only_the_common_prefix(model, tokenizer):
    chat = ChatSession(model, tokenizer, system="Be brief.", params=PARAMS)
    list(chat.send("Hi!"))
    held = list(chat.cache_ids)
    chat.set_system("Answer in French.")
    list(chat.send("Hi again!"))
    prompt = rendered(tokenizer, chat.messages[:-1])
    assert chat.messages[0] == {"role": "system", "content": "Answer in French."}
    assert chat.last_turn.reused_tokens == common_prefix_len(held, prompt) == 3  # <|im_start|> system \n


def test_interrupted_turn_leaves_the_conversation_and_keeps_the_cache_consistent(model, tokenizer):
    chat = ChatSession(model, tokenizer, params=PARAMS)
    steps = chat.send("Tell me a story.")
    next(steps)
    steps.close()  # the user pressed Ctrl-C after the first token
    assert chat.messages == [] and chat.last_turn is None
    prompt = rendered(tokenizer, [{"role": "user", "content": "Tell me a story."}])
    assert chat.cache_ids == prompt and chat.cache.length == len(prompt)  # the first token was never fed back
    list(chat.send("Tell me a story."))
    assert chat.last_turn.reused_tokens == len(prompt) - 1  # one token is always prefilled, for the logits


def test_full_context_drops_the_oldest_turn(model, tokenizer):
    chat = ChatSession(model, tokenizer, system="Be brief.", params=SamplingParams(max_new_tokens=8), max_context=76)
    list(chat.send("Hi!"))
    list(chat.send("What is 2 + 2?"))
    assert chat.last_turn.dropped_messages == 0
    before = list(chat.messages)
    list(chat.send("And 3 + 3?"))
    kept = [before[0], *before[3:], {"role": "user", "content": "And 3 + 3?"}]
    assert len(rendered(tokenizer, before + [kept[-1]])) + 8 > 76  # it did not fit: the first pair had to go
    assert chat.last_turn.dropped_messages == 2
    assert chat.last_turn.prompt_tokens == len(rendered(tokenizer, kept)) <= 76 - 8
    assert chat.messages[:-1] == kept


def test_a_message_longer_than_the_context_is_a_clear_error(model, tokenizer):
    chat = ChatSession(model, tokenizer, params=PARAMS, max_context=32)
    with pytest.raises(CacheFullError, match="the chat's context is 32 tokens; send a shorter message"):
        list(chat.send("word " * 40))
    assert chat.messages == [] and chat.cache.length == 0


def test_bad_input_is_a_clear_error(model, tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        ChatSession(model, Tokenizer(tokenizer.backend))
    with pytest.raises(ValueError, match=r"max_context must be in \[1, 8192\]"):
        ChatSession(model, tokenizer, max_context=10**6)
    with pytest.raises(ValueError, match="the message is empty"):
        list(ChatSession(model, tokenizer).send("  "))


@pytest.mark.cli
def test_cli_chat_reads_lines_and_streams_answers(model, tokenizer, smollm2_dir):
    """`minillm chat` with a pipe for stdin: one message a line, answers on stdout, the reuse on stderr."""
    lines = ["What is the capital of France?", "/system Be brief.", "And of Germany?", "/reset", "/exit", "Hi"]
    run = subprocess.run([sys.executable, "-m", "minillm", "chat", "--model", str(smollm2_dir), "--max-new-tokens",
                          str(PARAMS.max_new_tokens)], input="\n".join(lines) + "\n", capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    chat = ChatSession(model, tokenizer, params=PARAMS)  # the oracle for the CLI: the library, same turns
    list(chat.send(lines[0]))
    turn1, held = chat.last_turn, list(chat.cache_ids)
    chat.set_system("Be brief.")
    list(chat.send(lines[2]))
    turn2 = chat.last_turn
    assert run.stdout == f"{turn1.text}\n{turn2.text}\n"  # nothing after /exit
    assert turn2.reused_tokens == common_prefix_len(held, rendered(tokenizer, chat.messages[:-1]))
    err = run.stderr.splitlines()
    assert err[0].startswith(f"[0 tokens reused, {turn1.prompt_tokens} prefilled | generated {len(turn1.token_ids)} tok")
    assert err[1] == "system message: 'Be brief.'"
    assert err[2].startswith(f"[{turn2.reused_tokens} tokens reused, {turn2.prefill_tokens} prefilled")
    assert err[3] == "conversation forgotten, KV cache emptied (0 tokens)" and len(err) == 4


CHAT_USAGE_ERRORS = [
    ("0", "--max-context must be >= 1, got 0"),
    # SmolLM2's template adds its default system message: 31 tokens around "Hi" (this exited 0, its error
    # printed after the first line was read)
    ("10", "--max-context 10 is too small: the message 'Hi' alone makes a 31-token prompt (the chat template "
           "and any system message included); give more than 31"),
]


@pytest.mark.cli
def test_cli_chat_bad_option_exits_2_in_the_command(smollm2_dir):
    """The process path of chat's usage errors (each of them below, in this process)."""
    max_context, message = CHAT_USAGE_ERRORS[0]
    run = subprocess.run([sys.executable, "-m", "minillm", "chat", "--model", str(smollm2_dir), "--max-context",
                          max_context], input="Hi\n", capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stderr, run.stdout) == (2, f"minillm: error: {message}\n", "")


@pytest.mark.parametrize("max_context, message", CHAT_USAGE_ERRORS)
def test_cli_chat_bad_options_are_usage_errors(run_main, smollm2_dir, max_context, message):
    run = run_main("chat", "--model", str(smollm2_dir), "--max-context", max_context, stdin="Hi\n")
    assert (run.returncode, run.stderr, run.stdout) == (2, f"minillm: error: {message}\n", "")


def test_a_stop_string_ends_the_answer_and_stays_out_of_the_history(model, tokenizer):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    full = tokenizer.decode(fresh_answer(model, tokenizer, question))  # the answer without a stop string
    chat = ChatSession(model, tokenizer, params=SamplingParams(max_new_tokens=12, stop=(" Paris",)))
    list(chat.send(question[0]["content"]))
    assert chat.last_turn.finish_reason == "stop"
    assert chat.last_turn.text == full[: full.index(" Paris")] == chat.messages[-1]["content"]


def test_an_empty_system_message_is_sent_not_dropped(model, tokenizer):
    # SmolLM2's template inserts its default persona only when there is no system message at all.
    chat = ChatSession(model, tokenizer, system="", params=PARAMS)
    assert chat.messages == [{"role": "system", "content": ""}]
    text = tokenizer.apply_chat_template(chat.messages + [{"role": "user", "content": "Hi"}])
    assert "SmolLM" not in text
    assert text == tokenizer.apply_chat_template([{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}])


@pytest.mark.parametrize(("kwargs", "ending"), [
    ({}, "<|im_start|>assistant\n"),
    ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
])  # fmt: skip
def test_chat_template_kwargs_reach_the_template(model, smollm2_dir, kwargs, ending):
    """Qwen3's template (ChatML, as SmolLM2's) on SmolLM2's tokenizer: enable_thinking=False opens
    the answer with an empty thought (the prompt `minillm chat --no-enable-thinking` sends)."""
    tok = load_tokenizer(smollm2_dir)
    tok.chat_template = (Path(__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    chat = ChatSession(model, tok, params=PARAMS, chat_template_kwargs=kwargs)
    expected = tok.encode("<|im_start|>user\nHi<|im_end|>\n" + ending, add_special_tokens=False)
    assert chat.prompt_ids([{"role": "user", "content": "Hi"}]) == expected
