"""Rotary position embedding (RoPE), Su et al. 2021, "RoFormer" (arXiv:2104.09864).

Each pair of channels (i, i + head_dim/2) of a query or key is rotated by the angle
``position · inv_freq[i]``. The dot product q·k then depends only on the distance
between the two positions, which is how a Llama model knows word order.

We use the "rotate half" channel layout of Hugging Face Llama checkpoints: the two
halves of a head are the two coordinates of each rotated pair.

Long context: a model trained on N positions meets angles it never saw beyond N. The
``rope_scaling`` variants (``SCALINGS``, one short function each) change the frequencies so
longer sequences fall back into the trained range: ``linear`` (all slowed), ``llama3`` and
``yarn`` (only the slow pairs slowed, by wavelength), ``dynamic`` (the base grows with the
sequence's length). YaRN also multiplies cos and sin by an attention factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                  seq_len: int | None = None) -> torch.Tensor:
    """Rotation speed of each channel pair: ``theta ** (-2i / head_dim)``, [head_dim/2] float32.

    With ``scaling``, frequencies are changed for long context by the function of
    ``SCALINGS`` its ``rope_type`` names, as transformers' ``modeling_rope_utils`` computes
    them (``ROPE_INIT_FUNCTIONS``). ``seq_len`` (positions in the pass, i.e. the last
    position + 1) matters only to ``dynamic``.
    """
    if scaling is None:
        return default_inv_freq(head_dim, theta)
    return SCALINGS[scaling.rope_type](head_dim, theta, scaling, seq_len)


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """RoPE's own frequencies (Su et al. 2021): ``1 / theta ** (2i / head_dim)``, [head_dim/2] float32.

    (Every table here is computed on the CPU, even while the model is built on the meta device.)"""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponents)


def linear_inv_freq(head_dim: int, theta: float, s: RopeScaling, seq_len: int | None = None) -> torch.Tensor:
    """Position interpolation (Chen et al. 2023, arXiv:2306.15595): every frequency / ``factor``,
    so position p turns as p / factor did in training."""
    return default_inv_freq(head_dim, theta) / s.factor


def llama3_inv_freq(head_dim: int, theta: float, s: RopeScaling, seq_len: int | None = None) -> torch.Tensor:
    """Llama 3.1's rule (Meta's reference code; Dubey et al. 2024): long wavelengths (low
    frequencies) are slowed by ``factor``, short ones kept as trained; in between, a linear blend."""
    inv_freq = default_inv_freq(head_dim, theta)
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def yarn_inv_freq(head_dim: int, theta: float, s: RopeScaling, seq_len: int | None = None) -> torch.Tensor:
    """YaRN (Peng et al. 2023, arXiv:2309.00071, "NTK-by-parts"): pairs that turn more than
    ``beta_fast`` times over the original context keep their frequency (extrapolation), pairs
    that turn fewer than ``beta_slow`` times are divided by ``factor`` (interpolation), and a
    linear ramp over the pair index blends the two in between. With ``truncate`` (default) the
    ramp's ends are rounded out to whole pairs. Same float32 operations, in the same order, as
    transformers' ``_compute_yarn_parameters``. (The attention factor: :func:`rope_attention_factor`.)
    """
    def pair_turning(n_rotations: float) -> float:  # the pair index that turns n_rotations times
        return head_dim * math.log(s.original_max_position_embeddings / (n_rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = pair_turning(s.beta_fast), pair_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # 1: the trained frequency, 0: divided by factor
    return interpolated * (1 - keep) + extrapolated * keep


def dynamic_ntk_inv_freq(head_dim: int, theta: float, s: RopeScaling, seq_len: int | None = None) -> torch.Tensor:
    """Dynamic NTK-aware scaling (bloc97 and emozilla, r/LocalLLaMA 2023; Peng et al. 2023 §3.3):
    within the original context, RoPE as trained; for a sequence of ``seq_len`` > original
    positions, the base grows to ``theta · (factor · seq_len / original - (factor - 1)) **
    (head_dim / (head_dim - 2))``, so the slowest pair spans the longer sequence.

    Rounding as transformers': within the original context the formula in Python floats (its
    init, seq_len = original: a base of theta up to rounding); beyond, a float32 tensor (its
    forward pass, ``dynamic_rope_update``, passes ``max(position_ids) + 1`` as a tensor).
    """
    original = s.original_max_position_embeddings
    if seq_len is None or seq_len <= original:
        grown = s.factor * original / original - (s.factor - 1)
    else:
        grown = s.factor * torch.tensor(seq_len, device="cpu") / original - (s.factor - 1)
    base = theta * grown ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (base**exponents)


# rope_type (HF ``rope_scaling``) -> the function computing its inv_freq.
SCALINGS = {"linear": linear_inv_freq, "llama3": llama3_inv_freq, "yarn": yarn_inv_freq,
            "dynamic": dynamic_ntk_inv_freq}


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by: 1, except YaRN's "attention temperature".

    YaRN (Peng et al. 2023, eq. 22) scales attention logits by 1/t with √(1/t) = 0.1·ln(factor) + 1.
    Multiplying both q's and k's rotation by √(1/t) does it for free, so transformers multiplies
    cos and sin by it (``attention_scaling``), and so do we. ``attention_factor`` in the config
    wins; else DeepSeek's variant mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both
    are set (and nonzero); else mscale(factor) = 0.1·ln(factor) + 1 (1 for factor <= 1).
    """
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


