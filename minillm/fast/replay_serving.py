"""A serving engine's decode step replayed: the batch's kernel calls bound once per batch size, then run again.

The serving engine's step is :meth:`Transformer.forward` over the flat batch (minillm/serving/paged_attention.py):
at SmolLM2-135M's batch of 32 bfloat16 decodes on the developers' 2-core AMD EPYC, 7.4 of its 53 ms went to the
Python between the C kernels (views, splits, dtype casts, empty outputs, the modules' calls and checks), as one
sequence's step lost it before :mod:`minillm.fast.replay`. A step whose requests all decode (one token each, every
one sampling: no prefill chunk beside them) runs :class:`~minillm.fast.replay.Plan`'s ``step_paged`` instead: the
same kernel calls on the same inputs in the same order, bound once per number of rows, with only what moves filled
in each step (the tokens, their positions' RoPE angles, their pool slots, the block tables, the context lengths)::

    x = embed[tokens]                                  x: [B, d_model], one row a request
    for each layer:
        h = rms_norm(x += down, ln1)
        q|k|v = h @ W_qkvᵀ;  q, k = rope(q, k, cos[positions], sin[positions])
        pool[slots] = k, v                             each request's new entry, in its block
        attn = paged_decode_attention(q, pool, block_tables, context_lens)
        h = rms_norm(x += attn @ W_oᵀ, ln2);  down = silu_mul(h @ W_gate|upᵀ) @ W_downᵀ
    logits = lm_head(ln_final(x + down))               [B, vocab]

The logits and the pool are the eager step's bit for bit (tests/fast/test_replay_serving.py). A step with a prefill
chunk, a model the replay does not fit, a hook, or the reference batch (``--no-fast``) runs the eager forward.
"""

from __future__ import annotations

import torch

from ..model import Transformer
from .paged_attention import FastPagedBatch
from .replay import ModelState, Plan, Scratch, replay_fits


class ReplayedServingStep:
    """The serving engine's decode-only step, replayed (given as ``model.replayed_batch``, which
    :func:`~minillm.serving.model_runner.run_model` asks): ``step(model, batch) -> logits [B, vocab]`` float32,
    :func:`~minillm.serving.paged_attention.forward_batch`'s values bit for bit.

    ``step.applies(model, batch)``: a :class:`FastPagedBatch` of decodes only (one token a request, every request
    sampling), a model :func:`~minillm.fast.replay.replay_fits`, no forward hook. A plan is kept per batch size
    (its calls only: every plan writes the same buffers, sized for the largest batch met, a few MiB), all made
    again when the model changes (:class:`~minillm.fast.replay.ModelState`). Steps run one at a time.
    """

    compiles = False

    def __init__(self):
        self._state: ModelState | None = None
        self._fit = False
        self._plans: dict[int, Plan] = {}
        self._scratch: Scratch | None = None

    def __getstate__(self) -> dict:
        # (addresses do not copy: a copy plans for itself)
        return {"_state": None, "_fit": False, "_plans": {}, "_scratch": None}

    def applies(self, model: Transformer, batch) -> bool:
        if not isinstance(batch, FastPagedBatch):
            return False
        rows = len(batch.token_ids)
        return (not batch.prefills and rows > 0 and isinstance(batch.decode_span, slice)
                and len(batch.decode_rows) == rows and len(batch.logits_rows) == rows and self._fits(model)
                and not self._state.hooked())

    def __call__(self, model: Transformer, batch: FastPagedBatch) -> torch.Tensor:
        if not self.applies(model, batch):
            raise ValueError("the replayed serving step runs a fast batch of decodes only, of a model whose blocks run "
                             "in C, without forward hooks; call minillm.serving.paged_attention.forward_batch")
        plan = self._plan(model, len(batch.token_ids))
        with plan.lock, torch.inference_mode():
            return plan.step_paged(batch)

    def _fits(self, model: Transformer) -> bool:
        if self._state is None or not self._state.holds(model):
            self._state, self._fit = ModelState(model), replay_fits(model)
            self._plans, self._scratch = {}, None
        return self._fit

    def _plan(self, model: Transformer, rows: int) -> Plan:
        if self._scratch is None or rows > self._scratch.capacity:  # (every plan wrote the old buffers: all anew)
            self._plans, self._scratch = {}, Scratch(1 << (rows - 1).bit_length())  # (a power of two: few re-plans)
        if rows not in self._plans:
            self._plans[rows] = Plan(model, self._scratch, rows)
        return self._plans[rows]
