"""How many CPU threads the ``minillm`` command runs, on a machine other processes share; and the note
that says a busy machine slowed a run.

OpenMP (torch's CPU build uses GNU libgomp) keeps a thread that reaches the end of a parallel region
spinning for a while (300,000 turns) before it sleeps. On an idle machine that saves a wake-up per
region; when other processes want the same cores, the spinning threads take the CPU from the one
thread every region waits for, and a decode step takes 10x as long (issue 32: 1,095-1,827 ms a token
with the default 2 threads on a busy 2-core machine, 89-133 ms with one thread, 105-181 ms with
``OMP_WAIT_POLICY=PASSIVE``). ``python benchmarks/busy_machine.py`` measures it with CPU hogs of its
own (BENCHMARKS.md, "A busy machine"): on 2 cores, one thread per core *left free* was the fastest
setting idle (39.5 ms a token) and with one hog (67 ms, torch's defaults 227), and ran as one thread
does with two; ``OMP_WAIT_POLICY=PASSIVE`` costs 40% on the idle machine (every region's threads wake
from sleep), and one thread 50%.

So the command (``minillm ...``, ``python -m minillm ...``; never a program that imports minillm)
keeps OpenMP's wait policy and torch's thread count (one a core), and a :class:`ThreadGovernor`
re-decides the count between steps, at most once a second, from the CPU time other processes used
since the last decision (/proc/stat less this process's own time: measured, not a load average that
lags a minute): one thread per core they leave free (``torch.set_num_threads``; generate, chat and
serve's engine thread). The first window starts when the command starts (``minillm/cli/__init__.py``,
before the commands' modules load torch), so the first token already runs with the count the machine allows.

Where the user chose the count (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``--threads``) or set
``MINILLM_CPU_POLICY=off``, the count stays fixed. A program that imports minillm keeps torch's
settings; on a shared machine it can run with ``OMP_NUM_THREADS=1`` (or ``torch.set_num_threads(1)``),
or call :meth:`ThreadGovernor.adjust` between its own steps.

Nothing here imports torch at module level: :func:`command_started` runs before it loads.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Mapping, MutableMapping

OPT_OUT = "MINILLM_CPU_POLICY"  # "off" (or 0, no, false): torch's thread count, fixed
THREADS_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the user's thread count: the command keeps it
SPARE = 0.3  # other processes using more than this share of a core take it from our threads
_START = None  # (clock, /proc/stat times, own CPU seconds) when the command started: the governor's first window


def started_as_command(argv: list[str] | None = None) -> bool:
    """Whether this process is the ``minillm`` command (its console script, or ``python -m minillm``),
    not a program that imports minillm; ``argv``: the interpreter's own command line (``sys.orig_argv``)."""
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    args = argv[1:]
    while args and args[0].startswith("-") and not args[0].startswith(("-m", "-c")):  # python -X ... -u ...
        args = args[1:] if args[0] not in ("-X", "-W") else args[2:]
    if args[:2] == ["-m", "minillm"] or args[:1] == ["-mminillm"]:
        return True
    return bool(args) and Path(args[0]).name.removesuffix(".exe") in ("minillm", "minillm-script.py")


def command_started() -> None:
    """Called by ``minillm.cli`` when it finds it runs as the command (:func:`started_as_command`), before
    the commands' modules load torch: the CPU times now open the governor's first window (what other
    processes use while torch and the model load). ``import minillm`` never calls it."""
    global _START
    _START = _mark(time.monotonic)


def opted_out(environ: Mapping[str, str], name: str = OPT_OUT) -> bool:
    """Whether the variable ``name`` turns a policy of the command off: "off", "0", "no" or "false", any case."""
    return environ.get(name, "").strip().lower() in ("off", "0", "no", "false")


def describe(environ: MutableMapping[str, str] | None = None) -> str:
    """One line for ``minillm --help``: how this process chooses its CPU threads."""
    environ = os.environ if environ is None else environ
    if users := [f"{n}={environ[n]}" for n in THREADS_SETTINGS if environ.get(n)]:
        return f"CPU threads: {', '.join(users)}, as your environment sets it (minillm keeps the count)"
    if opted_out(environ):
        return f"CPU threads: torch's count, fixed ({OPT_OUT}=off)"
    return ("CPU threads: torch's count (one a core), fewer while other processes keep cores busy, re-measured "
            f"every second; OMP_NUM_THREADS, serve's --threads or {OPT_OUT}=off fix it")


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask; else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average, None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_note(load: float | None, cores: int | None) -> str | None:
    """The note "machine busy: load X on N cores" when the 1-minute load average exceeded the cores this process
    may use (other processes then took CPU time from the run: its times are longer than the machine's
    own); None when it did not, or where either is unknown. Measured, never guessed: give it readings."""
    if load is None or not cores or load <= cores:
        return None
    return f"machine busy: load {load:.1f} on {cores} core{'s' if cores != 1 else ''}"


