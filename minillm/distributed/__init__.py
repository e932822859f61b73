"""Running a model on several processes: skip it on a first reading.

Tensor parallelism in the Megatron style (Shoeybi et al. 2019, "Megatron-LM", section 3): every
layer's matrices are split across N processes (ranks), each rank computes its slice of every
layer, and the slices meet in two all-reduces per layer. Applied to a loaded model by swapping
modules (as gpt-fast's ``tp.py`` does), so ``model.py`` stays the lesson. ``torch.distributed``
carries the messages: gloo on the CPU, NCCL on GPUs.

    comm.py             the process group a model's ranks share: all-reduce and all-gather, timed
                        into a trace, and the errors when a rank is gone
    tensor_parallel.py  which sizes split, the column / row / vocabulary-parallel linears, shard_model
    launch.py           joining a group (torchrun's environment variables), starting N ranks
                        (``--tensor-parallel-size N``), pinning each rank to a core
    follow.py           rank 0 decides and the other ranks follow: each request sent to every rank
    engine.py           the serving engine split the same way: rank 0 schedules and samples, the others
                        run each step's batch on their shard of the paged KV cache

Disaggregated prefill and decode (lesson 10, for real: two processes, the K/V sent between them):

    disaggregated.py             the two-worker engine
    disaggregated_transfer.py    the hand-off of a finished prompt's K/V
    disaggregated_workers.py     the prefill and the decode worker processes
"""
