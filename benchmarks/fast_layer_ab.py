"""The speed layer's A/B: before/after a change, and what each layer buys, interleaved rounds.

Each round runs, in fresh processes, `minillm bench` (prefill 512, decode at contexts 128 and 1024,
batch 1) and an offline `minillm bench-serving` workload (continuous batching) for:

    before     the source tree given by --before (e.g. a `git worktree` of the previous commit)
    fast       this tree, the speed layer on (the default)
    pure       this tree, --no-fast: the lesson's plain PyTorch
    llama.cpp  llama.cpp's F32 build on the same weights (bench only; skipped without llama-cpp-python)

Rounds interleave the variants, so a machine that gets busier slows them alike; the machine's load
average is printed with every run. Medians of the rounds are printed as a markdown table with the
ratio of each variant to `fast`.

    git worktree add /tmp/before <commit>
    python benchmarks/fast_layer_ab.py --before /tmp/before --rounds 2 --decode-path matvec

Both trees must have the model converted (`minillm generate "Hi"` once) in the same weights folder
(MINILLM_WEIGHTS). Takes ~4.5 min a round on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
BENCH = ["bench", "--threads", "2", "--batch-sizes", "1", "--prompt-lengths", "512",
         "--context-lengths", "128", "1024", "--repeats", "3", "--memory-tokens", "0"]
SERVING = ["bench-serving", "--num-prompts", "12", "--input-len", "uniform:32-512", "--output-len",
           "uniform:16-64", "--policies", "continuous", "--threads", "2", "--quiet"]


def run(tree: Path, args: list[str], env: dict, out: Path) -> dict:
    """`python -m minillm ARGS --json OUT` with ``tree`` first on the path; the JSON it wrote."""
    env = dict(os.environ, PYTHONPATH=str(tree), **env)
    load = os.getloadavg()[0]
    subprocess.run([sys.executable, "-m", "minillm", *args, "--json", str(out)], env=env, check=True,
                   cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL)
    print(f"  {' '.join(args[:1])} {tree.name} {env.get('MINILLM_DECODE_PATH', '')}: load {load:.1f}", file=sys.stderr)
    return json.loads(out.read_text())


def bench_rows(result: dict, engine: str) -> dict[str, float]:
    """{"prefill 512": ms, "decode ctx 128": ms a token (TPOT), ...} of one engine."""
    rows = {}
    for m in result["measurements"]:
        if m["engine"] == engine:
            name = f"prefill {m['length']}" if m["phase"] == "prefill" else f"decode ctx {m['length']}"
            rows[name] = m["time_ms"]  # prefill: the pass; decode: TPOT, the median gap between tokens
    return rows


def serving_rows(result: dict) -> dict[str, float]:
    summary = next(r for r in result["runs"] if r["policy"] == "continuous")["summary"]
    return {"serving out tok/s": summary["output_throughput_tok_s"], "serving TPOT p50 ms": summary["p50_tpot_ms"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, help="the source tree to compare with (a git worktree)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--decode-path", default="matvec", help="MINILLM_DECODE_PATH for before and fast")
    p.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    variants = {"fast": (HERE, [], {"MINILLM_DECODE_PATH": args.decode_path}),
                "pure": (HERE, ["--no-fast"], {})}
    if args.before:
        variants["before"] = (args.before, [], {"MINILLM_DECODE_PATH": args.decode_path})
    samples: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, (tree, flags, env) in variants.items():
                engines = ["minillm-sdpa"] + (["llama.cpp"] if name == "fast" and args.llama_cpp else [])
                bench = run(tree, BENCH + flags + ["--engines", *engines], env, Path(tmp) / f"b{r}{name}.json")
                serving = run(tree, SERVING + flags, env, Path(tmp) / f"s{r}{name}.json")
                rows = {**bench_rows(bench, "minillm-sdpa"), **serving_rows(serving)}
                if "llama.cpp" in engines:
                    for k, v in bench_rows(bench, "llama.cpp").items():
                        samples.setdefault("llama.cpp", {}).setdefault(k, []).append(v)
                for k, v in rows.items():
                    samples.setdefault(name, {}).setdefault(k, []).append(v)
    metrics = list(samples["fast"])
    print("| variant | " + " | ".join(metrics) + " |")
    print("|---" * (len(metrics) + 1) + "|")
    for name, values in samples.items():
        cells = []
        for k in metrics:
            if k not in values:
                cells.append("-")
                continue
            med, ref = statistics.median(values[k]), statistics.median(samples["fast"][k])
            ratio = med / ref if "tok/s" in k else ref / med  # > 1: faster than fast
            spread = f"{min(values[k]):.1f}-{max(values[k]):.1f}"
            cells.append(f"{med:.1f} ({spread}) x{ratio:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n(ms, or tok/s where named; median (range) of the rounds; xN: speed relative to fast, > 1 faster)")


if __name__ == "__main__":
    main()
