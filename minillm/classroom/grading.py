"""Grading the classroom exercises: run their checks on a student's files, one result per exercise.

The exercises are stubs in ``lessons/exercises/``; their checks are the pytest tests in
``tests/exercises/`` (see ``lessons/exercises/README.md``). :func:`run_checks` runs

    python -m pytest tests/exercises --impl student [--student-dir DIR] -m "ex01 or ex03"

in a subprocess (a fresh interpreter imports the student's latest code) and reads back
the line the checks write as each one starts and ends: for every check, passed, failed
(with its teaching message) or "not attempted" (the stub still raises NotImplementedError).
A check that hangs or takes the process down is stopped and reported, and the remaining
exercises run in a fresh process. Both folders live in the repository, so this works from
a clone of minillm, not from a wheel.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import MiniLLMError

CHECKS_DIR = Path("tests") / "exercises"
STUBS_DIR = Path("lessons") / "exercises"
DEFAULT_TIMEOUT_S = 60.0  # per exercise: the reference passes any exercise's checks in a few seconds
POLL_S = 0.2  # how often the progress of a running check is read


@dataclass(frozen=True)
class CheckResult:
    """One check: its test name, its outcome, the failure message and its time.

    outcome: "passed", "failed", "not attempted" (the stub is untouched) or "not run"
    (an earlier check of the exercise timed out or crashed the process).
    """

    name: str
    outcome: str
    message: str = ""
    seconds: float = 0.0  # how long the check ran


@dataclass(frozen=True)
class ExerciseResult:
    """All checks of one exercise for one student.

    ``status`` is "passed" (every check passed), "not attempted" (no check ran: the stub
    is untouched) or "failed" (anything else, a half-written exercise included).
    """

    id: str
    title: str
    file: str
    lesson: str
    checks: tuple[CheckResult, ...]

    def count(self, outcome: str) -> int:
        return sum(c.outcome == outcome for c in self.checks)

    @property
    def seconds(self) -> float:
        """How long the exercise's checks ran, in all."""
        return sum(c.seconds for c in self.checks)

    @property
    def status(self) -> str:
        if self.checks and self.count("passed") == len(self.checks):
            return "passed"
        if self.count("not attempted") == len(self.checks):
            return "not attempted"
        return "failed"


def find_checkout(start: Path | None = None) -> Path:
    """The minillm repository holding tests/exercises and lessons/exercises.

    Looks above the installed package (an editable install lives in the clone), then
    above ``start`` (default: the current directory). Raises MiniLLMError if neither is one.
    """
    start = Path.cwd() if start is None else Path(start)
    candidates = [Path(__file__).resolve().parents[2], start.resolve(), *start.resolve().parents]
    for folder in candidates:
        if (folder / CHECKS_DIR / "conftest.py").is_file() and (folder / STUBS_DIR).is_dir():
            return folder
    raise MiniLLMError("the exercise checks live in a minillm checkout (tests/exercises, lessons/exercises); "
                       "run 'minillm check' from a clone of the minillm repository")


def exercise_ids(root: Path) -> list[str]:
    """Every exercise of the checkout, from its check files: ["ex01", "ex02", ...]."""
    names = (re.match(r"test_(ex\d+)_", p.name) for p in (root / CHECKS_DIR).glob("test_ex*_*.py"))
    return sorted({m.group(1) for m in names if m})


def normalize_exercise(name: str, known: list[str]) -> str:
    """"3", "ex3", "EX03" -> "ex03". Raises ValueError naming the known exercises."""
    m = re.fullmatch(r"(?:ex)?0*(\d+)", name.strip().lower())
    ex_id = f"ex{int(m.group(1)):02d}" if m else name
    if ex_id not in known:
        raise ValueError(f"unknown exercise {name!r}; known: {', '.join(known)}")
    return ex_id


def reference_answers(folder: Path, root: Path | None = None) -> Path:
    """Fill ``folder`` with one file per exercise that imports the reference's names (``minillm check --reference``).

    ``ex01_causal_mask.py`` holds ``from minillm.model import causal_mask``, and so on (exercise 14's
    loop comes from tests/exercises/solutions.py): checking the folder grades the references
    through the very path a student's files take. Returns ``folder``.
    """
    root = find_checkout() if root is None else root
    tests = str(root / "tests")
    if tests not in sys.path:  # the registry lives with the checks
        sys.path.insert(0, tests)
    from exercises.registry import EXERCISES

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for ex in EXERCISES.values():
        modules: dict[str, list[str]] = {}
        for name, module in ex.refs.items():
            modules.setdefault(module, []).append(name)
        lines = [f"from {module} import {', '.join(names)}  # noqa: F401" for module, names in modules.items()]
        (folder / ex.file).write_text(f'"""{ex.id}: the reference solution, imported."""\n' + "\n".join(lines) + "\n")
    return folder


def pytest_command(root: Path, exercises: list[str], student_dir: Path | None, report: Path,
                   verbose: bool = False) -> list[str]:
    """The pytest call that checks ``exercises`` against the student's files.

    ``report`` receives one JSON line as each check starts and ends (``--exercise-progress``).
    """
    # only the wanted exercises' check files: importing the others would just slow the start
    files = sorted(str(f) for ex in exercises for f in (root / CHECKS_DIR).glob(f"test_{ex}_*.py"))
    cmd = [sys.executable, "-m", "pytest", *files, "--impl", "student",
           "-m", " or ".join(exercises), "--exercise-progress", str(report), "-p", "no:cacheprovider"]
    if student_dir is not None:
        cmd += ["--student-dir", str(Path(student_dir).resolve())]
    return cmd + (["--tb=short", "-rfE"] if verbose else ["-q", "--tb=no", "-rN", "--no-header"])


