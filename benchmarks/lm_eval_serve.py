"""lm-eval against `minillm serve`, end to end (issue 31, item 2).

Starts `minillm serve` (the default model, SmolLM2-135M-Instruct, on the CPU) as its own process,
then runs lm-eval's `local-completions` model on a HellaSwag-like task kept in tests/data/lm_eval
(24 contexts, four endings each: 96 loglikelihood requests, each one `/v1/completions` with the
prompt's token ids, `echo: true, logprobs: 1, max_tokens: 1`). lm-eval finds the server's
tokenizer itself (vLLM's /tokenizer_info and /tokenize). No network: the data is local JSON.
Prints lm-eval's accuracy (acc: the ending with the highest loglikelihood; acc_norm: per
character) and the time taken.

    python benchmarks/lm_eval_serve.py                    # needs the dev extra (lm-eval)
    python benchmarks/lm_eval_serve.py --task minillm_mc --num-concurrent 1
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

TASKS = Path(__file__).resolve().parents[1] / "tests" / "data" / "lm_eval"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def task_config(name: str, cache_dir: str) -> dict:
    """The task's YAML as lm-eval's config dict, its data file made absolute."""
    path = TASKS / f"{name}.yaml"
    config = yaml.safe_load(path.read_text())
    files = config["dataset_kwargs"]["data_files"]
    repo = TASKS.parents[2]
    config["dataset_kwargs"] = dict(config["dataset_kwargs"], cache_dir=cache_dir,
                                    data_files={split: str(repo / f) for split, f in files.items()})
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="minillm serve's --model (default: its default model)")
    parser.add_argument("--task", default="minillm_hellaswag", help="a task YAML in tests/data/lm_eval")
    parser.add_argument("--num-concurrent", type=int, default=4, help="lm-eval's concurrent requests")
    parser.add_argument("--limit", type=int, default=None, help="only the first N documents")
    args = parser.parse_args()
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    import lm_eval  # after the environment: datasets reads it on import

    port = free_port()
    command = [sys.executable, "-m", "minillm", "serve", "--port", str(port), "--served-model-name", "minillm"]
    if args.model:
        command += ["--model", args.model]
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"minillm serve did not start: {' '.join(command)}")
            time.sleep(0.5)
        with tempfile.TemporaryDirectory() as cache_dir:
            start = time.perf_counter()
            results = lm_eval.simple_evaluate(
                model="local-completions",
                model_args={"base_url": f"{url}/v1/completions", "model": "minillm", "tokenizer_backend": "auto",
                            "num_concurrent": args.num_concurrent, "max_retries": 1},
                tasks=[task_config(args.task, cache_dir)], limit=args.limit, log_samples=True)
            seconds = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(60)
    metrics = results["results"][args.task]
    samples = results["samples"][args.task]
    requests = sum(len(s["arguments"]) for s in samples)
    print(f"\nlm-eval local-completions on minillm serve ({args.model or 'the default model'}), task {args.task}: "
          f"{len(samples)} documents, {requests} loglikelihood requests, {args.num_concurrent} concurrent, "
          f"{seconds:.1f} s ({requests / seconds:.1f} requests/s)")
    for name in ("acc", "acc_norm"):
        if f"{name},none" in metrics:
            print(f"  {name:8s} {metrics[f'{name},none']:.3f} (stderr {metrics.get(f'{name}_stderr,none', 0):.3f})")


if __name__ == "__main__":
    main()
