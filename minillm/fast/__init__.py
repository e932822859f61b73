"""The speed layer: skip it on a first reading. The same model, faster, by swapping modules.

The course's files (``model.py``, ``phases.py``, ``kv_cache.py``, ...) are plain PyTorch. This
package makes the same weights decode faster without touching them: it swaps in subclasses of
their modules that keep every parameter (same names, same tensors), so checkpoints, prefix-cache
fingerprints and the logits stay the same up to float rounding. ``load_model(..., fast=True)``
(the default) applies it through :func:`minillm.fast.choose.choose_decode_path`;
``load_model(..., fast=False)`` and ``--no-fast`` run the lesson's code alone.

    products.py   few-row products split over threads, or in C (nn.Linear subclasses)
    kernels.py    the C loops (matvec_kernels.c) and their torch ops (matvec_ops.cpp), built at first use
    packing.py    q|k|v and gate|up stacked into one product each, float or quantised
    attention.py  Attention with the stacked q|k|v, and decode's attention in C
    paged_attention.py  the serving batch's decodes attending in C over the KV pool's blocks in place
    compile.py    the decode step compiled over a static view of the KV cache
    choose.py     which of these a model gets: by rule when it loads; measured only when asked
"""
