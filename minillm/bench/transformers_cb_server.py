"""transformers' continuous batching behind a minimal OpenAI-compatible ``/v1/completions``.

The peer benchmark (``benchmarks/serving_peers.py``) drives every engine the same way: streaming
``/v1/completions`` with token-id prompts and ``ignore_eos``, timed on the client
(:mod:`minillm.bench.http_client`). ``transformers serve --continuous-batching`` takes only a text
prompt and has no ``ignore_eos``, so this shim puts transformers' own engine,
``ContinuousBatchingManager`` (paged KV cache, FIFO scheduler; what ``model.generate_batch`` runs),
behind the few fields the benchmark sends::

    POST /v1/completions {"prompt": [ids], "max_tokens": n, "ignore_eos": true, "stream": true}
      -> manager.add_request(ids, max_new_tokens=n, eos_token_id=-1 with ignore_eos, streaming=True)
      <- data: {"choices": [{"text": ..., "token_ids": [new ids]}]}    each time the manager delivers
      <- data: {"choices": [{"finish_reason": "length"}], "usage": {...}}
      <- data: [DONE]

Greedy only (the benchmark sends temperature 0); prefix sharing off (``allow_block_sharing=False``),
as the other peers run without a prefix cache. Run::

    python -m minillm.bench.transformers_cb_server --model weights/smollm2-135m-instruct --port 8001 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_app(model_dir: str, dtype: str, served_name: str, max_num_seqs: int = 32, max_batch_tokens: int = 512,
              num_blocks: int = 128):
    """The FastAPI app: the model loaded (``dtype``), its manager started (stopped on shutdown).

    The batch limits are minillm serve's defaults (``max_num_seqs`` requests, ``max_batch_tokens``
    per step); ``num_blocks`` pages of 256 tokens hold 32 requests of 1,024 tokens. Left to itself,
    transformers sizes its cache from 60% of the machine's free RAM.

    Raises OSError when ``model_dir`` holds no transformers model, KeyError for a dtype not in DTYPES."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = ContinuousBatchingConfig(allow_block_sharing=False, max_batch_tokens=max_batch_tokens,
                                      max_requests_per_batch=max_num_seqs, num_blocks=num_blocks)
    manager = model.init_continuous_batching(GenerationConfig(do_sample=False, eos_token_id=tokenizer.eos_token_id),
                                             continuous_batching_config=config)
    ids = itertools.count()

    @asynccontextmanager
    async def lifespan(app):
        manager.start()
        yield
        manager.stop(block=True, timeout=10)

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model",
                                            "dtype": str(model.dtype).removeprefix("torch.")}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        prompt, max_tokens = body.get("prompt"), body.get("max_tokens")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            return JSONResponse({"error": {"message": "prompt must be a list of token ids"}}, status_code=400)
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            return JSONResponse({"error": {"message": "max_tokens must be an integer >= 1"}}, status_code=400)
        request_id = f"cmpl-{next(ids)}"
        outputs: asyncio.Queue = asyncio.Queue()
        manager.register_result_handler(request_id, outputs.put_nowait)  # before add_request: no output missed
        manager.add_request(prompt, request_id=request_id, max_new_tokens=max_tokens, streaming=True,
                            eos_token_id=-1 if body.get("ignore_eos") else None)
        return StreamingResponse(_events(manager, request_id, outputs, tokenizer, len(prompt), served_name),
                                 media_type="text/event-stream")

    return app


async def _events(manager, request_id: str, outputs: asyncio.Queue, tokenizer, n_prompt: int, model: str):
    """The SSE stream of one request: a chunk per delivery with its new token ids, then the usage.
    A client that goes away (the benchmark's timeout) cancels its request in the manager."""
    sent, finished = 0, False
    try:
        while not finished:
            out = await outputs.get()
            if out.error is not None:
                yield _sse({"error": {"message": str(out.error)}})
                return
            new, sent, finished = out.generated_tokens[sent:], len(out.generated_tokens), out.is_finished()
            if new:
                yield _sse({"id": request_id, "object": "text_completion", "model": model,
                            "choices": [{"index": 0, "text": tokenizer.decode(new), "token_ids": new,
                                         "finish_reason": None}]})
    finally:
        if not finished:
            manager.cancel_request(request_id)
    usage = {"prompt_tokens": n_prompt, "completion_tokens": sent, "total_tokens": n_prompt + sent}
    yield _sse({"id": request_id, "object": "text_completion", "model": model,
                "choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage})
    yield "data: [DONE]\n\n"


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a transformers model folder (config.json, safetensors)")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--served-model-name", default="transformers-cb")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="most requests in one batch")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per step")
    parser.add_argument("--num-blocks", type=int, default=128, help="KV cache pages of 256 tokens")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    import uvicorn

    app = build_app(args.model, args.dtype, args.served_model_name, args.max_num_seqs, args.max_batch_tokens,
                    args.num_blocks)
    print(f"transformers {transformers.__version__} continuous batching: {DTYPES[args.dtype]} weights and KV cache, "
          f"{torch.get_num_threads()} threads", flush=True)  # what the peer benchmark reports it ran
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
