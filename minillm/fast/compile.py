"""``torch.compile`` of the decode step: one graph for every step, CUDA graphs on a GPU.

:func:`~minillm.phases.decode_step` changes shape every step: the cache views it
attends over grow by one position. A compiled graph wants fixed shapes, and a CUDA
graph (``mode="reduce-overhead"``) requires them: it replays the recorded kernels on
the same addresses. So the compiled step sees the cache through a *static view*:

    k[layer]: [B, n_kv_heads, max_seq_len, head_dim]   the whole preallocated buffer
              | filled ... | pos | unfilled ...... |
                            ^ the new K/V: index_put_ at pos (a tensor, not a Python int)
    mask:     key j visible  iff  j <= pos              (the unfilled end is hidden)

Every step then has the same shapes, and ``pos`` is data, so one graph serves all
lengths (gpt-fast's design). The price: attention reads the whole buffer, so size the
cache to the request (``KVCache.for_model(model, max_seq_len=prompt + new tokens)``).
The buffer's ``max_seq_len`` is marked dynamic: fixed during a request, it differs between
requests, and a graph per size recompiled every new request (75-115 s each on the developers'
2-core EPYC); one graph with a symbolic size serves them all, as fast (int4 step 17.6 against
18.8 ms, same machine).

Prefill stays eager (one call per request, its length varies anyway). The step runs
:meth:`Transformer.forward` itself: there is one loop over the layers.
"""

from __future__ import annotations

import weakref

import torch

from ..kv_cache import KVCache
from ..model import Transformer
from . import kernels


class StaticKVView:
    """A KVCache seen with fixed shapes: writes at ``pos`` [1] (a tensor), reads whole buffers.

    It is a cache to :class:`~minillm.model.Attention` (``attend``): the queries see the whole
    buffer, with a mask hiding the unfilled end.
    """

    def __init__(self, cache: KVCache, pos: torch.Tensor):
        self.k, self.v = cache.k, cache.v
        _, B, n_kv_heads, max_seq_len, _ = cache.k.shape
        keys = torch.arange(max_seq_len, device=pos.device)
        self.attn_mask = (keys <= pos)[None, :]  # [T=1, max_seq_len] bool
        # (batch, head, position) indices of the entries one decode step writes, each [B, n_kv_heads, 1]
        self.batch = torch.arange(B, device=pos.device).view(B, 1, 1)
        self.heads = torch.arange(n_kv_heads, device=pos.device).view(1, n_kv_heads, 1)
        self.pos = pos.view(1, 1, 1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention,
               window: int | None = None) -> torch.Tensor:
        """Store k, v [B, n_kv_heads, 1, head_dim] at ``pos``; attend over this layer's whole buffers
        (no sliding window: :func:`static_view_limit` keeps such models off the static view)."""
        # index_put_ into the whole [n_layers, ...] buffer, an input the graph updates in place. Writing
        # into the view k[layer] instead makes torch.compile copy that layer's whole buffer every step
        # (3.4x slower decode at 1024 positions, BENCHMARKS-HISTORY.md).
        index = (torch.full_like(self.pos, layer), self.batch, self.heads, self.pos)
        self.k.index_put_(index, k)
        self.v.index_put_(index, v)
        return attention(q, self.k[layer], self.v[layer], self.attn_mask)


def decode_forward_static(model: Transformer, token_ids: torch.Tensor, pos: torch.Tensor, cache: KVCache):
    """One decode forward pass with fixed shapes: token_ids [B, 1] at position ``pos`` [1].

    :meth:`Transformer.forward` itself, over a :class:`StaticKVView`. Does not move
    ``cache.length`` (the caller does). Returns float32 logits [B, vocab].
    """
    return model(token_ids, cache=StaticKVView(cache, pos), positions=pos)[:, -1].float()


