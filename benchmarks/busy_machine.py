"""Decode speed on a busy machine: TPOT of ``minillm generate`` with 0, 1 and 2 extra busy cores
(CPU hogs this script starts and always stops), under several thread / OpenMP wait-policy settings.

    python benchmarks/busy_machine.py                  # loads 0 1 2, 3 rounds, ~6-8 min on 2 cores
    python benchmarks/busy_machine.py --loads 0 2 --rounds 2 --max-new-tokens 32

Each measurement is a fresh ``python -m minillm generate PROMPT --json`` (the OpenMP runtime reads
its wait policy once, when torch loads), greedy, and its TPOT comes from the JSON line. The settings:

    torch default   OpenMP's defaults (MINILLM_CPU_POLICY=off): torch's threads (one a core), threads
                    spin 300,000 turns (libgomp) before they sleep
    1 thread        OMP_NUM_THREADS=1 (MINILLM_CPU_POLICY=off)
    PASSIVE         OMP_WAIT_POLICY=PASSIVE, torch's threads (MINILLM_CPU_POLICY=off)
    minillm         nothing set: what the minillm command does itself (minillm/cpu_policy.py: OpenMP's
                    wait policy, torch's threads, fewer while other processes keep cores busy)

Settings run interleaved (a different order each round), so a change in the machine's own load hits
them all alike; the table gives each one's median TPOT at each load, the 1-minute load average seen
after its runs, and its ratio to the best setting at that load. The hogs are busy-looping Python
processes that also end themselves at the script's deadline (--time-limit), so none outlives it even
if this script is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

PROMPT = "Write a short story about a robot who learns to paint."
POLICY_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "MINILLM_CPU_POLICY",
               "MINILLM_DECODE_PATH")
SETTINGS = {
    "torch default": {"MINILLM_CPU_POLICY": "off"},
    "1 thread": {"MINILLM_CPU_POLICY": "off", "OMP_NUM_THREADS": "1"},
    "PASSIVE": {"MINILLM_CPU_POLICY": "off", "OMP_WAIT_POLICY": "PASSIVE"},
    "minillm": {},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", type=int, nargs="+", default=[0, 1, 2], help="extra busy cores (CPU hogs)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each setting at each load (median)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--settle", type=float, default=5.0, help="seconds the hogs run before the first measurement")
    ap.add_argument("--time-limit", type=float, default=600.0, help="hard limit, seconds: stop measuring, kill the hogs")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME:VAR=V[,VAR=V]",
                    help="another setting, e.g. 'spin 10k:GOMP_SPINCOUNT=10000,MINILLM_CPU_POLICY=off'")
    args = ap.parse_args()
    settings = {name: SETTINGS[name] for name in args.settings}
    for spec in args.extra:
        name, _, pairs = spec.partition(":")
        settings[name] = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)

    deadline = time.monotonic() + args.time_limit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the hogs
    hogs: list[subprocess.Popen] = []
    results: dict[int, dict[str, list[tuple[float, float]]]] = {}  # load -> setting -> [(tpot, loadavg)]
    own_load = os.getloadavg()[0]
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}  cores usable: {len(os.sched_getaffinity(0))}  "
          f"machine's own 1-min load before any hog: {own_load:.2f}", flush=True)
    try:
        for level in sorted(args.loads):
            while len(hogs) < level:
                hogs.append(_start_hog(deadline))
            time.sleep(args.settle)
            results[level] = {name: [] for name in settings}
            names = list(settings)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    left = deadline - time.monotonic()
                    if left < 5:
                        raise TimeoutError
                    tpot = _run(settings[name], args.max_new_tokens, timeout=min(180.0, left))
                    results[level][name].append((tpot, os.getloadavg()[0]))
                    print(f"  load +{level} round {r + 1} {name:14s} TPOT {tpot:8.1f} ms   "
                          f"(1-min load {os.getloadavg()[0]:.2f})", flush=True)
    except TimeoutError:
        print(f"# stopped at the time limit ({args.time_limit:.0f} s); the table has what was measured", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
    _table(results, settings)
    return 0


def _start_hog(deadline: float) -> subprocess.Popen:
    """A busy-looping process that ends itself at ``deadline`` (this process's monotonic clock, shared)."""
    code = f"import time\nend = {deadline!r}\nwhile time.monotonic() < end:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)


def _run(overrides: dict[str, str], max_new_tokens: int, timeout: float) -> float:
    """One fresh ``minillm generate --json``: its TPOT in ms."""
    env = {k: v for k, v in os.environ.items() if k not in POLICY_VARS} | overrides
    cmd = [sys.executable, "-m", "minillm", "generate", PROMPT, "--max-new-tokens", str(max_new_tokens),
           "--temperature", "0", "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.splitlines()[-1])["metrics"]["tpot_ms"]


def _table(results: dict, settings: dict) -> None:
    """Markdown: median TPOT and its ratio to the best setting at each load, and the load average seen."""
    levels = list(results)
    medians = {lv: {n: statistics.median(t for t, _ in runs) for n, runs in results[lv].items() if runs}
               for lv in levels}
    print()
    print("| setting | " + " | ".join(f"+{lv} busy core{'s' if lv != 1 else ''}: TPOT ms (x best)" for lv in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for name in settings:
        cells = []
        for lv in levels:
            if name not in medians[lv]:
                cells.append("-")
                continue
            best = min(medians[lv].values())
            cells.append(f"{medians[lv][name]:.1f} (x{medians[lv][name] / best:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    loads = []
    for lv in levels:
        seen = [a for runs in results[lv].values() for _, a in runs]
        loads.append(f"{min(seen):.1f}-{max(seen):.1f}" if seen else "-")
    print("| 1-min load average seen | " + " | ".join(loads) + " |")


if __name__ == "__main__":
    sys.exit(main())
