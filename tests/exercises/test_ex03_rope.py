"""Exercise 3: RoPE, the cos/sin tables at given positions and the rotation of q and k."""

import math

import pytest
import torch

from exercises.checking import Case
from exercises.models import randn, tiny_config
from minillm import ModelConfig
from minillm.rope import RotaryEmbedding, apply_rope

pytestmark = pytest.mark.ex03
LESSON = "lessons/01-what-is-inference.md#positions-rope"
LAYOUT = ("rotate half: the pairs are channels (i, i + head_dim/2), rotated by position · inv_freq[i]; "
          "cos/sin are [T, head_dim] with the same angle in both halves")


def config(head_dim: int) -> ModelConfig:
    return ModelConfig("llama", n_layers=1, d_model=head_dim, n_heads=1, n_kv_heads=1, head_dim=head_dim,
                       d_mlp=4, vocab_size=8, max_seq_len=64, norm_eps=1e-5, activation="silu",
                       tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, rope_theta=10000.0)


def test_tables_for_a_prompt(impl):
    cfg = tiny_config("llama_gqa")
    positions = torch.arange(4)
    c = Case("RotaryEmbedding(config).forward(positions=[0, 1, 2, 3], torch.float32)",
             "a 4-token prompt, head_dim 16", shapes="cos, sin: [T, head_dim] = [4, 16]",
             hint="angles = positions[:, None] · inv_freq[None, :] ([T, head_dim/2]), repeated for both "
                  "halves (torch.cat((angles, angles), -1)); return angles.cos(), angles.sin() in dtype",
             lesson=LESSON)
    cos, sin = c.call(impl.RotaryEmbedding(cfg).forward, positions, torch.float32)
    ref_cos, ref_sin = RotaryEmbedding(cfg)(positions, torch.float32)
    c.close(cos, ref_cos)
    c.close(sin, ref_sin)


def test_tables_at_a_decode_position(impl):
    cfg = tiny_config("llama_gqa")
    c = Case("RotaryEmbedding(config).forward(positions=[7], torch.float32)",
             "a decode step: the new token sits at position 7 (7 tokens already in the cache)",
             shapes="cos, sin: [1, 16]", lesson=LESSON,
             hint="use the positions you are given: the token decoded after 7 cached ones is at position 7, "
                  "not 0 (restarting at 0 makes every decode token look like the first one)")
    cos, sin = c.call(impl.RotaryEmbedding(cfg).forward, torch.tensor([7]), torch.float32)
    ref_cos, ref_sin = RotaryEmbedding(cfg)(torch.arange(8), torch.float32)
    c.close(cos, ref_cos[7:])
    c.close(sin, ref_sin[7:])


def test_tables_in_the_requested_dtype(impl):
    cfg = tiny_config("llama_gqa")
    c = Case("RotaryEmbedding(config).forward(positions, torch.bfloat16)", "a bfloat16 model",
             shapes="cos, sin: [3, 16]", lesson=LESSON,
             hint="compute the angles in float32 (inv_freq is float32), then .to(dtype) the cos and sin")
    cos, sin = c.call(impl.RotaryEmbedding(cfg).forward, torch.arange(3), torch.bfloat16)
    c.true(cos.dtype == sin.dtype == torch.bfloat16, "wrong dtype", expected="bfloat16",
           got=f"{cos.dtype}, {sin.dtype}")


def test_rotation_by_hand(impl):
    one = torch.tensor([[math.cos(1.0), math.cos(1.0)]]), torch.tensor([[math.sin(1.0), math.sin(1.0)]])
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)  # two heads, one position, head_dim 2
    c = Case("apply_rope(x, cos, sin)", "head_dim 2 at position 1: a rotation by 1 radian (counter-clockwise) "
             "of x = (1, 0) and x = (0, 1)", shapes="x [1, 2, 1, 2] ([B, heads, T, head_dim]), cos/sin [1, 2]",
             hint="(x1, x2) -> (x1·cos - x2·sin, x2·cos + x1·sin): x·cos + rotate_half(x)·sin with "
                  "rotate_half(x) = cat(-x2, x1)", lesson=LESSON)
    expected = torch.tensor([[math.cos(1.0), math.sin(1.0)], [-math.sin(1.0), math.cos(1.0)]]).view(1, 2, 1, 2)
    c.close(c.call(impl.apply_rope, x, *one), expected)


