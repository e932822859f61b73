"""Does one huge prompt hold up everyone else? (issue 31, item 1)

Serves the default model (`minillm serve`'s app, in this process on 127.0.0.1), starts one
streaming chat, and while it streams sends a 4 MiB and a 31 MiB prompt. Meanwhile /health is
polled every 100 ms. Prints the slowest /health answer, the stream's largest inter-token gap
next to its median, each huge prompt's status and time to its answer, and the process's RSS
before, right after, and 10 s after.

    python benchmarks/server_stall.py
"""

from __future__ import annotations

import json
import resource
import statistics
import threading
import time
from pathlib import Path

import httpx

import minillm
from minillm.serving.engine import LLMEngine
from minillm.serving.server.app import create_app, run_in_thread
from minillm.serving.server.async_engine import AsyncEngine

MiB = 2**20


def rss_mib() -> float:
    """The resident set now (Linux /proc), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def stream_gaps_ms(url: str, out: list[float], done: threading.Event) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 64,
            "stream": True, "ignore_eos": True}
    last = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                if last is not None:
                    out.append((now - last) * 1000)
                last = now
    done.set()


def poll_health_ms(url: str, out: list[float], done: threading.Event) -> None:
    while not done.is_set():
        start = time.perf_counter()
        httpx.get(f"{url}/health", timeout=600)
        out.append((time.perf_counter() - start) * 1000)
        time.sleep(0.1)


def main() -> None:
    model, tokenizer = minillm.load_model("smollm2-135m-instruct"), minillm.load_tokenizer("smollm2-135m-instruct")
    async_engine = AsyncEngine(LLMEngine(model, tokenizer))
    with run_in_thread(create_app(async_engine, tokenizer, "smollm2")) as url:
        gaps, health, done = [], [], threading.Event()
        threads = [threading.Thread(target=stream_gaps_ms, args=(url, gaps, done)),
                   threading.Thread(target=poll_health_ms, args=(url, health, done))]
        for t in threads:
            t.start()
        time.sleep(1.0)
        rss_start = rss_mib()  # the stream is running: its own pool and activations are counted
        for size in (4 * MiB, 31 * MiB):
            start = time.perf_counter()
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * size}, timeout=600)
            print(f"{size // MiB} MiB prompt: HTTP {r.status_code} in {(time.perf_counter() - start) * 1000:.0f} ms")
        rss_after = rss_mib()
        for t in threads:
            t.join()
        time.sleep(10)
        print(f"/health: {len(health)} polls, slowest {max(health):.0f} ms, median {statistics.median(health):.0f} ms")
        print(f"stream: {len(gaps) + 1} tokens, largest gap {max(gaps):.0f} ms, median {statistics.median(gaps):.0f} ms")
        print(f"RSS: {rss_start:.0f} MiB before the huge prompts, {rss_after:.0f} MiB right after, "
              f"{rss_mib():.0f} MiB 10 s later (peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f})")
    async_engine.close()


if __name__ == "__main__":
    main()
