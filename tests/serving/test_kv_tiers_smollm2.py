"""The KV tiers on the real default model: the same tokens as an engine without any cache, with a
pool so small that blocks are evicted to host memory and disk and loaded back (the cost model's own
choice: on a CPU a 135M model's prefill is far slower than reading its K/V), and after a restart.
"""

import pytest

from minillm import LLMEngine, SamplingParams

pytestmark = pytest.mark.large

TEXTS = ["The history of the printing press begins in the fifteenth century, when",
         "A recipe for bread needs flour, water, salt and yeast; the dough is kneaded until",
         "In mathematics, a prime number is a natural number greater than one that"]


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=8),
                                    SamplingParams(max_new_tokens=8, temperature=0.8, seed=5)],
                         ids=["greedy", "seeded"])
def test_smollm2_with_tiers_equals_the_uncached_run_and_survives_a_restart(smollm2, params, tmp_path):
    model, tok = smollm2
    prompts = [tok.encode(text * 6) for text in TEXTS]  # 78-114 tokens: 4-7 full blocks of 16
    want = [o.token_ids for o in LLMEngine(model, num_blocks=64, enable_prefix_caching=False).generate(prompts, params)]
    pool = max(len(p) for p in prompts) // 16 + 2  # one request at a time fits; the next evicts it
    engine = LLMEngine(model, num_blocks=pool, max_num_seqs=1, kv_offload_memory="2MiB", kv_offload_dir=tmp_path)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    again = engine.generate(prompts[::-1], params)[::-1]
    assert [o.token_ids for o in again] == want
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 16 * 16 for p in prompts]  # every full block
    assert engine.offload.counts["loaded_blocks"] > 0
    engine.close()
    restarted = LLMEngine(model, num_blocks=pool, max_num_seqs=1, kv_offload_dir=tmp_path)
    outs = restarted.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert restarted.offload.counts["disk_hits"] == sum((len(p) - 1) // 16 for p in prompts)
