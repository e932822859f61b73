"""Matrices that read the same input, stacked into one: q|k|v, and gate|up.

A Llama layer runs seven products; three of them (q, k, v) read the same x, and two (gate,
up) read the same x too. Stacked along the output dimension they are two products::

    [ W_q ]                    x @ [W_q | W_k | W_v]ᵀ  =  [ q | k | v ]      (one read of x,
    [ W_k ]  [H·D + 2·Hkv·D, d_model]                                          one call)
    [ W_v ]

so a layer runs 4 products instead of 7: fewer calls, and each longer. The stack is built once;
each member's weight becomes a view of its rows, so parameter names, shapes and values stay
(memory is not doubled) and an edit in place is seen by both. Quantised members
(:class:`~minillm.quantize.QuantizedLinear`) are stacked the same way: their codes, scales and
zeros are per output row, so the stacked rows are exactly each member's.

``long_rows``: a decode step multiplies one row vector by each matrix, and MKL streams a matrix
fastest along long contiguous rows; nn.Linear keeps [out, in] rows of length in, so a matrix with
out >= in (q|k|v, gate|up, o, the LM head) can be stored transposed instead, strides (1, out)
(BENCHMARKS-HISTORY.md has the numbers; CPU float16 products with transposed weights fall to a
slow kernel).
"""

from __future__ import annotations

import torch
from torch import nn

from ..model import SwiGLU
from ..quantize import QuantizedLinear
from . import kernels
from .products import FastQuantizedLinear, MatvecLinear, swap_class


def stack(members: list[nn.Module], linear_cls: type, long_rows: bool) -> nn.Module:
    """One module computing ``cat([m(x) for m in members], -1)`` with one product.

    Float members become ``linear_cls`` (an nn.Linear subclass: how the product runs) and views of
    the stacked matrix; quantised ones become FastQuantizedLinear and views of the stacked codes.
    """
    if isinstance(members[0], QuantizedLinear):
        return _stack_quantized(members)
    first = members[0].weight
    shape = (sum(m.out_features for m in members), first.shape[1])
    weight = _empty(shape, first, long_rows)
    bias = torch.cat([m.bias for m in members]) if members[0].bias is not None else None
    start = 0
    for m in members:
        end = start + m.out_features
        weight[start:end].copy_(m.weight)
        m.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:end], requires_grad=False)
        swap_class(m, linear_cls)
        start = end
    with torch.device("meta"):
        stacked = linear_cls(shape[1], shape[0], bias=bias is not None)
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    stacked.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return stacked


def relayout(linear: nn.Module, linear_cls: type, long_rows: bool) -> None:
    """A matrix on its own: its own memory (nothing pins a memory-mapped checkpoint), in the
    ``long_rows`` layout, computed by ``linear_cls`` (FastQuantizedLinear when quantised)."""
    if isinstance(linear, QuantizedLinear):
        swap_class(linear, FastQuantizedLinear)
        return
    weight = _empty(linear.weight.shape, linear.weight, long_rows)
    weight.copy_(linear.weight)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    swap_class(linear, linear_cls)


