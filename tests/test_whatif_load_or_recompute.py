"""whatif.load_or_recompute against a case computed by hand.

The tiny Llama (tests/tiny_models.py LLAMA_BASE): d_model 64, 2 layers, 4 heads, 2 KV heads, head_dim 16,
d_mlp 128, vocab 128, untied; float32. Recompute 16 tokens after 16 cached ones:

    per layer: q 64·64 + k 64·32 + v 64·32 + o 64·64 = 12,288;  MLP 3·64·128 = 24,576  -> 36,864
    linear FLOPs    2 · (16 tokens · 2 layers · 36,864 + 1 row · LM head 64·128)       = 2,375,680
    attention FLOPs 4 · 64 (n_heads·head_dim) · (16·16 + 16·17/2 = 392 pairs) · 2       =   200,704
    FLOPs                                                                               = 2,576,384
    weights  (128·64 embed + 2 · (36,864 + 2·64 norms) + 64 + 128·64 head) · 4 B         =   361,728 B
    KV a token 2 · 2 layers · 2 heads · 16 · 4 B = 512 B:  read 32 · 512 + written 16 · 512 = 24,576 B
    on 1 GFLOP/s and 0.1 GB/s: compute 2.576384 ms, memory 386,304 B -> 3.86304 ms: recompute 3.86304 ms
    load: 16 · 512 = 8,192 B at 4 MB/s: 2.048 ms (load wins); at 2 MB/s: 4.096 ms (recompute wins)
"""

import pytest
from tiny_models import LLAMA_BASE

from minillm.config import ModelConfig
from minillm.hardware import HardwareProfile
from minillm.whatif import load_or_recompute

CONFIG = ModelConfig.from_hf(dict(LLAMA_BASE, model_type="llama"))
HW = HardwareProfile("hand", peak_flops=1e9, mem_bandwidth=1e8)


@pytest.mark.parametrize("tier_bytes_per_s, load_ms, choice", [(4e6, 2.048, "load"), (2e6, 4.096, "recompute")])
def test_the_hand_computed_case(tier_bytes_per_s, load_ms, choice):
    answer = load_or_recompute(CONFIG, HW, tier_bytes_per_s, prefix_tokens=16, cached_tokens=16, dtype_bytes=4)
    assert answer.kv_bytes == 8192
    assert answer.load_ms == pytest.approx(load_ms)
    assert answer.recompute_ms == pytest.approx(3.86304)
    assert answer.choice == choice


@pytest.mark.parametrize("kwargs, match", [(dict(tier_bytes_per_s=0.0), "tier_bytes_per_s"),
                                           (dict(tier_bytes_per_s=float("nan")), "tier_bytes_per_s"),
                                           (dict(prefix_tokens=0), "prefix_tokens"),
                                           (dict(cached_tokens=-1), "cached_tokens")])
def test_bad_arguments_are_one_line_errors(kwargs, match):
    args = dict(tier_bytes_per_s=1e9, prefix_tokens=16, cached_tokens=0, dtype_bytes=4) | kwargs
    with pytest.raises(ValueError, match=match):
        load_or_recompute(CONFIG, HW, **args)
