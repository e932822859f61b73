"""Exercise 3: rotary position embedding (RoPE) at given positions.

Write two pieces:

- ``RotaryEmbedding.forward(positions, dtype)``: the cos and sin tables for the given
  positions. The class inherits minillm's, whose ``__init__`` already holds
  ``self.inv_freq`` ([head_dim/2] float32, the rotation speed of each channel pair).
- ``apply_rope(x, cos, sin)``: rotate queries or keys by those tables, pairing channel i
  with channel i + head_dim/2 (the "rotate half" layout of Hugging Face Llama checkpoints).

Check:      minillm check ex03   (or: pytest tests/exercises -m ex03 --impl student)
Lesson:     lessons/01-what-is-inference.md#positions-rope
Reference:  minillm.rope.RotaryEmbedding.forward, minillm.rope.apply_rope
            (peek once your checks pass, or when stuck)
"""

from __future__ import annotations

import torch

from minillm import rope
from minillm.rope import rope_inv_freq  # noqa: F401 (dynamic NTK scaling, see forward)


class RotaryEmbedding(rope.RotaryEmbedding):
    """minillm's RotaryEmbedding (``__init__`` sets ``self.inv_freq``); forward is yours."""

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the given positions ([T] int64): two [T, head_dim] tensors of ``dtype``,
        both multiplied by the attention factor (``self.attention_factor``: YaRN's; 1 otherwise).

        The angles are positions · inv_freq in float32. With dynamic NTK scaling (``self.dynamic``)
        inv_freq is that of this pass's length, the last position + 1:
        ``rope_inv_freq(self.head_dim, self.theta, self.scaling, seq_len)``.
        """
        positions = torch.as_tensor(positions)
        inv_freq = self.inv_freq
        if self.dynamic:
            seq_len = positions.numel()
            inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, seq_len)
        inv_freq = inv_freq.to(device=positions.device, dtype=torch.float32)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1)
        cos = emb.cos() * self.attention_factor
        sin = emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys x [B, heads, T, head_dim] by the angles in cos/sin [T, head_dim].

    For each pair (x1, x2) = (x[..., i], x[..., i + head_dim/2]):
    (x1, x2) -> (x1·cos - x2·sin, x2·cos + x1·sin), a 2-D rotation.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos + rot * sin
