"""A decode step replayed: one sequence's kernel calls bound once to fixed buffers, then run again each step.

A GPU engine records a decode step once as a CUDA graph (its kernels and their buffers' addresses) and
replays it every step: one launch where the eager step made hundreds. A CPU has no such recorder, and its
eager step loses time the same way: SmolLM2-135M's bfloat16 step on the developers' 2-core AMD EPYC spent
9.2 of its 16.3 ms in the C kernels and the rest in the Python around them (~2,200 PyTorch ops a step:
views, splits, dtype casts, empty outputs; 215 module calls; each kernel wrapper's checks).
:class:`ReplayedDecodeStep` does the recorder's work by hand: for one sequence it works out once which C
function each of a step's kernel calls is, and on which buffers; a step is then those calls in order, with
only what moves filled in (the position: RoPE's angles, the KV cache's slot, how many keys attend)::

    x = embed[token]                                   x, h: [1, d_model] in the model's dtype
    for each layer:
        h = rms_norm(x += down, ln1)                   the previous layer's residual add inside the norm
        q|k|v = h @ W_qkvᵀ                             the kernel MatvecLinear runs for one row
        q, k = rope(q, k, cos[pos], sin[pos])
        K[pos], V[pos] = k, v                          this token's entry in the cache
        attn = decode_attention(q, K[:pos+1], V[:pos+1])
        h = rms_norm(x += attn @ W_oᵀ, ln2)
        down = silu_mul(h @ W_gate|upᵀ) @ W_downᵀ
    logits = lm_head(ln_final(x + down))

These are :class:`~minillm.fast.block.FastBlock`'s, :class:`~minillm.fast.attention.FastAttention`'s and
:class:`~minillm.fast.packing.PackedSwiGLU`'s kernels with the same inputs in the same order, so the logits are
the eager step's bit for bit (tests/fast/test_replay.py); a product whose kernel is not one of the C loops
(``F.linear``, the matrix units, a quantised format, a bias) calls its module, into the same buffer. It runs for
one sequence (batch 1) on a :class:`~minillm.kv_cache.KVCache` without rolling layers, a model whose every block
the speed layer made fast in C (:func:`replay_fits`); :func:`~minillm.phases.decode_step` runs the eager model
otherwise, and whenever a hook or a trace of the layers watches.
"""

from __future__ import annotations

import operator
import threading
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.modules import module as torch_module

from ..kv_cache import KVCache
from ..model import RMSNorm, Transformer
from . import kernels
from .attention import FastAttention
from .block import FastBlock
from .packing import PackedSwiGLU, silu_mul_in_c
from .products import FastQuantizedLinear, MatvecLinear

C_PRODUCTS = ("f32_matvec", "bf16_matvec")  # MatvecLinear's kernels that take (x, weight, y, rows, out, in, threads)


class ReplayedDecodeStep:
    """A drop-in replacement for :func:`~minillm.phases.decode_step` (given as ``model.compiled_decode``):
    ``step(model, token_ids, cache) -> logits [1, vocab]`` float32, the eager step's values bit for bit.

    ``step.applies(model, cache)`` says whether it can run: one sequence, a plain :class:`KVCache` without
    rolling layers, room in the model's context, a model :func:`replay_fits`, and no forward hook on any of its
    modules (nor a global one: a replayed step calls no module). Its plan (buffers and bound calls, a few hundred
    kilobytes for SmolLM2-135M) is made at the first step and made again when any attribute of a module of the
    model was replaced (a submodule, a parameter, a buffer, a norm's eps, the attention's scale, ...), a tensor
    moved, or torch's thread count changed; a weight edited in place is read where it lies. Steps on one model
    run one at a time (they share the plan's buffers). Raises ValueError, one line, for a step it cannot run or
    a token that is not one id of the vocabulary.
    """

    compiles = False  # (a compiled step compiles in its first call; this one binds its plan in milliseconds)

    def __init__(self):
        self._kept: tuple[_ModelState, _Plan | None] | None = None

    def __getstate__(self) -> dict:
        return {"_kept": None}  # (a copy of the model gets its own plan at its first step: addresses do not copy)

    def applies(self, model: Transformer, cache) -> bool:
        return (type(cache) is KVCache and cache.batch_size == 1 and not cache.rolling_layers
                and cache.length < model.config.max_seq_len and self.plan(model) is not None
                and not self._kept[0].hooked())

    def __call__(self, model: Transformer, token_ids, cache: KVCache) -> torch.Tensor:
        if not self.applies(model, cache):
            raise ValueError("the replayed decode step runs one sequence of a model whose blocks run in C, without "
                             "forward hooks, on a KVCache without rolling layers; call minillm.decode_step")
        plan, ids = self._kept[1], _one_token(token_ids, model.config.vocab_size)
        cache.check_room(1)
        with plan.lock, torch.inference_mode():
            logits = plan.step(ids, cache)
        cache.advance(1)
        return logits

    def plan(self, model: Transformer) -> _Plan | None:
        """The model's plan (made now if the model changed since), or None where it does not :func:`replay_fits`."""
        if self._kept is None or not self._kept[0].holds(model):
            self._kept = (_ModelState(model), _Plan(model) if replay_fits(model) else None)
        return self._kept[1]


