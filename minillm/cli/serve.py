"""minillm serve: an OpenAI-compatible HTTP server on the batching engine (vLLM's ``vllm serve``, in small)."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
import threading
import time

from .common import (UsageError, check_kv_offload, default_token_budget, ensure_model, keep_freed_memory_in_command,
                     kv_offload_options, model_options, thread_governor)
from .tensor_parallel import run_tensor_parallel, tensor_parallel_option, tensor_parallel_size

# After the engine is lost (a tensor-parallel rank died), how long the server answers 503 with the reason before
# it exits: long enough for the failed requests' error events and for a client or a health check to read why.
ENGINE_DEATH_GRACE_S = 2.0


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                     "/v1/models, /metrics) on the batching engine",
                       epilog="Memory: the server keeps what it frees for the next step (glibc's malloc; "
                              "MINILLM_MALLOC_POLICY=off, or your own MALLOC_* or LD_PRELOAD, leaves the allocator "
                              "as it is): 125 -> 148 output tok/s on BENCHMARKS.md's serving workload, in process. "
                              "It hands loading's freed memory back once the engine is built, and keeps 16 of "
                              "oneDNN's compiled kernels per cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY, "
                              "LRU_CACHE_CAPACITY; yours win) instead of 1,024 for every batch shape: a bfloat16 "
                              "server's memory stayed within its weights + KV pool + 400 MiB (BENCHMARKS.md). "
                              "Its KV pool asks Linux for 2 MiB pages: a decode step's attention over scattered "
                              "blocks ~10 % faster, at a start that can take seconds longer where memory is "
                              "fragmented (MINILLM_MALLOC_POLICY=off: 4 KiB pages).")
    model_options(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 opens it to every machine that can reach this one "
                        "(with no --api-key, anyone there can use it: only on a network you trust)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--served-model-name", help="the name clients send as \"model\" (vLLM's flag; default: --model)")
    p.add_argument("--kv-cache-memory", default="512MiB", help="the paged KV pool: a size (512MiB, 2GiB) or a "
                                                               "fraction of free memory (0.3)")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV block")
    p.add_argument("--max-num-seqs", type=int, default=32, help="most requests in one batch")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="token budget of one engine step (default: 2048 for a bfloat16 model, vLLM's CPU server "
                        "default; 512 otherwise: BENCHMARKS.md says why)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps so decodes keep flowing (vLLM's flag; default: on)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="requests share the KV blocks of a common prompt prefix (vLLM's flag; default: on)")
    kv_offload_options(p)
    p.add_argument("--max-waiting-requests", type=int,
                   help="answer 503 while this many requests wait for a slot (default: no limit)")
    p.add_argument("--api-key", default=os.environ.get("MINILLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 requests (vLLM's flag; default: "
                        "$MINILLM_API_KEY, else no key)")
    p.add_argument("--pack-weights", action="store_true",
                   help="CPU, float32 or --quantize: keep a second copy of each matrix, packed at the first batch "
                        "for the products of a batch's rows (float32 9-256, int8/int4 4-128 on a CPU without "
                        "AMX-INT8): twice the weights' "
                        "memory for ~18%% more output tok/s (SmolLM2-135M float32, BENCHMARKS.md). Default: one "
                        "copy of the weights")
    p.add_argument("--threads", type=int,
                   help="torch.set_num_threads, fixed: fastest on an idle machine, several times slower while "
                        "other processes keep cores busy (default: one thread per core they leave free, "
                        "re-measured every second)")
    tensor_parallel_option(p, "schedules, samples and answers the clients; the others run each step's batch")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, let running requests finish for this long, then end them with an "
                        "error (default: 30; a second Ctrl-C quits at once)")
    p.add_argument("--keep-alive-on-engine-death", action="store_true",
                   help="when the engine is lost for good (a tensor-parallel rank died), keep serving: completions, "
                        "chat completions and /health get 503 with the reason until the server is stopped. Default: "
                        f"503 for {ENGINE_DEATH_GRACE_S:g} s, then exit with status 1, so that a supervisor "
                        "restarts it (vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH)")
    p.set_defaults(run=run_serve)


def run_serve(args) -> int:
    n = tensor_parallel_size(args, ["quantize", "threads", "pack_weights", "kv_offload_memory", "kv_offload_dir",
                                    "kv_offload_disk_size"])
    if n == 1 or int(os.environ.get("RANK", 0)) == 0:  # a follower's port is rank 0's
        _check_args(args)
    try:
        from ..serving.server.app import create_app, serve  # noqa: F401  (the extra is there)
    except ImportError as error:  # the serve extra is optional
        raise UsageError(f"minillm serve needs the serve extra ({error.name} is missing): "
                         "pip install 'minillm[serve]'") from None
    keep_freed_memory_in_command()
    return run_tensor_parallel(args, n, _run_serve) if n > 1 else _run_serve(args)


def _run_serve(args, group=None) -> int:
    """Load, build the engine, serve until stopped; with a tensor-parallel ``group``, rank 0 serves and the
    other ranks follow its steps (minillm/distributed/engine.py).

    When a rank dies, the step in flight fails its requests with one line naming the rank (a stream: an error
    event, then ``[DONE]``) and the launcher stops the other ranks. New requests and /health get 503 with that
    line for ENGINE_DEATH_GRACE_S, then the server shuts down as on SIGTERM and this prints the line and
    returns 1: a server that cannot serve exits, and a supervisor restarts it, as vLLM's does when its engine
    dies. ``--keep-alive-on-engine-death`` keeps answering 503 until stopped instead."""
    from ..loading import load_model
    from ..fast.packing import pack_panels
    from ..malloc_policy import give_back_freed_memory
    from ..serving.engine import LLMEngine
    from ..serving.server.app import create_app, serve
    from ..serving.server.async_engine import AsyncEngine
    from ..tokenizer import load_tokenizer

    folder = ensure_model(args.model, args.weights_dir)
    if group is not None and group.rank:  # a follower: no engine, no server
        from ..distributed.follow import follow

        follow(_load_sharded(args, folder, group), group)
        return 0

    def build_engine() -> LLMEngine:  # in the engine thread, which then steps it (AsyncEngine._run says why)
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        model = _load_sharded(args, folder, group) if group is not None else load_model(
            folder, device=args.device, dtype=args.dtype, quantize=args.quantize, fast=args.fast)
        if args.pack_weights:
            pack_panels(model)
        engine = LLMEngine(model, load_tokenizer(folder), kv_cache_memory=args.kv_cache_memory,
                           block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens or default_token_budget(model),
                           enable_chunked_prefill=args.enable_chunked_prefill,
                           enable_prefix_caching=args.enable_prefix_caching,
                           kv_offload_memory=args.kv_offload_memory, kv_offload_dir=args.kv_offload_dir,
                           kv_offload_disk_size=args.kv_offload_disk_size)
        if group is not None:
            from ..distributed.engine import lead_engine

            lead_engine(engine)  # each step's batch goes to the other ranks first
        give_back_freed_memory()  # loading's one-off buffers, which the malloc policy would keep (~150 MiB)
        return engine

    async_engine = AsyncEngine(build_engine, args.max_waiting_requests)
    engine, tokenizer = async_engine.engine, async_engine.engine.tokenizer
    governor = thread_governor(engine.model) if not args.threads and group is None else None
    if governor is not None:  # fewer threads while busy
        async_engine.before_step = governor.adjust
    if group is not None and group.first_dead is not None:
        _watch_ranks(group, async_engine)
    name = args.served_model_name or str(args.model)
    app = create_app(async_engine, tokenizer, name, api_key=args.api_key)
    print(_banner(args.host, args.port, name, engine), file=sys.stderr, flush=True)
    if args.api_key:
        print("  /v1 needs the header 'Authorization: Bearer <the --api-key>'", file=sys.stderr, flush=True)
    try:
        serve(app, args.host, args.port, args.shutdown_timeout,
              exit_on_lost_s=None if args.keep_alive_on_engine_death else ENGINE_DEATH_GRACE_S)
    finally:
        async_engine.close()
        if group is not None and async_engine.lost is None:
            from ..distributed.follow import lead

            lead(group, None)  # the followers stop (after a rank died, rank 0's launcher stops them)
    if group is not None and async_engine.lost is not None:
        print(f"minillm: error: {async_engine.lost}", file=sys.stderr)  # what /health said since
        return 1
    return 0


RANK_POLL_S = 1.0  # how often rank 0 of an idle tensor-parallel server looks at the other ranks


def _watch_ranks(group, async_engine) -> None:
    """Rank 0's watchdog: a rank that dies while no step runs (no collective to fail) is seen within
    RANK_POLL_S and handled as a step would handle it (AsyncEngine.lose), not at the next request."""
    def watch() -> None:
        while async_engine.is_alive():
            time.sleep(RANK_POLL_S)
            if group.first_dead() is not None:  # who_died names it and stops and reaps the others
                async_engine.lose(f"rank 0 of {group.world_size}: {group.who_died()}, seen while idle")
                return

    threading.Thread(target=watch, name="minillm-rank-watchdog", daemon=True).start()


def _load_sharded(args, folder, group):
    """This rank's shard of the model (tensor parallelism: the lesson's float model, minillm/distributed)."""
    from ..distributed.tensor_parallel import shard_model
    from ..loading import load_model

    return shard_model(load_model(folder, device=group.device, dtype=args.dtype, quantize=args.quantize, fast=False),
                       group)


def _check_pack_weights(args) -> None:
    """--pack-weights only where a packed copy is used: the speed layer's float32 or int8/int4 products on a CPU."""
    if not args.fast:
        raise UsageError("--pack-weights packs the speed layer's products; drop --no-fast or --pack-weights")
    from ..device import resolve_device

    device = args.device or resolve_device(None).type  # (load_model's default: cuda where there is one)
    if not device.lower().startswith("cpu"):
        raise UsageError(f"--pack-weights packs for a CPU's products; on {device} drop --pack-weights "
                         "(or serve with --device cpu)")
    if args.quantize is None and args.dtype not in (None, "float32"):
        raise UsageError(f"--pack-weights packs float32 or int8/int4 matrices; {args.dtype} keeps one copy "
                         "(its products never read a packed one); drop --pack-weights")
    from ..fast import kernels

    if args.quantize and kernels.quantized_amx_ready():
        raise UsageError(f"--pack-weights packs {args.quantize} codes for the vector units, but this CPU multiplies "
                         "them on its matrix units (AMX-INT8), which read no packed copy; drop --pack-weights")


