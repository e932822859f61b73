"""The transformer block, faster: each RMSNorm one C call, the second fused with the residual add.

:class:`~minillm.model.Block` computes ``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``: each RMSNorm is
six PyTorch ops (pow, mean, add, rsqrt and two products) and each residual add one more, 14 a block,
every one a dispatch from Python that costs more than its arithmetic on a decode step's few rows.
:class:`FastBlock` runs the same arithmetic in three calls: ln1 (:func:`minillm.fast.kernels.rms_norm`),
the first add with ln2 (as vLLM's ``fused_add_rms_norm``), and the second add; where it can: float32 or
bfloat16 on a CPU (bfloat16 with the lesson's roundings), RMSNorm (Llama-family) norms, no hook, no autograd.
Same values as the block up to float rounding.
"""

from __future__ import annotations

import torch

from ..model import Block, RMSNorm
from . import kernels


class FastBlock(Block):
    """:class:`~minillm.model.Block` (same modules, same parameters) with its norms in C."""

    def forward(self, x, rope_cos_sin, cache, impl, hook):
        if hook or not self._in_c(x):
            return super().forward(x, rope_cos_sin, cache, impl, hook)
        _, normed = kernels.rms_norm(x, self.ln1.weight, self.ln1.eps, check=False)  # (_in_c checked them)
        attn_out = self.attn(normed, rope_cos_sin, cache, impl, hook)
        x, normed = kernels.rms_norm(x, self.ln2.weight, self.ln2.eps, delta=attn_out.contiguous())
        return x + self.mlp(normed)

    def _in_c(self, x: torch.Tensor) -> bool:
        return (isinstance(self.ln1, RMSNorm) and isinstance(self.ln2, RMSNorm)
                and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu" and x.is_contiguous()
                and self.ln1.weight.dtype == self.ln2.weight.dtype == x.dtype
                and not (torch.is_grad_enabled()
                         and (x.requires_grad or self.ln1.weight.requires_grad or self.ln2.weight.requires_grad))
                and not torch.compiler.is_compiling() and kernels.available())
