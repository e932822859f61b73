"""The ``minillm`` command line: argument parsing and rendering only; the work is in the library.

    minillm generate "What is the capital of France?"     stream an answer
    minillm chat [--system TEXT]                           a conversation; each turn prefills only its new tokens
    minillm download NAME                                  fetch a model into the weights dir
    minillm convert FILE.gguf OUT_DIR                      GGUF -> Hugging Face folder
    minillm info [MODEL]                                   config, parameters, bytes
    minillm generate "..." --trace [steps|layers]          every phase of the request, in numbers
    minillm sweep --out DIR                                TTFT vs prompt length, TPOT vs context
    minillm calibrate [--device cpu] [--quick]             measure peak FLOP/s and GB/s
    minillm whatif --config llama-3-8b --hardware h100     roofline TTFT / TPOT prediction
    minillm generate --prefix-cache --system "..." Q1 Q2   requests in turn, reusing cached prefixes
    minillm prefix-demo [--requests N] [--plot FILE.png]   TTFT with and without the prefix cache
    minillm bench [--quick] [--json F] [--plot F.png]      minillm vs transformers, no cache, the floors
    minillm bench-serving [--quick] [--request-rate R ...] one workload: one-at-a-time, static, continuous batching
    minillm bench-serving --base-url URL [--model NAME]    the same workload sent to a server, timed on the client
    minillm check [ex03 ...] [--student-dir DIR ...]       grade the classroom exercises (lessons/exercises)
    minillm serve [--model M] [--port 8000]                an OpenAI-compatible HTTP server on the batching engine

One module per command group, each holding its commands' options and their running:
command.py (``main``: the parser of every command, the exit codes), common.py (the usage error, shared
options and helpers, output checks), generate.py, chat.py, models.py (download,
convert, info), sweep.py, roofline.py (calibrate, whatif), prefix_demo.py, bench.py, bench_serving.py
(bench_serving_http.py: its --base-url mode; bench_serving_shared.py: what both modes share), check.py,
serve.py.

Exit codes: 0 ok, 1 runtime error (one line), 2 usage error (one line), 130 interrupted,
141 the reader of stdout went away (`minillm generate ... | head`), silently.

The command's process policies start here, in the command's process only (the console script or
``python -m minillm``; never a program that imports minillm or calls :func:`main`): the CPU threads'
governor opens its first window now, before the commands' modules load torch (minillm/cpu_policy.py);
the serving commands set the allocator when they start (common.keep_freed_memory_in_command).
"""

from .. import cpu_policy

if cpu_policy.started_as_command():
    cpu_policy.command_started()

from .command import build_parser, main  # noqa: E402  (after the start: the commands load torch)

__all__ = ["build_parser", "main"]