def _one_token(token_ids, vocab_size: int) -> torch.Tensor:
    """token_ids as a [1] int64 tensor: one integer id in [0, vocab_size) (decode_step's checks, for a direct call)."""
    try:
        ids = torch.as_tensor(token_ids)
    except (TypeError, ValueError, RuntimeError):  # (a string, None, a ragged list)
        ids = torch.empty(0)
    if ids.numel() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool \
            or not 0 <= int(ids) < vocab_size:
        raise ValueError(f"the replayed decode step takes one token id in [0, {vocab_size}), got {token_ids!r}; "
                         "call minillm.decode_step")
    return ids.reshape(1).long()


def replay_fits(model: Transformer) -> bool:
    """Whether a step of ``model`` can be replayed: float32 or bfloat16 on a CPU, the C kernels built, RoPE and
    no learned positions, attention "sdpa", and every block what the C paths make of a Llama-family layer
    (:class:`FastBlock` with RMSNorms, :class:`FastAttention` with decode's attention and RoPE in C and q|k|v
    stacked, no sliding window or QK-norm, :class:`PackedSwiGLU` with gate|up stacked)."""
    weight = model.embed.weight
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and kernels.available()
            and model.pos_embed is None and model.rope is not None and model.attn_impl == "sdpa"
            and all(_block_fits(block, weight.dtype) for block in model.blocks))


def _block_fits(block, dtype: torch.dtype) -> bool:
    attn, mlp = block.attn, block.mlp
    return (type(block) is FastBlock and all(isinstance(n, RMSNorm) and n.weight.dtype == dtype
                                             and n.weight.is_contiguous() for n in (block.ln1, block.ln2))
            and isinstance(attn, FastAttention) and attn.c_decode and attn.c_rope and attn.window is None
            and attn.q_norm is None and attn.qkv is not None and attn.qkv.fresh(attn)
            and isinstance(mlp, PackedSwiGLU) and mlp.gate_up is not None and mlp.gate_up.fresh(mlp))


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # (nn.Module's own dicts and flags: never replaced)


class _ModelState:
    """What a plan was made from: every attribute of every module of the model (submodules, parameters, buffers,
    q|k|v and gate|up stacks, plain values such as a norm's eps or the attention's scale and window) and each
    tensor's address, and torch's thread count. ``holds(model)``: all still the same objects (~2,000 entries for
    SmolLM2-135M, compared by C-level maps: ~0.1 ms a check, two a step). ``hooked()``: a forward hook or pre-hook
    is registered, on a module or globally (the modules must run)."""

    def __init__(self, model: Transformer):
        modules = list(model.modules())
        parts = [(d, name, value) for m in modules for d in (vars(m), m._modules, m._parameters, m._buffers)
                 for name, value in d.items() if d is not vars(m) or name not in _MODULE_INTERNALS]
        self.dicts, self.names, self.values = (list(column) for column in zip(*parts))
        self.tensors = [t for t in self.values if isinstance(t, torch.Tensor)]
        self.addresses = [t.data_ptr() for t in self.tensors]
        self.hooks = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.hooks += [getattr(torch_module, name, {})  # (torch's global hooks: private names, hence getattr)
                       for name in ("_global_forward_hooks", "_global_forward_pre_hooks")]
        self.threads, self.model_dict = torch.get_num_threads(), vars(model)

    def holds(self, model: Transformer) -> bool:
        return (vars(model) is self.model_dict and torch.get_num_threads() == self.threads
                and all(map(operator.is_, map(dict.get, self.dicts, self.names), self.values))
                and list(map(torch.Tensor.data_ptr, self.tensors)) == self.addresses)

    def hooked(self) -> bool:
        return any(map(len, self.hooks))


