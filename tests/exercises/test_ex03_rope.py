"""Exercise 3: RoPE, the cos/sin tables at given positions and the rotation of q and k."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exercises.checking import Case
from exercises.differential import CHECKS, TOLERANCE, agree
from exercises.models import randn, tiny_config
from exercises.registry import EXERCISES, reference
from minillm import ModelConfig
from minillm.config import RopeScaling
from minillm.rope import RotaryEmbedding, apply_rope

pytestmark = pytest.mark.ex03
LESSON = "lessons/01-what-is-inference.md#positions-rope"
LAYOUT = ("rotate half: the pairs are channels (i, i + head_dim/2), rotated by position · inv_freq[i]; "
          "cos/sin are [T, head_dim] with the same angle in both halves")


REF = reference(EXERCISES["ex03"])
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def config(head_dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None) -> ModelConfig:
    return ModelConfig("llama", n_layers=1, d_model=head_dim, n_heads=1, n_kv_heads=1, head_dim=head_dim,
                       d_mlp=4, vocab_size=8, max_seq_len=64, norm_eps=1e-5, activation="silu",
                       tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, rope_theta=theta,
                       rope_scaling=scaling)


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


# -- differential checks (issue 30): the whole documented domain against the reference -------------------


def scalings():
    """None, or each rope_scaling the config supports (linear, llama3, yarn, dynamic), original contexts short
    enough that the drawn positions go past them."""
    original = st.sampled_from([64, 4096, 8192])
    factor = st.sampled_from([2.0, 4.0, 8.0, 32.0])
    return st.one_of(
        st.none(),
        st.builds(RopeScaling, st.just("linear"), factor),
        st.builds(RopeScaling, st.just("llama3"), factor, st.just(1.0), st.just(4.0), original),
        st.builds(RopeScaling, st.just("yarn"), factor, original_max_position_embeddings=original,
                  attention_factor=st.none() | st.just(0.7)),
        st.builds(RopeScaling, st.just("dynamic"), factor, original_max_position_embeddings=original),
    )


def draw_positions(data) -> list[int]:
    """1..8 positions: a prompt from 0, a chunk or a decode step far from 0 (up to 10^5), or any positions at all
    (gaps, out of order, repeats: a serving batch's rows)."""
    T = data.draw(st.integers(1, 8), label="T")
    kind = data.draw(st.sampled_from(["prompt", "far", "any"]), label="positions")
    if kind == "prompt":
        return list(range(T))
    if kind == "far":
        start = data.draw(st.integers(0, 10**5), label="first position")
        return list(range(start, start + T))
    return data.draw(st.lists(st.integers(0, 10**5), min_size=T, max_size=T), label="positions")


def angle_tolerance(dtype: torch.dtype, positions: list[int]) -> tuple[float, float]:
    """The dtype's tolerance, plus float32's rounding of the largest angle (position · inv_freq, inv_freq <= 1):
    the reference rounds it once, a more careful solution (float64 angles) not at all."""
    atol, rtol = TOLERANCE[dtype]
    return atol + 2.5e-7 * max(positions), rtol


@given(data=st.data())
@settings(CHECKS, max_examples=40)
def test_tables_agree_with_the_reference_for_every_position_dtype_and_scaling(impl, data):
    head_dim = data.draw(st.sampled_from([2, 4, 8, 16, 64, 128]), label="head_dim")
    theta = data.draw(st.sampled_from([10000.0, 500000.0, 1e6]), label="rope_theta")
    scaling = data.draw(scalings(), label="rope_scaling")
    if scaling is not None and scaling.rope_type == "dynamic":
        head_dim = max(head_dim, 4)  # dynamic NTK's exponent head_dim / (head_dim - 2) needs head_dim > 2
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    positions = draw_positions(data)
    cfg = config(head_dim, theta, scaling)
    agree(impl.RotaryEmbedding(cfg).forward, REF.RotaryEmbedding(cfg).forward,
          lambda: ((torch.tensor(positions), dtype), {}), what="RotaryEmbedding(config).forward",
          exercise="ex03", lesson=LESSON, tol=angle_tolerance(dtype, positions),
          hint="angles = positions.float()[:, None] · inv_freq[None, :] at the positions given (any positions, "
               "not 0..T-1), the same angle in both halves; cos and sin times self.attention_factor (YaRN), cast "
               "to dtype last; self.inv_freq already holds the config's scaling (linear, llama3, yarn), and "
               "dynamic NTK recomputes it for the last position + 1 (rope_inv_freq)")


@given(data=st.data())
@settings(CHECKS, max_examples=40)
def test_rotation_agrees_with_the_reference_for_every_batch_and_dtype(impl, data):
    head_dim = data.draw(st.sampled_from([2, 4, 8, 16, 64]), label="head_dim")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B = data.draw(st.integers(1, 3), label="batch")
    heads = data.draw(st.integers(1, 4), label="heads")
    positions = draw_positions(data)
    transposed = data.draw(st.booleans(), label="x laid out [B, T, heads, head_dim] and transposed (as in the model)")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    cos, sin = RotaryEmbedding(config(head_dim))(torch.tensor(positions), dtype)

    def inputs():
        T, g = len(positions), torch.Generator().manual_seed(seed)
        if transposed:
            x = torch.randn(B, T, heads, head_dim, generator=g).to(dtype).transpose(1, 2)
        else:
            x = torch.randn(B, heads, T, head_dim, generator=g).to(dtype)
        return (x, cos.clone(), sin.clone()), {}

    agree(impl.apply_rope, REF.apply_rope, inputs, what="apply_rope", exercise="ex03", lesson=LESSON,
          hint="x·cos + rotate_half(x)·sin with rotate_half(x) = cat(-x2, x1), the halves x1, x2 = x.chunk(2, -1); "
               "cos/sin [T, head_dim] broadcast over batch and heads; a new tensor in x's dtype, x left as it was")