def _check_args(args) -> None:
    """One-line usage errors before the model loads, the port's too (uvicorn would only log it)."""
    from ..serving.paged_cache import parse_memory

    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    for flag, value in (("--block-size", args.block_size), ("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.pack_weights:
        _check_pack_weights(args)
    if not args.shutdown_timeout >= 0:
        raise UsageError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout:g}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise UsageError(f"--max-waiting-requests must be >= 1 (leave it out for no limit), "
                         f"got {args.max_waiting_requests}")
    for flag, value in (("--served-model-name", args.served_model_name), ("--api-key", args.api_key)):
        if value is not None and not value.strip():
            raise UsageError(f"{flag} is empty; give a value or leave the option out")
    try:
        parse_memory(args.kv_cache_memory, available_bytes=1)
    except ValueError as e:
        raise UsageError(f"--kv-cache-memory: {e}") from None
    check_kv_offload(args)
    try:  # bind as uvicorn will, so that a port in use or a bad host fails now, in one line
        with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((args.host, args.port))
    except OSError as e:
        fix = ("pick another --port or stop what uses it" if e.errno == errno.EADDRINUSE
               else "give --host an address of this machine (127.0.0.1, or 0.0.0.0 for all)")
        raise UsageError(f"cannot listen on {args.host}:{args.port} ({e.strerror}); {fix}") from None


def _banner(host: str, port: int, name: str, engine) -> str:
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    from ..serving.server.app import max_model_len

    return (f"minillm serve: {name} at {url}  ({engine.cache.allocator.num_blocks} KV blocks of "
            f"{engine.cache.block_size}, requests up to {max_model_len(engine)} tokens; Ctrl-C stops)\n"
            f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], "
            f"\"temperature\": 0}}'\n"
            f"  metrics: {url}/metrics   models: {url}/v1/models   live view: {url}/")
