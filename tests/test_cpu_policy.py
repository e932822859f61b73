"""The minillm command's CPU threads (fewer while other processes keep cores busy; only where the user set no
count, never for `import minillm`), and the note that says a busy machine slowed a run (injected readings and a
fake clock: no wall-clock asserts)."""

import os
import subprocess
import sys

import pytest

from minillm import cpu_policy
from minillm.cli import main
from minillm.cli.generate import _summary
from minillm.metrics import RequestMetrics

CLEAN = {k: v for k, v in os.environ.items()
         if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MKL_NUM_THREADS", cpu_policy.OPT_OUT,
                      "OMP_DISPLAY_ENV")}


@pytest.mark.parametrize("argv, expected", [
    (["/venv/bin/python3", "/venv/bin/minillm", "generate", "hi"], True),
    (["python", "-m", "minillm", "--help"], True),
    (["python", "-X", "importtime", "-u", "-m", "minillm"], True),
    (["python", "-mminillm", "serve"], True),
    (["python", "-c", "import minillm"], False),
    (["python", "-m", "pytest", "tests"], False),
    (["python", "script.py"], False),
    (["python"], False),
])
def test_started_as_command(argv, expected):
    assert cpu_policy.started_as_command(argv) is expected


def _run(args, env):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("environ, says", [
    ({}, "CPU threads: torch's count (one a core), fewer while other processes keep cores busy"),
    ({"OMP_NUM_THREADS": "1"}, "OMP_NUM_THREADS=1, as your environment sets it (minillm keeps the count)"),
    ({cpu_policy.OPT_OUT: "off"}, "CPU threads: torch's count, fixed (MINILLM_CPU_POLICY=off)"),
])
def test_help_says_what_the_command_does_with_threads(run_main, monkeypatch, environ, says):
    """In this process (conftest's run_main): the help reads the environment when it is printed."""
    for name in set(os.environ) - set(CLEAN):
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    r = run_main("--help")
    assert r.returncode == 0, r.stderr
    assert says in " ".join(r.stdout.split())


@pytest.mark.cli
def test_the_command_sets_no_openmp_variable():
    """OpenMP's wait policy stays its own (PASSIVE measured 40% slower on an idle machine): libgomp, asked to
    show what it read at start, reads its default spin count in the command as in any program."""
    r = _run(["-m", "minillm", "--version"], dict(CLEAN, OMP_DISPLAY_ENV="verbose"))
    assert r.returncode == 0, r.stderr
    if "GOMP_SPINCOUNT" in r.stderr:  # libgomp (torch's CPU build); another runtime shows other names
        assert "GOMP_SPINCOUNT = '300000'" in r.stderr


@pytest.mark.cli
def test_import_minillm_changes_nothing():
    code = ("import os, torch, minillm; from minillm import cpu_policy; "
            "print(os.environ.get('OMP_WAIT_POLICY'), cpu_policy._START, torch.get_num_threads())")
    r = _run(["-c", code], CLEAN)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["None", "None"]


@pytest.mark.cli
def test_import_minillm_loads_neither_torch_nor_a_policy():
    """The package's public names load at first use (minillm/__init__.py): the import alone starts nothing."""
    r = _run(["-c", "import sys, minillm; from minillm import cpu_policy; print('torch' in sys.modules, cpu_policy._START)"],
             CLEAN)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "None"]


@pytest.mark.cli
def test_the_command_opens_the_governors_window_before_torch_loads():
    """minillm.cli, imported in the command's process (its command line: python -m minillm ...), starts the
    policy first: torch is not loaded yet when the window opens, and is once the commands are imported."""
    code = ("import sys; sys.orig_argv = [sys.executable, '-m', 'minillm', 'generate', 'hi']; "
            "from minillm import cpu_policy; seen = []; started = cpu_policy.command_started; "
            "cpu_policy.command_started = lambda: (seen.append('torch' in sys.modules), started()); "
            "import minillm.cli; print(seen, cpu_policy._START is not None, 'torch' in sys.modules)")
    r = _run(["-c", code], CLEAN)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[False]", "True", "True"]