def run_checks(exercises: list[str], student_dir: Path | None = None, root: Path | None = None,
               verbose: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[ExerciseResult]:
    """Run the checks of ``exercises`` (ids) on ``student_dir`` (default: the checkout's lessons/exercises).

    An exercise whose checks run longer than ``timeout_s`` seconds in all (an infinite loop) is
    stopped and failed with "timed out: an infinite loop?"; one whose code ends the Python
    process (os._exit, a segfault) is failed with "crashed: ...". Either way the exercises
    after it are checked in a fresh pytest process, so one broken file never hides the others.
    (A SyntaxError or ImportError in a file is an ordinary failure of that exercise's checks.)

    With ``verbose`` pytest's own output (tracebacks) goes to the terminal; otherwise it is
    captured and only shown if pytest could not run the checks at all.
    Raises MiniLLMError if pytest is missing or the checks did not run; ValueError for
    timeout_s <= 0.
    """
    if importlib.util.find_spec("pytest") is None:
        raise MiniLLMError("the exercise checks need pytest: pip install -e '.[dev]'")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    root = find_checkout() if root is None else root
    done: dict[str, _Exercise] = {}
    todo = list(exercises)
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in itertools.count():  # one pytest process per hang or crash, plus one
            progress, output = Path(tmp) / f"progress{attempt}.jsonl", Path(tmp) / f"output{attempt}.txt"
            cmd = pytest_command(root, todo, student_dir, progress, verbose)
            returncode, timed_out = _run_watched(cmd, root, progress, output, verbose, timeout_s)
            events = _read_events(progress)
            if not events:
                raise MiniLLMError(f"the checks did not run (pytest exit code {returncode})" + _last_line(output))
            unfinished = _collect(events, done)
            if unfinished is None:
                break
            ex = done[unfinished["exercise"]]
            ex.checks.append(CheckResult(unfinished["check"], "failed",
                                         _stopped_message(unfinished, timed_out, returncode, timeout_s),
                                         time.time() - unfinished["time"]))
            ran = {c.name for c in ex.checks}
            ex.checks += [CheckResult(name, "not run", "an earlier check of this exercise timed out or crashed")
                          for name in _collected(events, ex.id) if name not in ran]
            todo = todo[todo.index(unfinished["exercise"]) + 1:]
            if not todo:
                break
    return [ExerciseResult(e.id, e.title, e.file, e.lesson, tuple(e.checks)) for e in
            (done[ex_id] for ex_id in exercises if ex_id in done)]


@dataclass
class _Exercise:
    """An exercise's results as they come in from the progress lines."""

    id: str
    title: str
    file: str
    lesson: str
    checks: list[CheckResult]


def _run_watched(cmd, root: Path, progress: Path, output: Path, verbose: bool, timeout_s: float):
    """Run pytest; kill it once one exercise has run for timeout_s. Returns (exit code, timed out)."""
    with open(output, "w") as out:
        sink = {} if verbose else {"stdout": out, "stderr": subprocess.STDOUT}
        # its own process group (POSIX), so that killing it also ends anything the student's code started
        proc = subprocess.Popen(cmd, cwd=root, start_new_session=os.name == "posix", **sink)
        while proc.poll() is None:
            started = _exercise_started(_read_events(progress))
            if started is not None and time.time() - started > timeout_s:
                _kill(proc)
                return proc.wait(), True
            time.sleep(POLL_S)
    return proc.returncode, False


def _kill(proc: subprocess.Popen) -> None:
    if os.name == "posix":
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.kill()


def _read_events(progress: Path) -> list[dict]:
    """The progress lines written so far (a line cut short by a crash is left out)."""
    if not progress.is_file():
        return []
    events = []
    for line in progress.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def _exercise_started(events: list[dict]) -> float | None:
    """When the exercise now running started its first check (None between exercises / before any)."""
    if not events or events[-1]["event"] != "start":
        return None
    running = events[-1]["exercise"]
    return next(e["time"] for e in events if e["event"] == "start" and e["exercise"] == running)


def _collect(events: list[dict], done: dict[str, _Exercise]) -> dict | None:
    """Add the finished checks to ``done``; return the start line of a check that never ended, if any."""
    for e in events:
        if e["event"] == "collected":
            continue
        ex = done.setdefault(e["exercise"], _Exercise(e["exercise"], e["title"], e["file"], e["lesson"], []))
        if e["event"] == "end":
            ex.checks.append(CheckResult(e["name"], e["outcome"], e["message"], e.get("seconds", 0.0)))
    return events[-1] if events[-1]["event"] == "start" else None


def _collected(events: list[dict], exercise: str) -> list[str]:
    """The names of an exercise's checks, in the order pytest runs them."""
    return next((e["checks"] for e in events if e["event"] == "collected" and e["exercise"] == exercise), [])


def _stopped_message(start: dict, timed_out: bool, returncode: int, timeout_s: float) -> str:
    after = f"(in check {start['check']}; the exercise's later checks did not run)"
    if timed_out:
        return (f"timed out: an infinite loop? {start['exercise']} was still running after {timeout_s:g} s {after}; "
                "look for a while loop whose condition never changes")
    how = f"killed by signal {signal.Signals(-returncode).name}" if returncode < 0 else f"exit code {returncode}"
    return (f"crashed: the Python process ended ({how}) {after}; os._exit(), sys.exit() or a crash in "
            "native code in your file?")


def _last_line(output: Path) -> str:
    lines = output.read_text().strip().splitlines() if output.is_file() else []
    return f": {lines[-1]}" if lines else ""
