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
otherwise, and whenever a hook or a trace of the layers watches. The same :class:`Plan`, made for B rows, replays a
serving engine's step of decodes (:mod:`minillm.fast.replay_serving`).
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
from .attention import FastAttention, score_scale
from .block import FastBlock
from .packing import PackedSwiGLU, silu_mul_in_c
from .products import FastQuantizedLinear, MatvecLinear

# MatvecLinear's kernels that take (x, weight, y, rows, out, in, threads), the matrix where it lies
C_PRODUCTS = ("f32_matvec", "bf16_matvec", "f32_rows_matmul", "bf16_rows_matmul")


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
        self._kept: tuple[ModelState, Plan | None] | None = None

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

    def plan(self, model: Transformer) -> Plan | None:
        """The model's plan (made now if the model changed since), or None where it does not :func:`replay_fits`."""
        if self._kept is None or not self._kept[0].holds(model):
            self._kept = (ModelState(model), Plan(model, Scratch(1), 1) if replay_fits(model) else None)
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
    no learned positions, attention "sdpa", every block what the C paths make of a Llama-family layer
    (:class:`FastBlock` with RMSNorms, :class:`FastAttention` with decode's attention and RoPE in C and q|k|v
    stacked, no sliding window or QK-norm, :class:`PackedSwiGLU` with gate|up stacked), and no module whose method
    was replaced on the module itself."""
    weight = model.embed.weight
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and kernels.available()
            and model.pos_embed is None and model.rope is not None and model.attn_impl == "sdpa"
            and all(_block_fits(block, weight.dtype) for block in model.blocks)
            and not any(map(_method_set_on, model.modules())))


def _method_set_on(module: torch.nn.Module) -> bool:
    """Whether one of the module's methods was replaced on the module itself (``mlp.forward = ...``): the replay
    calls none of them, so it would not see the change."""
    return any(callable(getattr(type(module), name, None)) for name in vars(module) if name not in _MODULE_INTERNALS)


def _block_fits(block, dtype: torch.dtype) -> bool:
    attn, mlp = block.attn, block.mlp  # (the exact classes: a subclass may compute otherwise, and is not called)
    return (type(block) is FastBlock and all(type(n) is RMSNorm and n.weight.dtype == dtype
                                             and n.weight.is_contiguous() for n in (block.ln1, block.ln2))
            and type(attn) is FastAttention and attn.c_decode and attn.c_rope and attn.window is None
            and attn.q_norm is None and attn.qkv is not None and attn.qkv.fresh(attn)
            and type(mlp) is PackedSwiGLU and mlp.gate_up is not None and mlp.gate_up.fresh(mlp))


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # (nn.Module's own dicts and flags: never replaced)


class ModelState:
    """What a plan was made from: every attribute of every module of the model (submodules, parameters, buffers,
    q|k|v and gate|up stacks, plain values such as a norm's eps or the attention's scale and window; none added
    since), each module's class and each tensor's address, and torch's thread count. ``holds(model)``: all still the
    same objects (~2,000 entries for SmolLM2-135M, compared by C-level maps: ~0.1 ms a check, two a step).
    ``hooked()``: a forward hook or pre-hook is registered, on a module or globally (the modules must run)."""

    def __init__(self, model: Transformer):
        modules = list(model.modules())
        parts = [(d, name, value) for m in modules for d in (vars(m), m._modules, m._parameters, m._buffers)
                 for name, value in d.items() if d is not vars(m) or name not in _MODULE_INTERNALS]
        self.dicts, self.names, self.values = (list(column) for column in zip(*parts))
        self.all_dicts = [d for m in modules for d in (vars(m), m._modules, m._parameters, m._buffers)]
        self.sizes = list(map(len, self.all_dicts))
        self.modules, self.types = modules, [type(m) for m in modules]
        self.tensors = [t for t in self.values if isinstance(t, torch.Tensor)]
        self.addresses = [t.data_ptr() for t in self.tensors]
        self.hooks = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.hooks += [getattr(torch_module, name, {})  # (torch's global hooks: private names, hence getattr)
                       for name in ("_global_forward_hooks", "_global_forward_pre_hooks")]
        self.threads, self.model_dict = torch.get_num_threads(), vars(model)

    def holds(self, model: Transformer) -> bool:
        return (vars(model) is self.model_dict and torch.get_num_threads() == self.threads
                and list(map(len, self.all_dicts)) == self.sizes  # (nothing added: an attribute, a method set on one)
                and all(map(operator.is_, map(type, self.modules), self.types))  # (no class swapped: __class__ =)
                and all(map(operator.is_, map(dict.get, self.dicts, self.names), self.values))
                and list(map(torch.Tensor.data_ptr, self.tensors)) == self.addresses)

    def hooked(self) -> bool:
        return any(map(len, self.hooks))


class Scratch:
    """The buffers of a model's plans: ``get(name, rows, *shape, dtype)`` -> [rows, *shape], the first rows of one
    [capacity, *shape] tensor for each name, shape and dtype. Every layer of a plan writes the same ones (a layer's
    are free once it has run), and so does each plan of fewer rows. ``lock``: the plans on one scratch run one at a
    time."""

    def __init__(self, capacity: int):
        self.capacity, self.lock, self._kept = capacity, threading.Lock(), {}

    def get(self, name: str, rows: int, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        key = (name, shape, dtype)
        if key not in self._kept:
            with torch.inference_mode():
                self._kept[key] = torch.empty(self.capacity, *shape, dtype=dtype)
        return self._kept[key][:rows]


class Plan:
    """The bound calls of a step of ``rows`` sequences, one token each (the module docstring's listing), on
    ``scratch``'s buffers: ``step`` for one sequence in a :class:`KVCache`, ``step_paged`` for a serving batch's
    decodes (:mod:`minillm.fast.replay_serving`)."""

    def __init__(self, model: Transformer, scratch: Scratch, rows: int):
        cfg, weight = model.config, model.embed.weight
        self.embed, self.rope, self.ln_final, self.dtype = weight, model.rope, model.ln_final, weight.dtype
        self.scratch, self.lock = scratch, scratch.lock  # (the C calls hold its buffers' addresses, not them)
        self.x = scratch.get("x", rows, cfg.d_model, dtype=self.dtype)  # the residual stream
        self.down = scratch.get("down", rows, cfg.d_model, dtype=self.dtype)  # the MLP's output, added in the next norm
        self.final = scratch.get("final", rows, cfg.d_model, dtype=self.dtype)
        self.logits = scratch.get("logits", rows, cfg.vocab_size, dtype=self.dtype)
        self.layers = [_Layer(block, self.x, self.down, i == 0, scratch) for i, block in enumerate(model.blocks)]
        self.lm_head = _product(model.lm_head, self.final, self.logits)
        self.cache_rows = [block.attn.layer for block in model.blocks]  # (the layer each block's K/V belong to)
        self._cache: tuple | None = None  # (a weak reference to the last cache, its k and v, each layer's _Slot)

    def step(self, token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One sequence's step: token_ids [1] int64 at position ``cache.length`` -> logits [1, vocab] float32."""
        pos = cache.length
        cos, sin = self._start(token_ids, torch.arange(pos, pos + 1))
        for layer, slot in zip(self.layers, self._slots(cache)):
            layer.project(cos, sin)
            layer.attend_one(pos, slot)
            layer.finish()
        return self._logits()

    def step_paged(self, batch) -> torch.Tensor:
        """A serving batch of decodes (a :class:`~minillm.fast.paged_attention.FastPagedBatch`: one token a request,
        in order, every one sampling) -> logits [rows, vocab] float32."""
        cos, sin = self._start(batch.token_ids, batch.positions)
        cache = batch.cache
        ranges = (batch.decode_block_tables.contiguous(), batch.decode_first, batch.decode_context_lens,
                  kernels.paged_keys_per_task(cache.block_size))  # (once a step, for every layer)
        for layer, row in zip(self.layers, self.cache_rows):
            layer.project(cos, sin)
            cache.write(row, layer.k_new, layer.v_new, batch.slots)
            layer.attend_paged(cache.k[row], cache.v[row], *ranges)
            layer.finish()
        return self._logits()

    def _start(self, token_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x = the tokens' embeddings; returns RoPE's cos and sin [rows, head_dim] at their positions."""
        torch.index_select(self.embed, 0, token_ids, out=self.x)
        return self.rope(positions, self.dtype)

    def _logits(self) -> torch.Tensor:
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
    """A block's calls for ``rows`` tokens (one a sequence), bound to the plan's residual stream ``x`` [rows, d_model]
    and the previous layer's MLP output ``down`` (nothing to add before the first layer's norm), and to the scratch's
    buffers: ``project`` (the norm, q|k|v, RoPE), then one of the attentions, then ``finish`` (o, the second norm,
    the MLP)."""

    def __init__(self, block: FastBlock, x: torch.Tensor, down: torch.Tensor, first: bool, scratch: Scratch):
        attn, mlp, lib, dtype, rows = block.attn, block.mlp, kernels.kernels(), x.dtype, x.shape[0]
        H, KV, D, F_ = attn.n_heads, attn.n_kv_heads, attn.head_dim, mlp.down_proj.in_features
        self.lib, self.threads, self.is_bf16 = lib, torch.get_num_threads(), dtype == torch.bfloat16
        self.shape, self.scale = (rows, H, KV, D), score_scale(attn)
        get = scratch.get
        h = get("h", rows, x.shape[1], dtype=dtype)  # each norm's output
        qkv = get("qkv", rows, (H + 2 * KV) * D, dtype=dtype).view(1, rows, -1)  # FastAttention's [B, T, (H + 2 KV) D]
        q_rot, k_rot = get("q_rot", rows, H, D, dtype=dtype), get("k_rot", rows, KV, D, dtype=dtype)
        # the attention kernels read a float32 q and write a float32 output; in bfloat16 both are copies, as eagerly
        self.q32 = get("q32", rows, H, D, dtype=torch.float32) if self.is_bf16 else q_rot
        self.out32 = get("out32", rows, H * D, dtype=torch.float32)
        self.attn_out = get("attn_out", rows, H * D, dtype=dtype) if self.is_bf16 else self.out32
        o, gate_up = get("o", rows, x.shape[1], dtype=dtype), get("gate_up", rows, 2 * F_, dtype=dtype)
        act = get("act", rows, F_, dtype=dtype)

        self.norm_in = _rms_norm(block.ln1, x, None if first else down, h)
        self.qkv = _product(attn.qkv.module, h.view(1, rows, -1), qkv)
        q, k, v = (t.view(1, rows, -1, D).transpose(1, 2) for t in qkv.split((H * D, KV * D, KV * D), -1))
        self.rope_in = (q.data_ptr(), k.data_ptr())  # (then cos and sin, which move)
        self.rope_rest = (q_rot.data_ptr(), k_rot.data_ptr(), 1, rows, H, KV, D, *q.stride()[:3], *k.stride()[:3],
                          self.is_bf16, self.threads)
        self.q_new, self.k_new, self.v_new = q_rot, k_rot, v[0].transpose(0, 1)  # [rows, H, D], [rows, KV, D] x2
        self.o = _product(attn.o_proj, self.attn_out, o)
        self.norm_mid = _rms_norm(block.ln2, x, o, h)
        self.gate_up = _product(mlp.gate_up.module, h, gate_up)
        self.act = _activation(gate_up, act, lib, self.threads)
        self.down = _product(mlp.down_proj, act, down)

    def project(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.norm_in()
        self.qkv()
        self.lib.rope(*self.rope_in, cos.data_ptr(), sin.data_ptr(), *self.rope_rest)

    def attend_one(self, pos: int, slot: _Slot) -> None:
        """One sequence's token: its K/V into the cache at ``pos``, then decode_attention over positions 0..pos."""
        _, H, KV, D = self.shape
        slot.k.select(1, pos).copy_(self.k_new[0])
        slot.v.select(1, pos).copy_(self.v_new[0])
        if self.is_bf16:
            self.q32.copy_(self.q_new)
        if self.lib.decode_attention(self.q32.data_ptr(), slot.k_ptr, slot.v_ptr, self.is_bf16, self.out32.data_ptr(),
                                     1, H, KV, pos + 1, D, *slot.strides, self.scale, self.threads):
            raise MemoryError("decode_attention could not allocate its partial results or a thread's float32 copy")
        self._attention_out()

    def attend_paged(self, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, first: torch.Tensor,
                     last: torch.Tensor, keys_per_task: int) -> None:
        """Each row's query over its sequence's keys in a serving pool (one layer's [num_blocks, block_size, KV, D],
        this step's K/V already written): paged_decode_attention over positions first[b] <= j < last[b], tables
        [rows, max_blocks] int64 contiguous, ``keys_per_task`` the pool's
        :func:`~minillm.fast.kernels.paged_keys_per_task` (worked out once a step)."""
        rows, H, KV, D = self.shape
        if self.is_bf16:
            self.q32.copy_(self.q_new)
        if self.lib.paged_decode_attention(self.q32.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), self.is_bf16,
                                           self.out32.data_ptr(), tables.data_ptr(), first.data_ptr(),
                                           last.data_ptr(), rows, H, KV, D, k_pool.shape[1], tables.shape[1],
                                           keys_per_task, self.scale, self.threads):
            raise MemoryError("paged_decode_attention could not allocate a chunk's float32 keys and values")
        self._attention_out()

    def _attention_out(self) -> None:
        if self.is_bf16:
            self.attn_out.copy_(self.out32)

    def finish(self) -> None:
        self.o()
        self.norm_mid()
        self.gate_up()
        self.act()
        self.down()


