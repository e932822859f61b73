"""benchmarks/kv_tiers_workloads.py: the providers' billing rules against hand-computed bills, the workloads'
shapes against the chat template rendered whole, and the five configurations end to end on a tiny model
(equal greedy outputs, tier hits after a restart, the side channel's cached tokens with and without salts)."""

import importlib.util
import sys
from pathlib import Path

import pytest

import minillm

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_tiers_workloads.py"
spec = importlib.util.spec_from_file_location("kv_tiers_workloads", SCRIPT)
kvw = sys.modules["kv_tiers_workloads"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(kvw)


def request(prompt_tokens, cached=0, written=0):
    return kvw.RequestResult(tuple(range(prompt_tokens)), cached, written, (), 0.0, True)


@pytest.mark.parametrize("prompt_tokens, cached, expected", [
    (2006, 1990, 1920),   # OpenAI's own example: 2,006 prompt tokens, 1,920 cached
    (2006, 2000, 1920),   # 1,024 + 7 · 128 = 1,920 <= 2,000 < 1,024 + 8 · 128
    (1500, 1023, 0),      # a cached prefix under 1,024 tokens counts for nothing
    (1000, 992, 0),       # a prompt under 1,024 tokens is not eligible
    (1024, 1024, 1024),
    (1300, 1151, 1024),
    (1300, 1152, 1152),
])
def test_openai_cached_tokens_are_1024_plus_128s(prompt_tokens, cached, expected):
    assert kvw.openai_cached_tokens(prompt_tokens, cached) == expected


def test_openai_bill_by_hand():
    # $2.00 a million; request 1: 2,000 tokens, none cached; request 2: 2,000 tokens, 1,990 cached -> 1,920
    # billed at half: (2,000 + 80 + 1,920 · 0.5) · 2 / 1e6 = 3,040 · 2e-6 + 2,000 · 2e-6
    prices = kvw.Prices(input_per_mtok=2.0, openai_cached=0.5)
    bill = kvw.openai_input_usd([request(2000), request(2000, cached=1990)], prices)
    assert bill == pytest.approx((2000 + 80 + 960) * 2e-6)


def test_anthropic_bill_by_hand():
    # $3.00 a million; request 1 writes 1,344 of its 1,371 tokens, request 2 reads them:
    # 5m: (27 + 1,344 · 1.25) + (27 + 1,344 · 0.1) = 1,707 + 161.4 tokens' worth; 1h: writes at 2x
    prices = kvw.Prices(input_per_mtok=3.0)
    requests = [request(1371, written=1344), request(1371, cached=1344)]
    assert kvw.anthropic_input_usd(requests, prices) == pytest.approx((27 + 1680 + 27 + 134.4) * 3e-6)
    assert kvw.anthropic_input_usd(requests, prices, "1h") == pytest.approx((27 + 2688 + 27 + 134.4) * 3e-6)
    with pytest.raises(ValueError, match="ttl must be one of"):
        kvw.anthropic_input_usd(requests, prices, "10m")


@pytest.fixture(scope="module")
def tokenizer():
    return minillm.load_tokenizer("smollm2-135m-instruct")


def test_a_chat_turn_is_the_template_of_the_whole_conversation(tokenizer):
    # Oracle: the template rendered over every message at once, then encoded.
    system, q1, answer, q2 = "Be brief.", "What is a KV cache?", "Stored keys and values.", "Why is it kept?"
    opening = kvw.chat_ids(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q1}])
    turn2 = opening + tokenizer.encode(answer, add_special_tokens=False) + kvw.followup_ids(tokenizer, system, q2)
    whole = kvw.chat_ids(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q1},
                                     {"role": "assistant", "content": answer}, {"role": "user", "content": q2}])
    assert turn2 == whole


@pytest.mark.parametrize("per_customer", [True, False])
def test_chat_workload_shape(tokenizer, per_customer):
    turns = kvw.chat_workload(tokenizer, n_conversations=3, n_turns=2, answer_tokens=5,
                              system="Be brief. " * 10, per_customer=per_customer)
    assert [t.conversation for t in turns] == ["chat 0", "chat 1", "chat 2"] * 2     # interleaved by turn
    assert all(t.cache_point_tokens == len(t.new_ids) and t.max_new_tokens == 5 and t.measured for t in turns)
    assert len({tuple(t.new_ids) for t in turns}) == 6                                # the questions all differ
    # the openings' first blocks: one shared system prompt, or a customer's line first and nothing shared
    first_blocks = {kvw.block_hashes(t.new_ids, 16, b"")[0] for t in turns[:3]}
    assert len(first_blocks) == (3 if per_customer else 1)


def test_document_workload_shape(tokenizer):
    turns = kvw.document_workload(tokenizer, document_tokens=200, n_questions=2, fillers_per_question=2,
                                  filler_tokens=80, answer_tokens=6)
    questions, fillers = turns[::3], [t for i, t in enumerate(turns) if i % 3]
    assert len(turns) == 6 and all(q.measured and q.max_new_tokens == 6 for q in questions)
    assert not any(f.measured for f in fillers) and all(abs(len(f.new_ids) - 80) <= 8 for f in fillers)
    # the questions share the document up to their cache point, and differ after it
    point = questions[0].cache_point_tokens
    assert 200 <= point <= 240 and questions[0].new_ids[:point] == questions[1].new_ids[:point]
    assert questions[0].new_ids[point:] != questions[1].new_ids[point:]
    assert len({tuple(f.new_ids) for f in fillers}) == 4
    with pytest.raises(ValueError, match="fewer than --document-tokens"):
        kvw.document_workload(tokenizer, 100_000, 1, 0, 10, 1)


@pytest.mark.large  # five engines over a dozen requests: ~15 s on 2 busy cores
def test_five_configurations_end_to_end(tiny_chat, tmp_path):
    model, tokenizer = tiny_chat
    turns = (kvw.chat_workload(tokenizer, 2, 2, 4, system="You answer in one line.")
             + kvw.document_workload(tokenizer, 150, 2, 1, 120, 3))
    results = kvw.run_configs(model, turns, num_blocks=16, block_size=16, host_memory="1MiB", folder=tmp_path)
    assert [r.config for r in results] == list(kvw.CONFIGS)
    assert kvw.differing_outputs(results) == []
    no_cache, pool, host, disk, restart = results
    assert no_cache.prefill_tokens == sum(r.prompt_tokens for r in no_cache.requests)
    assert no_cache.prefill_tokens > pool.prefill_tokens >= host.prefill_tokens >= disk.prefill_tokens
    assert kvw.distinct_blocks(no_cache, 16) > 16                     # the pool cannot hold the workload
    # the restarted engine finds the first request's blocks on disk: its own pool and host start empty
    assert restart.requests[0].cached_tokens > 0 and restart.tier_counts["disk_hits"] > 0
    assert restart.prefill_tokens < disk.prefill_tokens
    # a cache point's write is the tokens it pinned minus those read
    first = disk.requests[0]
    assert first.cache_write_tokens == turns[0].cache_point_tokens // 16 * 16 - first.cached_tokens


@pytest.mark.parametrize("salted", [False, True])
def test_side_channel_cached_tokens(tiny_chat, salted):
    model, tokenizer = tiny_chat
    right, wrong = kvw.side_channel(model, tokenizer, repetitions=2, salted=salted, context_tokens=100)
    assert all(cached == 0 for _, cached in wrong)
    # shared: the right guess reads the victim's blocks (all but the partial last one); salted: nothing
    assert all((cached > 0) != salted for _, cached in right)