@pytest.mark.parametrize("load, cores, note", [
    (3.46, 2, "machine busy: load 3.5 on 2 cores"),
    (1.2, 1, "machine busy: load 1.2 on 1 core"),
    (2.0, 2, None),  # as many runnable as cores: nobody waited
    (0.3, 2, None),
    (None, 2, None),  # no load average on this system: no note, never a guess
    (5.0, None, None),
])
def test_busy_note(load, cores, note):
    assert cpu_policy.busy_note(load, cores) == note


class _Step:
    cached_tokens, finish_reason = 0, "length"


def test_the_summary_line_ends_with_the_note():
    m = RequestMetrics.from_timestamps(0.0, [0.1, 0.2, 0.3], 5)
    assert _summary(m, [_Step()], cold=False).endswith("stop: length]")
    assert _summary(m, [_Step()], cold=False, busy="machine busy: load 3.5 on 2 cores").endswith(
        "stop: length | machine busy: load 3.5 on 2 cores]")


@pytest.mark.parametrize("load, busy", [(9.0, True), (0.5, False)])
def test_generate_says_when_the_machine_was_busy(smollm2_dir, monkeypatch, capsys, load, busy):
    monkeypatch.setattr(cpu_policy, "load_average", lambda: load)
    monkeypatch.setattr(cpu_policy, "usable_cores", lambda: 2)
    assert main(["generate", "The capital of France is", "--no-chat", "--max-new-tokens", "3",
                 "--model", str(smollm2_dir)]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.startswith("[prompt ") and ("| machine busy: load 9.0 on 2 cores]" in summary) is busy


@pytest.mark.parametrize("others, cores, max_threads, threads", [
    (0.0, 2, 2, 2), (0.3, 2, 2, 2), (0.6, 2, 2, 1), (1.0, 2, 2, 1), (2.7, 2, 2, 1),
    (0.0, 8, 8, 8), (1.0, 8, 8, 7), (2.5, 8, 8, 5), (0.0, 8, 4, 4), (9.0, 8, 8, 1),
])
def test_threads_for(others, cores, max_threads, threads):
    assert cpu_policy.threads_for(others, cores, max_threads) == threads


class _Machine:
    """Fake /proc/stat, own CPU time and clock: each tick() advances 1 s with `others` cores busy elsewhere
    and `own` cores of this process's threads."""

    def __init__(self):
        self.t = self.busy = self.total = self.own_s = 0.0

    def tick(self, others, own, seconds=1.0):
        self.t += seconds
        self.busy += (others + own) * seconds
        self.own_s += own * seconds
        self.total += 2 * seconds


def test_the_governor_follows_what_other_processes_use():
    m, set_to = _Machine(), []
    gov = cpu_policy.ThreadGovernor(2, cores=2, interval_s=1.0, read=lambda cpus: (m.busy, m.total),
                                    own=lambda: m.own_s, clock=lambda: m.t, set_threads=set_to.append)
    m.tick(others=0.05, own=1.0)
    assert gov.adjust() == 2 and set_to == []  # a quiet machine: torch's threads
    m.tick(others=0.7, own=1.3)  # a hog came: it got 0.7 of a core beside our two spinning threads
    assert gov.adjust() == 1 and set_to == [1] and gov.last_others == pytest.approx(0.7)
    m.tick(others=1.0, own=1.0, seconds=0.5)
    assert gov.adjust() == 1 and gov.last_others is not None  # not due yet: no reading taken
    m.tick(others=1.0, own=1.0, seconds=0.6)
    assert gov.adjust() == 1 and set_to == [1]
    m.tick(others=0.0, own=1.0, seconds=1.5)  # the hog ended
    assert gov.adjust() == 2 and set_to == [1, 2]


def test_the_governor_is_the_commands_only():
    assert cpu_policy._START is None or "torch" in sys.modules  # pytest is not the command
    assert cpu_policy.command_governor() is None  # (started_as_command: False here)
    saved = cpu_policy._START
    try:
        cpu_policy._START = (0.0, (0.0, 0.0), 0.0)
        assert cpu_policy.command_governor(user_threads=3) is None
        assert cpu_policy.command_governor(environ={"OMP_NUM_THREADS": "2"}) is None
        assert cpu_policy.command_governor(environ={cpu_policy.OPT_OUT: "off"}) is None
        if cpu_policy.read_cpu_times() is not None:
            assert cpu_policy.command_governor(environ={}) is not None
    finally:
        cpu_policy._START = saved