def _product(module, x: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
    """``out = x @ Wᵀ`` on fixed buffers: the C loop the module runs for x (:class:`MatvecLinear`'s loops over a few
    rows, :class:`FastQuantizedLinear`'s quantized_matvec), called directly, or else the module itself (F.linear, a
    packed copy, the matrix units, a bias), its result copied into ``out``."""
    lib = kernels.kernels()
    kernel = module.kernel(x) if type(module) is MatvecLinear else None  # (a subclass: its own forward, called)
    if kernel in C_PRODUCTS and module.bias is None:
        weight = module.weight
        return _c_call(getattr(lib, kernel), x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
                       weight.shape[0], weight.shape[1], torch.get_num_threads())
    if type(module) is FastQuantizedLinear and module.runs_matvec(x) and module.bias is None:
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
        return _c_call(silu_mul, gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1], threads)
    gate, up = gate_up.chunk(2, dim=-1)
    return lambda: torch.mul(F.silu(gate), up, out=out)


def _c_call(function, *args) -> Callable[[], None]:
    """``function(*args)``, its arguments bound; a status other than 0 (None: no status) raises MemoryError (the
    kernels' scratch could not be allocated)."""
    def call():
        if function(*args):
            raise MemoryError(f"{function.__name__} could not allocate its scratch memory")
    return call