class _Plan:
    """One sequence's buffers and the bound calls of a step (the module docstring's listing)."""

    def __init__(self, model: Transformer):
        cfg, weight = model.config, model.embed.weight
        self.lock = threading.Lock()
        self.embed, self.rope, self.ln_final, self.dtype = weight, model.rope, model.ln_final, weight.dtype
        with torch.inference_mode():
            self.x = torch.empty(1, cfg.d_model, dtype=self.dtype)  # the residual stream
            self.down = torch.zeros_like(self.x)  # the last layer's MLP output, added in the next norm
            self.final = torch.empty_like(self.x)
            self.logits = torch.empty(1, cfg.vocab_size, dtype=self.dtype)
            self.layers = [_Layer(block, self.x, self.down, i == 0) for i, block in enumerate(model.blocks)]
            self.lm_head = _product(model.lm_head, self.final, self.logits)
        self.cache_rows = [block.attn.layer for block in model.blocks]  # (the layer each block's K/V belong to)
        self._cache: tuple | None = None  # (a weak reference to the last cache, its k and v, each layer's _Slot)

    def step(self, token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        pos = cache.length
        torch.index_select(self.embed, 0, token_ids, out=self.x)
        cos, sin = self.rope(torch.arange(pos, pos + 1), self.dtype)  # [1, head_dim] each
        for layer, slot in zip(self.layers, self._slots(cache)):
            layer.run(pos, cos, sin, slot)
        torch.add(self.x, self.down, out=self.x)
        self.final.copy_(self.ln_final(self.x))  # (the lesson's norm: its roundings are the eager step's)
        self.lm_head()
        return self.logits.float() if self.dtype != torch.float32 else self.logits.clone()

    def _slots(self, cache: KVCache) -> list[_Slot]:
        kept = self._cache
        if kept is None or kept[0]() is not cache or kept[1] is not cache.k or kept[2] is not cache.v:
            slots = [_Slot(cache, layer) for layer in self.cache_rows]
            kept = self._cache = (weakref.ref(cache, self._forget), cache.k, cache.v, slots)
        return kept[3]

    def _forget(self, reference: weakref.ref) -> None:
        """The cache was dropped by its owner: so are its buffers' views here (they would keep its memory)."""
        if self._cache is not None and self._cache[0] is reference:
            self._cache = None


class _Slot:
    """One layer's keys and values in a cache of one sequence: [n_kv_heads, max_seq_len, head_dim] views, their
    addresses and the strides decode_attention reads them by."""

    def __init__(self, cache: KVCache, layer: int):
        row = cache._row[layer]
        self.k, self.v = cache.k[row, 0], cache.v[row, 0]
        self.k_ptr, self.v_ptr = self.k.data_ptr(), self.v.data_ptr()
        self.strides = (cache.k.stride(1), cache.k.stride(2), cache.v.stride(1), cache.v.stride(2))


class _Layer:
    """A block's calls, bound to the plan's residual stream ``x`` and the previous layer's MLP output ``down``
    (nothing to add before the first layer's norm) and to buffers of its own."""

    def __init__(self, block: FastBlock, x: torch.Tensor, down: torch.Tensor, first: bool):
        attn, mlp, lib, dtype = block.attn, block.mlp, kernels.kernels(), x.dtype
        H, KV, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.lib, self.threads, self.is_bf16 = lib, torch.get_num_threads(), dtype == torch.bfloat16
        self.shape, self.scale = (H, KV, D), attn._scale()
        h = torch.empty_like(x)  # each norm's output
        qkv = torch.empty(1, 1, (H + 2 * KV) * D, dtype=dtype)  # FastAttention's [B, T, (H + 2 KV) D]
        self.q_rot, self.k_rot = torch.empty(1, 1, H, D, dtype=dtype), torch.empty(1, 1, KV, D, dtype=dtype)
        # decode_attention reads a float32 q and writes a float32 output; in bfloat16 both are copies, as eagerly
        self.q32 = torch.empty(1, H, D, dtype=torch.float32) if self.is_bf16 else self.q_rot
        self.out32 = torch.empty(1, H * D, dtype=torch.float32)
        self.attn_out = torch.empty(1, H * D, dtype=dtype) if self.is_bf16 else self.out32
        o, gate_up = torch.empty_like(x), torch.empty(1, 2 * mlp.down_proj.in_features, dtype=dtype)
        act = torch.empty(1, mlp.down_proj.in_features, dtype=dtype)
        self.buffers = (h, qkv, o, gate_up, act)  # (the C calls hold their addresses, not them: kept alive here)

        self.norm_in = _rms_norm(block.ln1, x, None if first else down, h)
        self.qkv = _product(attn.qkv.module, h.view(1, 1, -1), qkv)
        q, k, v = (t.view(1, 1, -1, D).transpose(1, 2) for t in qkv.split((H * D, KV * D, KV * D), -1))
        self.rope_in = (q.data_ptr(), k.data_ptr())  # (then cos and sin, which move)
        self.rope_rest = (self.q_rot.data_ptr(), self.k_rot.data_ptr(), 1, 1, H, KV, D, *q.stride()[:3],
                          *k.stride()[:3], self.is_bf16, self.threads)
        self.q_new, self.k_new, self.v_new = self.q_rot[0], self.k_rot[0, 0], v[0, :, 0]  # [1, H, D], [KV, D] x2
        self.o = _product(attn.o_proj, self.attn_out, o)
        self.norm_mid = _rms_norm(block.ln2, x, o, h)
        self.gate_up = _product(mlp.gate_up.module, h, gate_up)
        self.act = _activation(gate_up, act, lib, self.threads)
        self.down = _product(mlp.down_proj, act, down)

    def run(self, pos: int, cos: torch.Tensor, sin: torch.Tensor, slot: _Slot) -> None:
        H, KV, D = self.shape
        self.norm_in()
        self.qkv()
        self.lib.rope(*self.rope_in, cos.data_ptr(), sin.data_ptr(), *self.rope_rest)
        slot.k.select(1, pos).copy_(self.k_new)
        slot.v.select(1, pos).copy_(self.v_new)
        if self.is_bf16:
            self.q32.copy_(self.q_new)
        if self.lib.decode_attention(self.q32.data_ptr(), slot.k_ptr, slot.v_ptr, self.is_bf16, self.out32.data_ptr(),
                                     1, H, KV, pos + 1, D, *slot.strides, self.scale, self.threads):
            raise MemoryError("decode_attention could not allocate its partial results or a thread's float32 copy")
        if self.is_bf16:
            self.attn_out.copy_(self.out32)
        self.o()
        self.norm_mid()
        self.gate_up()
        self.act()
        self.down()


def _product(module, x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """``out = x @ Wᵀ`` on fixed buffers: the C loop the module runs for x (:class:`MatvecLinear`'s one-row loops,
    :class:`FastQuantizedLinear`'s quantized_matvec), called directly, or else the module itself (F.linear, the
    matrix units, a bias), its result copied into ``out``."""
    lib = kernels.kernels()
    kernel = module.kernel(x) if isinstance(module, MatvecLinear) else None
    if kernel in C_PRODUCTS and module.bias is None:
        weight = module.weight
        return _c_call(getattr(lib, kernel), x.data_ptr(), weight.data_ptr(), out.data_ptr(), 1, weight.shape[0],
                       weight.shape[1], torch.get_num_threads())
    if isinstance(module, FastQuantizedLinear) and module.runs_matvec(x) and module.bias is None:
        codes, rows = (module.qweight, module.scale, module.zero, module.group_size), x.view(-1, x.shape[-1])
        function, arguments = kernels.quantized_call("matvec", lib, rows, *codes, out)  # (checked once, here)
        return _c_call(function, *arguments)
    return lambda: out.copy_(module(x).view_as(out))


def _rms_norm(norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor | None, out: torch.Tensor) -> Callable[[], None]:
    """``x += delta`` (none: x as it is), then ``out = norm(x)``, in one C call as FastBlock makes it."""
    lib = kernels.kernels()
    function = lib.rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.rms_norm
    return _c_call(function, x.data_ptr(), None if delta is None else delta.data_ptr(), x.data_ptr(),
                   norm.weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], norm.eps, torch.get_num_threads())


def _activation(gate_up: torch.Tensor, out: torch.Tensor, lib, threads: int) -> Callable[[], None]:
    """silu(gate) · up into ``out``, as PackedSwiGLU computes it: in C where it would, else in PyTorch."""
    if silu_mul_in_c(gate_up):
        silu_mul = lib.silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else lib.silu_mul
        return _c_call(silu_mul, gate_up.data_ptr(), out.data_ptr(), 1, out.shape[1], threads)
    gate, up = gate_up.chunk(2, dim=-1)
    return lambda: torch.mul(F.silu(gate), up, out=out)


def _c_call(function, *args) -> Callable[[], None]:
    """``function(*args)``, its arguments bound; a status other than 0 (None: no status) raises MemoryError (the
    kernels' scratch could not be allocated)."""
    def call():
        if function(*args):
            raise MemoryError(f"{function.__name__} could not allocate its scratch memory")
    return call
