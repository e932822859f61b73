"""Two engine processes on one disk tier at the same time: each hits the blocks the other wrote.

What issue 44 asks of a shared tier ("two server processes share one disk tier"), with real
processes: A and B start together on the same folder; both prefill one common prompt at the same
moment (two writers of the same blocks: the same bytes, each file renamed into place whole), then
each its own two prompts. After a file barrier, each runs the other's prompts. The oracle: the
tokens of an engine without any cache, in this process; and the block count, 9 full blocks of 4
per 37-token prompt, all read from disk.
"""

import json
import subprocess
import sys

import pytest
import torch

from minillm import LLMEngine, SamplingParams

B, PROMPT = 4, 37

WORKER = r"""
import json, sys, time
from pathlib import Path
import minillm
from minillm import LLMEngine, SamplingParams
from minillm.hardware import HardwareProfile

model_dir, tier_dir, name, other, prompts = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
model = minillm.load_model(model_dir, device="cpu")
engine = LLMEngine(model, num_blocks=12, block_size=4, eos_token_ids=(), max_num_seqs=1, kv_offload_dir=tier_dir)
engine.offload.hardware = HardwareProfile("slow", peak_flops=1e3, mem_bandwidth=1e3)  # loads always win
engine.offload.record_prefill = lambda chunks, seconds: None
params = SamplingParams(max_new_tokens=5)

def run(batch):
    return [[o.token_ids, o.num_cached_tokens] for o in engine.generate(batch, params)]

mine, theirs = prompts[name], prompts[other]
first = run([prompts["common"]] + mine)
(tier_dir / f"done-{name}").touch()
deadline = time.monotonic() + 60
while not (tier_dir / f"done-{other}").exists():
    assert time.monotonic() < deadline, "the other process never finished its first phase"
    time.sleep(0.05)
second = run(theirs)
print(json.dumps({"first": first, "second": second, "disk_hits": engine.offload.counts["disk_hits"]}))
engine.close()
"""


@pytest.mark.cli
def test_two_processes_share_one_disk_tier_at_the_same_time(tiny_model, tmp_path):
    model = tiny_model("llama_gqa")
    g = torch.Generator().manual_seed(3)
    draw = [torch.randint(0, 128, (PROMPT,), generator=g).tolist() for _ in range(5)]
    prompts = {"common": draw[0], "A": draw[1:3], "B": draw[3:5]}
    params = SamplingParams(max_new_tokens=5)
    plain = LLMEngine(model, num_blocks=64, block_size=B, eos_token_ids=(), enable_prefix_caching=False)
    want = {i: o.token_ids for i, o in enumerate(plain.generate(draw, params))}

    def start(name, other):
        return subprocess.Popen([sys.executable, "-c", WORKER, str(model.source), str(tmp_path), name, other,
                                 json.dumps(prompts)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs = {"A": start("A", "B"), "B": start("B", "A")}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-2000:]
        results[name] = json.loads(out.strip().splitlines()[-1])

    for name, other, mine, theirs in (("A", "B", [1, 2], [3, 4]), ("B", "A", [3, 4], [1, 2])):
        first, second = results[name]["first"], results[name]["second"]
        assert [tokens for tokens, _ in first] == [want[0]] + [want[i] for i in mine]
        assert [tokens for tokens, _ in second] == [want[i] for i in theirs]
        assert [cached for _, cached in second] == [9 * B, 9 * B]  # every full block, written by the other
        assert results[name]["disk_hits"] >= 2 * 9
    # One file per block, the common prompt's once: 10 blocks a prompt, as the 37 prompt tokens and the first
    # 4 output tokens (the 5th is sampled, never fed back) fill 41 positions, 10 full blocks of 4.
    assert len(list(tmp_path.glob("*/*.kv"))) == 5 * 10
    assert not list(tmp_path.glob("*/.*.tmp"))  # no writer left a temp file behind
