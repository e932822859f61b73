"""The speed layer: skip it on a first reading. The same model, faster, by swapping modules.

The course's files (``model.py``, ``phases.py``, ``kv_cache.py``, ...) are plain PyTorch. This
package makes the same weights decode faster without touching them: it swaps in subclasses of
their modules that keep every parameter (same names, same tensors), so checkpoints, prefix-cache
fingerprints and the logits stay the same up to float rounding. ``load_model(..., fast=True)``
(the default) applies it through :func:`minillm.fast.choose.choose_decode_path`;
``load_model(..., fast=False)`` and ``--no-fast`` run the lesson's code alone.

What it swaps, by decode path (choose.py's candidates; :data:`SWAPS` holds the same rows as data,
and ``minillm info`` prints them). "C kernels fit": float32 or bfloat16 on a CPU, head_dim a multiple of 8, the
kernels built.

    course piece (minillm.)                 fast piece (minillm.)                     when
    model.Block                             fast.block.FastBlock                      the C paths, C kernels fit
    model.Attention                         fast.attention.FastAttention              every path; decode attention
                                                                                      in C (+ prefill and RoPE in C;
                                                                                      bfloat16 prefill on pairs: AMX
                                                                                      or AVX512-BF16)
    model.SwiGLU                            fast.packing.PackedSwiGLU                 every path, a SwiGLU MLP
    torch.nn.Linear                         fast.products.SplitLinear                 the split paths, a float model
    torch.nn.Linear                         fast.products.MatvecLinear                the C paths, a float model;
                                                                                      CPU bfloat16
    quantize.QuantizedLinear                fast.products.FastQuantizedLinear         every path, a quantised model
    serving.paged_attention.PagedBatch      fast.paged_attention.FastPagedBatch       every path, C kernels fit
    phases.decode_step                      fast.compile.CompiledDecodeStep           the compiled paths
    phases.decode_step                      fast.replay.ReplayedDecodeStep            the replay path (the rule's
                                                                                      choice where the C kernels
                                                                                      build): one sequence's C calls
                                                                                      on fixed buffers
    serving.paged_attention.forward_batch   fast.replay_serving.ReplayedServingStep   the replay path: a server's
                                                                                      step of decodes only, its C calls
                                                                                      bound once per batch size

The files:

    products.py   few-row products split over threads, or in C (nn.Linear subclasses)
    kernels.py    the C kernels (csrc/) and their torch ops, built at first use
    packing.py    q|k|v and gate|up stacked into one product each, float or quantised
    attention.py  Attention with the stacked q|k|v, and decode's and prefill's attention in C
    block.py      the transformer block with its RMSNorms in C, the second fused with the residual add
    paged_attention.py  the serving batch's decodes attending in C over the KV pool's blocks in place
    compile.py    the decode step compiled over a static view of the KV cache
    replay.py     the decode step's C calls bound once to fixed buffers, then replayed each step
    replay_serving.py  the same for a serving engine's step of decodes: a plan per batch size
    choose.py     which of these a model gets: by rule when it loads; measured only when asked

Nothing here is imported by this file: :data:`SWAPS` names the pieces (dotted under ``minillm``,
``torch.`` for PyTorch's own), and tests/fast/test_fast_choose.py checks it against what each decode path
of choose.py swaps in.
"""

from typing import NamedTuple


class Swap(NamedTuple):
    """One row of the swap table: the course's piece, the speed layer's piece put in its place, and when.

    ``when`` names the decode paths ("every path", or choose.CANDIDATES' names), then the conditions a row
    needs, in these words: "C kernels fit" (:data:`C_KERNELS_FIT`), "a float model", "a quantised model", "a SwiGLU MLP".
    """

    course: str  # dotted under minillm ("model.Block": minillm.model.Block), or "torch." for PyTorch's own
    fast: str  # dotted under minillm: a subclass of the course piece, or (for a function) its replacement
    when: str


C_KERNELS_FIT = "float32 or bfloat16 on a CPU, head_dim a multiple of 8, the kernels built"  # (attention.c_kernels_fit)

SWAPS = (
    Swap("model.Block", "fast.block.FastBlock", "the C paths (matvec, replay, compile+matvec), C kernels fit: each "
         "RMSNorm one C call, the second fused with the residual add"),
    Swap("model.Attention", "fast.attention.FastAttention", "every path: q|k|v stacked; the C paths, C kernels fit: decode's attention in C (prefill's too, head_dim a multiple of the panel "
         "width), RoPE of q and k in one C call; in bfloat16 prefill's attention on bfloat16 pairs (AMX tiles or "
         "AVX512-BF16; head_dim a multiple of 32)"),
    Swap("model.SwiGLU", "fast.packing.PackedSwiGLU", "every path, a SwiGLU MLP (the Llama family): gate|up stacked"),
    Swap("torch.nn.Linear", "fast.products.SplitLinear", "the split paths (long-rows+split, row-major+split), a float "
         "model: a few-row product cut over the threads"),
    Swap("torch.nn.Linear", "fast.products.MatvecLinear", "the C paths (matvec, replay, compile+matvec), a float "
         "model: a few rows in C (float32 1-128 rows on an AMD CPU; bfloat16 1-256 on AMX where the CPU has it, else "
         "1-2, 1-128 on an AMD CPU with AVX512-BF16); a server's batches on packed panels (serve --pack-weights)"),
    Swap("quantize.QuantizedLinear", "fast.products.FastQuantizedLinear", "every path, a quantised model: its "
         "products in C on a CPU (on the matrix units where the CPU has AMX-INT8, x in four int8 digits)"),
    Swap("serving.paged_attention.PagedBatch", "fast.paged_attention.FastPagedBatch", "every path, C kernels fit: "
         "the serving engine's decodes attend in C over the pool's blocks in place; a bfloat16 or float16 prefill "
         "chunk that reaches SDPA is padded to a few shapes"),
    Swap("phases.decode_step", "fast.compile.CompiledDecodeStep", "the compiled paths (compile, compile+matvec): the "
         "whole step compiled over a static view of the KV cache"),
    Swap("phases.decode_step", "fast.replay.ReplayedDecodeStep", "the replay path: one sequence's step as the eager C "
         "kernels' calls bound once to fixed buffers, the same bits without the Python between them"),
    Swap("serving.paged_attention.forward_batch", "fast.replay_serving.ReplayedServingStep", "the replay path: a "
         "server's step whose requests all decode, the eager C kernels' calls bound once per batch size, the same "
         "bits"),
)
