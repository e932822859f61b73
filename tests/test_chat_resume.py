"""A conversation that outlives the process (minillm/chat.py's ``kv_store``, ``save``, ``resume``): a second
ChatSession on the same folder, as after a restart, loads the first one's K/V from the disk tier bit for bit,
reuses it (``reused_tokens`` > 0), and answers as the first session would have gone on and as a fresh session
that recomputes everything (greedy, token for token). On tiny_chat: a random model with SmolLM2's template."""

import json
import shutil

import pytest
import torch
from tiny_models import CONFIGS, build_hf, save_hf

from minillm import SamplingParams
from minillm.chat import BLOCK_SIZE, ChatSession, common_prefix_len
from minillm.serving.kv_tiers import DiskTier

PARAMS = SamplingParams(max_new_tokens=12)
QUESTIONS = ("What is the capital of France?", "And of Germany?")


def session(tiny_chat, folder=None) -> ChatSession:
    model, tokenizer = tiny_chat
    store = DiskTier.for_model(folder, model, block_size=BLOCK_SIZE) if folder is not None else None
    return ChatSession(model, tokenizer, system="Be brief.", params=PARAMS, kv_store=store)


def answer(chat: ChatSession, text: str) -> list[int]:
    return [step.token_id for step in chat.send(text)]


def test_a_resumed_chat_loads_the_stored_kv_and_answers_as_if_it_never_stopped(tiny_chat, tmp_path):
    first = session(tiny_chat, tmp_path)
    answer(first, QUESTIONS[0])
    first.save(tmp_path / "conversation.json")
    held_ids, held_k, held_v = list(first.cache_ids), first.cache.k.clone(), first.cache.v.clone()

    second = session(tiny_chat, tmp_path)  # a new process, in effect: nothing shared but the folder
    loaded = second.resume(tmp_path / "conversation.json")
    assert second.messages == first.messages
    # the oracle for what can load: the full blocks of the ids the first cache held that the conversation,
    # rendered again from its text, starts with
    rendered = second.prompt_ids(add_generation_prompt=False)
    assert loaded == BLOCK_SIZE * (common_prefix_len(held_ids, rendered) // BLOCK_SIZE) > 0
    assert second.cache.length == len(second.cache_ids) == loaded and second.cache_ids == held_ids[:loaded]
    assert torch.equal(second.cache.k[:, :, :, :loaded], held_k[:, :, :, :loaded])  # the disk kept every bit
    assert torch.equal(second.cache.v[:, :, :, :loaded], held_v[:, :, :, :loaded])

    resumed = answer(second, QUESTIONS[1])
    assert second.last_turn.reused_tokens == loaded
    assert second.last_turn.prefill_tokens == second.last_turn.prompt_tokens - loaded
    assert resumed == answer(first, QUESTIONS[1])  # the session that never stopped

    fresh = session(tiny_chat)  # no store: the same conversation, every token prefilled
    assert fresh.resume(tmp_path / "conversation.json") == 0
    assert answer(fresh, QUESTIONS[1]) == resumed and fresh.last_turn.reused_tokens == 0


def test_each_turn_puts_only_its_new_full_blocks(tiny_chat, tmp_path):
    chat = session(tiny_chat, tmp_path)
    for question in QUESTIONS:
        answer(chat, question)
        stored = sorted(p.stem for p in chat.kv_store.path.glob("*.kv"))
        assert len(stored) == len(chat.cache_ids) // BLOCK_SIZE  # one file per full block the cache holds


def test_save_is_atomic_json_and_a_bad_file_is_one_clear_error(tiny_chat, tmp_path):
    chat = session(tiny_chat)
    answer(chat, QUESTIONS[0])
    chat.save(tmp_path / "conversation.json")
    assert json.loads((tmp_path / "conversation.json").read_text()) == {"messages": chat.messages}
    assert [p.name for p in tmp_path.iterdir()] == ["conversation.json"]  # no temporary file left
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "user"}]}')
    for name in ("bad.json", "missing.json"):
        with pytest.raises(ValueError, match=f"{name} holds no saved conversation"):
            chat.resume(tmp_path / name)


# -- minillm chat --kv-offload-dir --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_chat_folder(tmp_path_factory, smollm2_dir):
    """tiny_chat's model as a folder the CLI loads: a random Llama with SmolLM2's tokenizer and template."""
    family, kwargs = CONFIGS["llama_gqa"]
    kwargs = dict(kwargs, vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    folder = save_hf(build_hf(family, kwargs), tmp_path_factory.mktemp("tiny_chat_cli"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder


def test_cli_chat_resumes_from_the_folder_and_reset_starts_over(run_main, tiny_chat_folder, tmp_path):
    chat = ("chat", "--model", str(tiny_chat_folder), "--max-new-tokens", "6", "--kv-offload-dir", str(tmp_path))
    first = run_main(*chat, stdin=f"{QUESTIONS[0]}\n")
    assert first.returncode == 0, first.stderr
    saved = json.loads((tmp_path / "conversation.json").read_text())["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"] and saved[0]["content"] == QUESTIONS[0]

    second = run_main(*chat, stdin=f"{QUESTIONS[1]}\n")
    assert second.returncode == 0, second.stderr
    resumed, turn = second.stderr.splitlines()[:2]
    loaded = int(resumed.split(" messages, ")[1].split()[0])
    assert resumed == (f"resumed the conversation in {tmp_path}: 2 messages, {loaded} tokens of KV cache loaded "
                       "from disk (/reset starts over)") and loaded > 0
    assert turn.startswith(f"[{loaded} tokens reused, ")
    assert len(json.loads((tmp_path / "conversation.json").read_text())["messages"]) == 4

    run_main(*chat, stdin="/reset\n")
    assert json.loads((tmp_path / "conversation.json").read_text()) == {"messages": []}
    third = run_main(*chat, stdin=f"{QUESTIONS[0]}\n")
    # after /reset nothing is left to resume: no "resumed" line, and nothing reused
    assert "resumed the conversation" not in third.stderr and third.stderr.startswith("[0 tokens reused, ")


def test_cli_chat_kv_offload_dir_that_is_a_file_is_a_usage_error(run_main, tmp_path):
    (tmp_path / "file").write_text("")
    run = run_main("chat", "--kv-offload-dir", str(tmp_path / "file"))
    assert run.returncode == 2 and run.stderr.startswith("minillm: error: --kv-offload-dir: ")
    assert "exists and is not a folder" in run.stderr and run.stderr.count("\n") == 1