# -- the thread count, adjusted while the command runs ---------------------------------------------

def threads_for(others: float, cores: int, max_threads: int) -> int:
    """Threads for a run when other processes keep ``others`` cores busy (measured): one a core they
    leave free, a core they use more than :data:`SPARE` of counted as taken; at least 1, at most ``max_threads``.
    A thread on a core another process wants waits its turn, and every parallel region waits for it."""
    taken = max(0, -int(-(others - SPARE) // 1))  # ceil(others - SPARE), never below 0
    return max(1, min(max_threads, cores - taken))


def read_cpu_times(cpus: set[int] | None = None) -> tuple[float, float] | None:
    """(busy, all) CPU seconds of the given CPUs since boot, from /proc/stat (Linux); None elsewhere.
    Busy: user, nice, system, irq, softirq; all adds idle and iowait (steal, another guest's time, is neither)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or (cpus is not None and int(name[3:]) not in cpus):
            continue
        user, nice, system, idle, iowait, irq, softirq = (int(f) for f in fields[:7])
        busy += user + nice + system + irq + softirq
        total += user + nice + system + irq + softirq + idle + iowait
    return (busy / hz, total / hz) if total else None


def own_cpu_seconds() -> float:
    """This process's CPU time, all its threads (user + system)."""
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """The minillm command's torch thread count on a CPU other processes share, re-decided at most every
    ``interval_s`` from what they used since the last decision (measured: /proc/stat's busy time of our
    cores less our own CPU time), never guessed from a load average that lags by a minute.

    Call :meth:`adjust` from the thread that runs the model (torch's thread count is per thread), between
    steps: it is a clock read until a decision is due. ``max_threads``: torch's count at start, which it
    never exceeds. Readers and clock are injectable (tests).
    """

    def __init__(self, max_threads: int, cores: int | None = None, interval_s: float = 1.0,
                 read=read_cpu_times, own=own_cpu_seconds, clock=None, set_threads=None, start=None):
        self.max_threads, self.interval_s = max_threads, interval_s
        self.cores = cores or usable_cores()
        self._read, self._own, self._clock = read, own, clock or time.monotonic
        self._set = set_threads
        self.threads = max_threads
        self.last_others: float | None = None
        self._cpus = _affinity()
        self._mark = start or self._snapshot()  # start: an earlier snapshot (the command's start)

    def _snapshot(self):
        return self._clock(), self._read(self._cpus), self._own()

    def others(self) -> float | None:
        """Cores other processes kept busy since the last reading (and start a new window); None unknown."""
        now = self._snapshot()
        (t0, cpu0, own0), self._mark = self._mark, now
        if cpu0 is None or now[1] is None or now[0] <= t0:
            return None
        wall = now[0] - t0
        return max(0.0, ((now[1][0] - cpu0[0]) - (now[2] - own0)) / wall)

    def adjust(self, force: bool = False) -> int:
        """The thread count from now on (changed only when a decision is due, or ``force``)."""
        if not force and self._clock() - self._mark[0] < self.interval_s:
            return self.threads
        others = self.others()
        if others is None:
            return self.threads
        self.last_others = others
        threads = threads_for(others, self.cores, self.max_threads)
        if threads != self.threads:
            self.threads = threads
            (self._set or _set_torch_threads)(threads)
        return self.threads


def _mark(clock):
    return clock(), read_cpu_times(_affinity()), own_cpu_seconds()


def _affinity() -> set[int] | None:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def command_governor(user_threads: int | None = None, environ=None) -> ThreadGovernor | None:
    """The governor of the minillm command's process; None in any other (a program calling ``main``, a
    test), when the user chose the count (--threads, OMP_NUM_THREADS, MKL_NUM_THREADS), opted out
    (MINILLM_CPU_POLICY=off), or where /proc/stat cannot be read. Its first window starts at the command's start."""
    environ = os.environ if environ is None else environ
    if _START is None or user_threads or any(environ.get(n) for n in THREADS_SETTINGS):
        return None
    if opted_out(environ) or read_cpu_times() is None:
        return None
    import torch

    return ThreadGovernor(torch.get_num_threads(), start=_START)
