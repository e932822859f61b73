"""Fuzz `minillm serve` for minutes with requests generated from its OpenAPI document (issue 40, item 5).

The longer run of tests/serving/server/test_server_fuzz.py (which CI runs for about a minute): the same
cases and rules (tests/serving/server/fuzz_requests.py: no 5xx, every 4xx OpenAI's error JSON naming its
field, and a greedy chat stream looping through it all gets the quiet server's tokens every time),
against a server in this process on 127.0.0.1 serving a tiny random model with SmolLM2's
tokenizer and chat template (the HTTP layer is under test, not the model: answers come in
milliseconds). A random seed each run unless given; prints the statuses it got and each distinct
problem once with a request that shows it.

    python benchmarks/fuzz_server.py                      # 5 minutes
    python benchmarks/fuzz_server.py --minutes 30 --seed 7
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "serving" / "server")]

from fuzz_requests import QuietStream, fuzz  # noqa: E402
from tiny_models import CONFIGS, build_hf, save_hf  # noqa: E402

import minillm  # noqa: E402
from minillm.serving.engine import LLMEngine  # noqa: E402
from minillm.serving.server.app import create_app, run_in_thread  # noqa: E402
from minillm.serving.server.async_engine import AsyncEngine  # noqa: E402

MODEL_NAME = "minillm-fuzz"


def tiny_chat_model():
    """tests/conftest.py's tiny_chat: a random 2-layer Llama with SmolLM2's vocabulary."""
    family, kwargs = CONFIGS["llama_gqa"]
    kwargs = dict(kwargs, vocab_size=49152, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    folder = save_hf(build_hf(family, kwargs), Path(tempfile.mkdtemp(prefix="minillm-fuzz-")))
    return minillm.load_model(folder, device="cpu"), minillm.load_tokenizer("smollm2-135m-instruct")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--max-examples", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=None, help="hypothesis' seed (default: a random one, printed)")
    parser.add_argument("--stream-tokens", type=int, default=128, help="the looping stream's max_tokens")
    args = parser.parse_args()
    seed = random.randrange(2**32) if args.seed is None else args.seed
    model, tokenizer = tiny_chat_model()
    async_engine = AsyncEngine(LLMEngine(model, tokenizer, num_blocks=256, max_num_seqs=8))
    try:
        app = create_app(async_engine, tokenizer, MODEL_NAME)
        with run_in_thread(app) as url:
            stream = QuietStream(url, args.stream_tokens)
            stream.start()
            start = time.perf_counter()
            statuses, problems = fuzz(url, app, MODEL_NAME, args.minutes * 60, args.max_examples, seed)
            elapsed = time.perf_counter() - start
            stream.stop()
    finally:
        async_engine.close()
    sent = sum(statuses.values())
    print(f"seed {seed}: {sent} requests in {elapsed:.0f} s ({sent / elapsed:.1f}/s); statuses: "
          + ", ".join(f"{status} x{count}" for status, count in sorted(statuses.items(), key=str)))
    print(f"the quiet stream ran {stream.runs} times during the fuzzing; {len(stream.mismatches)} differed or failed")
    for mismatch in stream.mismatches[:10]:
        print(f"  {mismatch}")
    print(f"{len(problems)} distinct problem(s)")
    for problem, request in problems.values():
        print(f"\n* {problem}\n  {request}")


if __name__ == "__main__":
    main()