def static_view_limit(model: Transformer, cache: KVCache) -> str | None:
    """Why the static view cannot run ``model`` over ``cache``, or None when it can.

    Sliding windows shorter than the cache (its mask is causal only, and it indexes positions,
    not a rolling buffer's slots) and dynamic NTK RoPE (its frequencies change with the length
    at every step) are beyond it.
    """
    cfg = model.config
    windows = [cfg.window(layer) for layer in range(cfg.n_layers) if cfg.window(layer) is not None]
    if any(w < cache.max_seq_len for w in windows):
        return (f"compile_decode_step does not support sliding-window attention (window {windows[0]} < "
                f"the cache's {cache.max_seq_len} positions); use decode_step")
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "dynamic":
        return ("compile_decode_step does not support dynamic NTK RoPE scaling (its frequencies change "
                "with the length at every step); use decode_step")
    return None


def _check_static(model: Transformer, cache: KVCache) -> None:
    if (reason := static_view_limit(model, cache)) is not None:
        raise ValueError(reason)


GRAPHS_PER_PROCESS = 64  # models (shape and precision) one process may decode on a compiled path


class CompiledDecodeStep:
    """A drop-in replacement for :func:`~minillm.phases.decode_step`, compiled with ``torch.compile``.

    Args:
        mode: torch.compile's mode: "default" (fused kernels; CPU), "reduce-overhead"
            (plus CUDA graphs: one launch per step on a GPU), "max-autotune".

    ``step(model, token_id, cache) -> logits [B, vocab]`` (float32) takes decode_step's arguments
    (no hook, no trace) and raises ValueError for a sliding-window model or dynamic RoPE scaling;
    ``step.applies(model, cache)`` says beforehand whether it can run (decode_step asks, and runs
    eagerly otherwise). The first call compiles (seconds to two minutes); later calls reuse the
    graph for every cache length and every cache size. The cache buffers are marked as static
    addresses so CUDA graphs may write them in place.
    """

    compiles = True  # (its first call compiles: seconds to minutes)

    def __init__(self, mode: str = "default"):
        kernels.prepare_for_compile()  # (the C products and attention, as ops)
        # one function serves every model a process runs, a graph for each shape and precision (the parameters'
        # shapes are guarded): dynamo's limit of 8 graphs a function refused a ninth with fullgraph=True
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, GRAPHS_PER_PROCESS)
        self.mode = mode
        self.compiled = torch.compile(decode_forward_static, mode=mode, fullgraph=True)
        self.marked = weakref.WeakSet()  # caches already checked and marked (an id could be reused later)

    def applies(self, model: Transformer, cache) -> bool:
        """A plain KVCache the static view can run (:func:`static_view_limit`)."""
        return type(cache) is KVCache and static_view_limit(model, cache) is None

    def __call__(self, model: Transformer, token_id, cache: KVCache) -> torch.Tensor:
        if cache not in self.marked:  # once a cache, not every step: its size and the model's config do not change
            _check_static(model, cache)
            for buffer in (cache.k, cache.v):  # [n_layers, B, n_kv_heads, max_seq_len, head_dim]
                torch._dynamo.mark_static_address(buffer)
                torch._dynamo.maybe_mark_dynamic(buffer, 3)
            self.marked.add(cache)
        cache.check_room(1)
        device = cache.k.device
        with torch.inference_mode():  # inputs made here are inference tensors whoever calls: no recompile for that
            token_ids = torch.as_tensor(token_id, device=device).reshape(-1, 1).clone()
            pos = torch.tensor([cache.length], device=device)
            logits = self.compiled(model, token_ids, pos, cache)
        cache.advance(1)
        return logits.clone() if self.mode == "reduce-overhead" else logits  # a CUDA graph reuses its output buffer


def compile_decode_step(mode: str = "default") -> CompiledDecodeStep:
    """A compiled decode step (:class:`CompiledDecodeStep`) for any model: one per process is enough."""
    return CompiledDecodeStep(mode)
