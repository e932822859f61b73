"""Rotary position embedding (RoPE), Su et al. 2021, "RoFormer" (arXiv:2104.09864).

Each pair of channels (i, i + head_dim/2) of a query or key is rotated by the angle
``position · inv_freq[i]``. The dot product q·k then depends only on the distance
between the two positions, which is how a Llama model knows word order.

We use the "rotate half" channel layout of Hugging Face Llama checkpoints: the two
halves of a head are the two coordinates of each rotated pair.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """Rotation speed of each channel pair: ``theta ** (-2i / head_dim)``, [head_dim/2] float32.

    With ``scaling``, frequencies are stretched for long context as in HF transformers'
    ``modeling_rope_utils`` (``linear``: divide all by factor; ``llama3``: Llama 3.1's rule).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths (low frequencies) are slowed by `factor`; short ones are kept as they
    # were trained; in between, a linear blend. Meta's Llama 3.1 reference code.
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


class RotaryEmbedding(nn.Module):
    """Holds ``inv_freq`` and turns positions into the cos/sin tables that rotate q and k."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        # Not a checkpoint tensor: recomputed from the config, kept in float32 whatever the model dtype.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the given positions ([T] int64): two [T, head_dim] tensors of ``dtype``."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim/2]
        angles = torch.cat((angles, angles), dim=-1)  # same angle for both halves of each pair
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys x [B, heads, T, head_dim] by the angles in cos/sin [T, head_dim].

    For each pair (x1, x2) = (x[..., i], x[..., i + head_dim/2]):
    (x1, x2) -> (x1·cos - x2·sin, x2·cos + x1·sin), a 2-D rotation.
    """
    x1, x2 = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated_half * sin