class Stack:
    """Members stacked by :func:`stack`, kept outside the module tree (a plain attribute, not a child):
    its tensors are the members' own, so state_dict, parameters() and byte counts see each weight once.

    ``fresh(parent)`` is False once a member was replaced (a module swapped in, a weight assigned, or
    ``weight.data`` set to another tensor): the stack would be stale, so its owner falls back to the
    members themselves. (A compiled graph guards on the objects; it cannot read addresses.) It is False too
    while autograd records and a member's weight requires grad: the stacked tensor is the members' memory, not
    their parameters, and gradients would not reach them (a new user's trial: q|k|v and gate|up got none).
    """

    def __init__(self, parent: nn.Module, names: tuple[str, ...], linear_cls: type, long_rows: bool):
        self.names = names
        self.module = stack([getattr(parent, n) for n in names], linear_cls, long_rows)
        self.members = [(m, _tensor(m), _tensor(m).data_ptr()) for m in (getattr(parent, n) for n in names)]

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy``, or ``torch.save`` then ``load``) of a module and its stack: the copied members'
        tensors are views of the copied stacked matrix (both keep tensors' shared storage), at new addresses."""
        self.__dict__.update(state)
        self.members = [(m, t, t.data_ptr()) for m, t, _ in self.members]

    def fresh(self, parent: nn.Module) -> bool:
        # (a loop over the modules' own dicts, not getattr: nn.Module.__getattr__ is a Python call, and this
        # runs twice a layer every step: 0.4 ms of a SmolLM2-135M decode step the other way)
        compiling = torch.compiler.is_compiling()
        for name, (m, t, address) in zip(self.names, self.members):
            if parent._modules.get(name) is not m:
                return False
            now = _tensor(m)
            if now is not t or not (compiling or now.data_ptr() == address):
                return False
            if now.requires_grad and torch.is_grad_enabled():
                return False
        return True


def pack_panels(model: nn.Module) -> int:
    """Give each of ``model``'s float32 and quantised products a second copy of its matrix, packed into panels
    at its first product of a server's batch (:class:`~minillm.fast.products.MatvecLinear` from 9 rows,
    :class:`~minillm.fast.products.FastQuantizedLinear` from 4): ``minillm serve --pack-weights``. MKL and
    oneDNN pack a matrix again at every call, which at 9-40 rows costs more than the product; the copy is
    made once. It doubles the weights' memory (SmolLM2-135M float32: a server held 1,330 MiB without it and
    1,831-1,839 MiB with it after the issue 32 workload, and gave 130-131 against 110-112 output tok/s;
    BENCHMARKS.md, "One copy of the weights in a server"). The first batch pays for the packing (a few
    seconds for SmolLM2-135M). Returns how many products will pack."""
    products = [m for m in product_modules(model) if isinstance(m, (MatvecLinear, FastQuantizedLinear))]
    for m in products:
        m.panels = True
    return len(products)


def product_modules(model: nn.Module) -> list[nn.Module]:
    """Every module that runs one of ``model``'s products: its own submodules, and the stacks' modules
    (a :class:`Stack` is no submodule: its module is not in ``model.modules()``)."""
    found = list(model.modules())
    for m in list(found):
        found += [s.module for s in vars(m).values() if isinstance(s, Stack)]
    return found


class PackedSwiGLU(SwiGLU):
    """:class:`~minillm.model.SwiGLU` with gate|up computed by one product (see the module docstring)."""

    gate_up: Stack | None = None

    def _apply(self, fn, recurse=True):
        self.gate_up = None  # .to(), .double(), .cuda() make new tensors: the stack would be stale
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None or not self.gate_up.fresh(self):
            return super().forward(x)
        gate_up = self.gate_up.module(x)
        if silu_mul_in_c(gate_up):
            return self.down_proj(kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


def silu_mul_in_c(gate_up: torch.Tensor) -> bool:
    """Whether :class:`PackedSwiGLU` computes silu(gate) · up of ``gate_up`` by :func:`~minillm.fast.kernels.silu_mul`:
    a contiguous CPU tensor, float32 (or bfloat16 where the kernel's AVX-512 loop runs), no autograd, not compiling."""
    # kernels.silu_mul's one pass beats F.silu(gate) * up at every size measured (SmolLM2's gate|up, 2 threads:
    # float32 1 row 4.5 against 4.9 us, 32 rows 13.6 against 18.7, [512, 3072] 200 against 368; bfloat16 with
    # AVX-512, the C call alone, 32 rows 13.8 against 25.8, [512, 3072] 195 against 340); compiled code fuses the
    # two itself (and cannot trace a ctypes call)
    return (gate_up.is_cpu and gate_up.is_contiguous()
            and not (torch.is_grad_enabled() and gate_up.requires_grad) and not torch.compiler.is_compiling()
            and kernels.available()
            and (gate_up.dtype == torch.float32
                 or gate_up.dtype == torch.bfloat16 and kernels.silu_mul_bf16_vectorised()))


def _tensor(m: nn.Module) -> torch.Tensor:
    # (the module's dicts, as Module.__getattr__ finds them: "weight" a parameter, "qweight" a buffer)
    return m._buffers.get("qweight") if isinstance(m, QuantizedLinear) else m._parameters.get("weight")


def _empty(shape, like: torch.Tensor, long_rows: bool) -> torch.Tensor:
    """An uninitialised [out, in] matrix; with long_rows and out >= in, stored transposed."""
    if long_rows and shape[0] >= shape[1]:
        return torch.empty(shape[::-1], dtype=like.dtype, device=like.device).t()
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _stack_quantized(members: list[QuantizedLinear]) -> FastQuantizedLinear:
    first = members[0]
    stacked = FastQuantizedLinear.__new__(FastQuantizedLinear)
    nn.Module.__init__(stacked)
    stacked.fmt, stacked.group_size, stacked.in_features = first.fmt, first.group_size, first.in_features
    stacked.out_features = sum(m.out_features for m in members)
    for name in ("qweight", "scale", "zero", "bias"):
        parts = [getattr(m, name) for m in members]
        whole = None if parts[0] is None else torch.cat(parts)
        stacked.register_buffer(name, whole)
        start = 0
        for m, part in zip(members, parts):  # each member's rows become a view of the stack
            if whole is not None:
                setattr(m, name, whole[start:start + part.shape[0]])
                start += part.shape[0]
    for m in members:
        swap_class(m, FastQuantizedLinear)
    return stacked