class RotaryEmbedding(nn.Module):
    """Holds ``inv_freq`` and turns positions into the cos/sin tables that rotate q and k.

    Dynamic NTK scaling recomputes ``inv_freq`` in every pass from that pass's length, the last
    position + 1 (as transformers' ``dynamic_rope_update`` does): prefill of 300 positions
    rotates its q and k with the base for 300, decode at position 300 with the base for 301,
    and keys already in the KV cache keep the rotation they were written with. transformers
    also remembers the longest length its module has seen and keeps that base for later,
    shorter passes until one falls inside the original context; minillm keeps no such state:
    each pass depends only on its own positions.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim, self.theta, self.scaling = config.head_dim, config.rope_theta, config.rope_scaling
        self.dynamic = self.scaling is not None and self.scaling.rope_type == "dynamic"
        self.attention_factor = rope_attention_factor(self.scaling)
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        # Not a checkpoint tensor: recomputed from the config, kept in float32 whatever the model dtype.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        """What ``model.to(...)``, ``.half()``, ``.cuda()`` run on every tensor: ``inv_freq`` moves to the new
        device but stays float32. Rounded to bfloat16 (8 significant bits), a frequency is off by up to
        2^-8 of itself, so position p turns up to p·inv_freq·2^-8 radians off (the pair at inv_freq 0.32:
        1.2 rad at p = 1000). transformers' ``from_pretrained(dtype=...)`` keeps it float32 too; its
        ``.to(torch.bfloat16)`` does not."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the given positions ([T] int64): two [T, head_dim] tensors of ``dtype``,
        both multiplied by the attention factor (``self.attention_factor``: YaRN's; 1 otherwise).

        The angles are positions · inv_freq in float32. With dynamic NTK scaling (``self.dynamic``)
        inv_freq is that of this pass's length, the last position + 1:
        ``rope_inv_freq(self.head_dim, self.theta, self.scaling, seq_len)``.
        """
        inv_freq = self.inv_freq
        if self.dynamic:
            seq_len = int(positions.max()) + 1
            inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, seq_len).to(inv_freq.device)
        angles = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim/2]
        angles = torch.cat((angles, angles), dim=-1)  # same angle for both halves of each pair
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:  # YaRN: scales q·k by attention_factor² (rope_attention_factor)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys x [B, heads, T, head_dim] by the angles in cos/sin [T, head_dim].

    For each pair (x1, x2) = (x[..., i], x[..., i + head_dim/2]):
    (x1, x2) -> (x1·cos - x2·sin, x2·cos + x1·sin), a 2-D rotation.
    """
    x1, x2 = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated_half * sin
