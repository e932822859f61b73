"""Batch-1 decode ms against the context, minillm and llama.cpp at each precision, on one plot (issue 41, item 6):

    python benchmarks/decode_growth.py --shapes 135m 1.7b --dtypes float32 bfloat16 --contexts 128 512 2048 8000 \\
        --llama-bench /tmp/peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench \\
        --gguf 135m:float32=/tmp/gguf/135m-f32.gguf 135m:bfloat16=/tmp/gguf/135m-bf16.gguf ... \\
        --plot benchmarks/decode_growth.png

minillm: one process a point, as ``benchmarks/decode_paths.py`` runs it (its ``--one``: the model loaded, the
KV cache moved to ``context`` positions, the median of ``--steps`` timed decode steps), the default path and
``--no-fast``. llama.cpp: ``llama-bench -p 0 -n 32 -d <contexts>`` on a GGUF of the same weights (made by
llama.cpp's ``convert_hf_to_gguf.py``: BENCHMARKS.md says how), with its default f16 KV cache (llama-bench
takes no f32 cache type): two bytes a value, as minillm's bfloat16 cache, half its float32 one. Both with
``--threads``. Prints a markdown table (ms a token) and the load average, and draws ms against the context
(log scale), a panel a shape.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).with_name("decode_paths.py")
MINILLM_PATHS = ("default", "no-fast")


def minillm_ms(shape: str, path: str, context: int, dtype: str, steps: int, threads: int) -> float:
    """decode_paths.py's one run in its own process: the median decode step in ms."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    run = subprocess.run([sys.executable, str(HERE), "--steps", str(steps), "--one", shape, path, str(context), dtype],
                         capture_output=True, text=True, env=env)
    if run.returncode:  # (a context past the model's, say: the child's own one-line reason)
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"decode_growth.py: minillm {shape} {dtype} {path} at context {context} failed: {last}")
    return json.loads(run.stdout.strip().splitlines()[-1])["decode_ms"]


def llama_bench_ms(binary: str, gguf: str, contexts: list[int], threads: int, reps: int) -> dict[int, float]:
    """{context: ms a generated token} from ``llama-bench -o json`` (32 tokens after each depth; it prefills the
    depth first, every repetition)."""
    run = subprocess.run([binary, "-m", gguf, "-p", "0", "-n", "32", "-d", ",".join(map(str, contexts)),
                          "-t", str(threads), "-r", str(reps), "-o", "json"], capture_output=True, text=True, check=True)
    return parse_llama_bench(run.stdout)


def parse_llama_bench(text: str) -> dict[int, float]:
    """{n_depth: ms a token} of llama-bench's JSON rows of generation (n_gen > 0): 1000 / avg_ts."""
    return {row["n_depth"]: 1000.0 / row["avg_ts"] for row in json.loads(text) if row["n_gen"] > 0}


def gguf_argument(text: str) -> tuple[tuple[str, str], str]:
    """'SHAPE:DTYPE=FILE' -> ((shape, dtype), file)."""
    key, sep, path = text.partition("=")
    shape, colon, dtype = key.partition(":")
    if not (sep and colon and path):
        raise argparse.ArgumentTypeError(f"expected SHAPE:DTYPE=FILE (135m:bfloat16=/tmp/135m-bf16.gguf), got {text!r}")
    return (shape, dtype), path


def plot(rows: dict[tuple[str, str, str], dict[int, float]], shapes: list[str], path: str) -> None:
    """ms against context, one panel a shape, a line an (engine, dtype)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for (s, engine, dtype), points in sorted(rows.items()):
            if s == shape and points:
                xs = sorted(points)
                ax.plot(xs, [points[x] for x in xs], marker="o", label=f"{engine}, {dtype}",
                        linestyle="-" if engine.startswith("minillm") else "--")
        ax.set(xscale="log", xlabel="context (positions in the KV cache)", ylabel="ms a token",
               title=f"SmolLM2-{shape.upper()} decode, batch 1")
        contexts = sorted({c for (s, _, _), points in rows.items() if s == shape for c in points})
        ax.set_xticks(contexts, [f"{c:,}" for c in contexts])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["135m"], choices=["135m", "360m", "1.7b"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 512, 2048, 8000],
                        help="KV cache positions (with --steps more, within the model's context: 8,192 for SmolLM2)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (none: minillm alone)")
    parser.add_argument("--llama-reps", type=int, default=3, help="llama-bench's repetitions (-r), each prefilling")
    parser.add_argument("--gguf", nargs="*", type=gguf_argument, default=[], help="SHAPE:DTYPE=FILE, a GGUF a line")
    parser.add_argument("--plot", help="write the plot here (a .png)")
    args = parser.parse_args()
    print(f"load average before {os.getloadavg()}", flush=True)
    rows: dict[tuple[str, str, str], dict[int, float]] = {}
    ggufs = dict(args.gguf)
    for shape in args.shapes:
        for dtype in args.dtypes:
            for path in MINILLM_PATHS:
                engine = "minillm" if path == "default" else "minillm --no-fast"
                rows[shape, engine, dtype] = {c: minillm_ms(shape, path, c, dtype, args.steps, args.threads)
                                              for c in args.contexts}
                print(f"{shape} {dtype} {engine}: {rows[shape, engine, dtype]}", flush=True)
            if args.llama_bench and (shape, dtype) in ggufs:
                rows[shape, "llama.cpp", dtype] = llama_bench_ms(args.llama_bench, ggufs[shape, dtype], args.contexts,
                                                                  args.threads, args.llama_reps)
                print(f"{shape} {dtype} llama.cpp: {rows[shape, 'llama.cpp', dtype]}", flush=True)
    print(f"load average after {os.getloadavg()}")
    print("| shape | engine | dtype | " + " | ".join(f"ctx {c}" for c in args.contexts) + " |")
    print("|---|---|---|" + "---|" * len(args.contexts))
    for (shape, engine, dtype), points in rows.items():
        print(f"| {shape} | {engine} | {dtype} | " + " | ".join(f"{points[c]:.1f}" if c in points else "-"
                                                                for c in args.contexts) + " |")
    if args.plot:
        plot(rows, args.shapes, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