def test_rotation_pairs_the_two_halves(impl):
    cfg = config(8)
    cos, sin = RotaryEmbedding(cfg)(torch.tensor([2, 3, 4]), torch.float32)
    x = randn(1, 2, 3, 8, seed=1)
    c = Case("apply_rope(x, cos, sin)", "head_dim 8 at positions 2, 3, 4",
             shapes="x [1, 2, 3, 8] ([B, heads, T, head_dim]), cos/sin [3, 8]", hint=LAYOUT, lesson=LESSON)
    c.close(c.call(impl.apply_rope, x, cos, sin), apply_rope(x, cos, sin))


def test_scores_depend_only_on_distance(impl):
    cfg = config(8)
    rope = impl.RotaryEmbedding(cfg)
    q, k = randn(2, 1, 1, 1, 8, seed=2).unbind(0)

    def score(m: int, n: int):
        qm = impl.apply_rope(q, *rope(torch.tensor([m]), torch.float32))
        kn = impl.apply_rope(k, *rope(torch.tensor([n]), torch.float32))
        return (qm * kn).sum().item()

    c = Case("q·k after RoPE, q at position m, k at position n", "(m, n) = (5, 2) and (9, 6): both 3 apart",
             shapes="q, k [1, 1, 1, 8]", lesson=LESSON,
             hint="rotating q by m·θ and k by n·θ leaves q·k depending on m - n only; " + LAYOUT)
    c.close(c.call(score, 9, 6), c.call(score, 5, 2))


def test_tables_far_from_position_0_in_bfloat16(impl):
    cfg = tiny_config("llama_gqa")
    positions = torch.tensor([1001, 1002, 1003, 1537])
    c = Case("RotaryEmbedding(config).forward(positions=[1001, 1002, 1003, 1537], torch.bfloat16)",
             "a long conversation in a bfloat16 model: positions past 1000 (oracle: the angles in float64, then "
             "cos/sin rounded to bfloat16)", shapes="cos, sin: [4, 16] bfloat16", lesson=LESSON,
             hint="compute positions · inv_freq in float32 (positions.float()), and cast only cos and sin to dtype: "
                  "bfloat16 keeps 8 bits of mantissa, so an angle of 1001 · 0.1 rounded in bfloat16 is off by "
                  "~0.25 rad")
    inv_freq = RotaryEmbedding(cfg).inv_freq.double()
    angles = positions.double()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = c.call(impl.RotaryEmbedding(cfg).forward, positions, torch.bfloat16)
    c.true(cos.dtype == sin.dtype == torch.bfloat16, "wrong dtype", expected="bfloat16", got=f"{cos.dtype}, {sin.dtype}")
    c.close(cos, angles.cos().to(torch.bfloat16), atol=0.02, rtol=0.0)
    c.close(sin, angles.sin().to(torch.bfloat16), atol=0.02, rtol=0.0)


def test_rotation_of_a_batch_in_bfloat16(impl):
    cfg = config(8)
    cos, sin = RotaryEmbedding(cfg)(torch.tensor([700, 701, 702]), torch.bfloat16)
    x = randn(3, 2, 3, 8, seed=4).to(torch.bfloat16)
    c = Case("apply_rope(x, cos, sin)", "a batch of 3 sequences, 2 heads, positions 700..702, bfloat16",
             shapes="x [3, 2, 3, 8] bfloat16 ([B, heads, T, head_dim]), cos/sin [3, 8] bfloat16", lesson=LESSON,
             hint="the rotation keeps x's shape and dtype: x·cos + rotate_half(x)·sin, broadcast over batch and "
                  "heads; " + LAYOUT)
    got = c.call(impl.apply_rope, x, cos, sin)
    c.equal(got.dtype if isinstance(got, torch.Tensor) else type(got), torch.bfloat16)
    c.close(got, apply_rope(x.double(), cos.double(), sin.double()), atol=0.05, rtol=0.0)
