"""Grading the classroom exercises: run their checks on a student's files, one result per exercise.

The exercises are stubs in ``lessons/exercises/``; their checks are the pytest tests in
``tests/exercises/`` (see ``lessons/exercises/README.md``). :func:`run_checks` runs

    python -m pytest tests/exercises --impl student [--student-dir DIR] -m "ex01 or ex03"

in a subprocess (a fresh interpreter imports the student's latest code) and reads back
the line the checks write as each one starts and ends: for every check, passed, failed
(with its teaching message) or "not attempted" (the stub still raises NotImplementedError).
A check that hangs or takes the process down is stopped and reported, and the remaining
exercises run in a fresh process. That process runs untrusted code, so it runs walled off
(sandbox.py): a scratch copy of the folder, limits on CPU, memory, processes, open files, file
size and output, and where the machine allows no network, another user, the homes hidden.
Both folders live in the repository, so this works from a clone of minillm, not from a wheel.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import re
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import MiniLLMError
from . import sandbox
from .sandbox import Limits

CHECKS_DIR = Path("tests") / "exercises"
STUBS_DIR = Path("lessons") / "exercises"
DEFAULT_TIMEOUT_S = 60.0  # per exercise: the reference passes any exercise's checks in a few seconds
POLL_S = sandbox.POLL_S  # how often the progress of a running check is read


@dataclass(frozen=True)
class CheckResult:
    """One check: its test name, its outcome, the failure message and its time.

    outcome: "passed", "failed", "not attempted" (the stub is untouched) or "not run"
    (an earlier check of the exercise timed out or crashed the process).
    mistake: for a failure, the known mistake (tests/exercises/mistakes.py, e.g.
    "mask_window_ignored") that answers as the student's code did, when the check names one.
    stopped: for a failure that was more than a wrong answer, the one line that says what the code did
    (a limit or a wall of the sandbox it ran into, a hang, an exit, a crash); else "".
    """

    name: str
    outcome: str
    message: str = ""
    seconds: float = 0.0  # how long the check ran
    mistake: str = ""
    stopped: str = ""


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
    ``from minillm.generate import generate``): checking the folder grades the references
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
           "-m", " or ".join(exercises), "--exercise-progress", str(report), "-p", "no:cacheprovider",
           "-s"]  # no capture: what the student's code prints comes to the grader's capped pipe (sandbox.run)
    if student_dir is not None:
        cmd += ["--student-dir", str(Path(student_dir).resolve())]
    return cmd + (["--tb=short", "-rfE"] if verbose else ["-q", "--tb=no", "-rN", "--no-header"])


def run_checks(exercises: list[str], student_dir: Path | None = None, root: Path | None = None,
               verbose: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
               limits: Limits | None = None) -> list[ExerciseResult]:
    """Run the checks of ``exercises`` (ids) on ``student_dir`` (default: the checkout's lessons/exercises).

    An exercise whose checks run longer than ``timeout_s`` seconds in all (an infinite loop) is
    stopped and failed with "timed out: an infinite loop?"; one whose code ends the Python
    process (os._exit, a segfault) is failed with "crashed: ..." ("exited during import of ..."
    when the file's top level did it). Each pytest process runs in a sandbox (sandbox.py) with
    ``limits`` (default :class:`Limits`, its CPU time the run's timeouts in all): past one (memory,
    processes, output, file size, open files, CPU) or against a wall (a file outside its folder),
    the check fails with one line naming it. Either way the exercises after a stopped one are
    checked in a fresh pytest process, so one broken file never hides the others.
    (A SyntaxError or ImportError in a file is an ordinary failure of that exercise's checks.)

    With ``verbose`` pytest's own output (tracebacks) goes to the terminal; otherwise it is
    captured and only shown if pytest could not run the checks at all.
    Raises MiniLLMError if pytest is missing or the checks did not run; ValueError for
    timeout_s <= 0.
    """
    if importlib.util.find_spec("pytest") is None:
        raise MiniLLMError("the exercise checks need pytest: pip install -e '.[course]'")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    root = find_checkout() if root is None else root
    folder = Path(student_dir) if student_dir is not None else root / STUBS_DIR
    limits = limits or Limits(cpu_s=_cpu_budget(timeout_s, len(exercises)))
    done: dict[str, _Exercise] = {}
    todo = list(exercises)
    for _ in itertools.count():  # one pytest process per stop or crash, plus one
        these = replace(limits, cpu_s=min(limits.cpu_s, _cpu_budget(timeout_s, len(todo))))
        with sandbox.scratch(folder, sandbox.isolation().user) as box:
            cmd = pytest_command(root, todo, box.folder, box.progress, verbose)
            try:
                ran = sandbox.run(cmd, box, these, root, lambda: _timed_out(_read_events(box.progress), timeout_s),
                                  verbose)
            except OSError as e:
                raise MiniLLMError(f"the sandbox for the checks could not start: {e}") from e
            events = [_explained(e, these, box) for e in _main_process(_read_events(box.progress))]
        if not events:
            raise MiniLLMError(f"the checks did not run (pytest exit code {ran.returncode})" + _last_line(ran.output))
        blamed = _blamed(events, ran)
        _collect([e for e in events[:blamed] if e["event"] != "imported"], done)  # (the first line: "collected")
        if blamed == len(events):
            break
        start = events[blamed]
        ex = done.setdefault(start["exercise"], _Exercise(start["exercise"], start["title"], start["file"],
                                                          start["lesson"], []))
        stopped = _stopped_message(start, ran, _importing(events[blamed:]), these)
        ex.checks.append(CheckResult(start["check"], "failed", stopped, time.time() - start["time"], stopped=stopped))
        ran_checks = {c.name for c in ex.checks}
        ex.checks += [CheckResult(name, "not run", "an earlier check of this exercise was stopped (or crashed)")
                      for name in _collected(events, ex.id) if name not in ran_checks]
        todo = todo[todo.index(start["exercise"]) + 1:]
        if not todo:
            break
    return [ExerciseResult(e.id, e.title, e.file, e.lesson, tuple(e.checks)) for e in
            (done[ex_id] for ex_id in exercises if ex_id in done)]


ENGINE_RUNS = 8  # the engine's budget in --timeout's: minillm's run, the student's, the culprit's search (log2 of 13)


@dataclass(frozen=True)
class EngineRun:
    """How the sandboxed assembled engine ended: its exit code (0: equal to minillm's), its report
    (the lines it printed, the student's folder named as given) and why it was stopped ("" if not)."""

    returncode: int
    output: str
    stopped: str


def run_assembled_engine(student_dir: Path, model_dir: Path, prompt: str, max_new_tokens: int,
                         timeout_s: float = DEFAULT_TIMEOUT_S, root: Path | None = None,
                         limits: Limits | None = None) -> EngineRun:
    """``minillm generate --student-dir`` on a scratch copy of ``student_dir``, in the checks' sandbox.

    The student's pieces run in a child process with the same walls and ``limits`` as the checks
    (default :class:`Limits`: the reference's engine on SmolLM2-135M peaks at 1634 MiB of address
    space, 814 MiB resident, under the 3072 MiB), its CPU time and wall clock ``ENGINE_RUNS``
    times ``timeout_s`` and a minute. ``model_dir`` (the downloaded weights: no network inside) is
    put back read-only; the child's ``--timeout`` names a piece that loops, as outside.
    """
    root = find_checkout() if root is None else root
    budget = _cpu_budget(timeout_s, ENGINE_RUNS)
    limits = replace(limits or Limits(), cpu_s=budget)
    with sandbox.scratch(student_dir, sandbox.isolation().user) as box:
        cmd = [sys.executable, "-m", "minillm", "generate", "--student-dir", str(box.folder), "--model",
               str(Path(model_dir).resolve()), "--max-new-tokens", str(max_new_tokens), "--timeout", f"{timeout_s:g}",
               prompt]
        deadline = time.monotonic() + budget
        stop = (lambda: f"timed out: the assembled engine was still running after {budget} s"
                if time.monotonic() > deadline else "")
        try:
            ran = sandbox.run(cmd, box, limits, root, stop, read_only=(Path(model_dir).resolve(),))
        except OSError as e:
            raise MiniLLMError(f"the sandbox for the assembled engine could not start: {e}") from e
        output = ran.output.replace(str(box.folder), str(box.source))
    stopped = ran.stopped or sandbox.explain_crash(ran.returncode, output, limits)
    return EngineRun(ran.returncode, output, stopped)


def _cpu_budget(timeout_s: float, n_exercises: int) -> int:
    """The CPU seconds a pytest process may use: its wall-clock budget (the checks run one thread)
    and a minute for starting Python, torch and pytest."""
    return math.ceil(timeout_s * n_exercises) + 60


@dataclass
class _Exercise:
    """An exercise's results as they come in from the progress lines."""

    id: str
    title: str
    file: str
    lesson: str
    checks: list[CheckResult]


def _timed_out(events: list[dict], timeout_s: float) -> str:
    """Why to stop the run now (one line), if an exercise has run past ``timeout_s``; else ""."""
    events = _main_process(events)
    running = _running(events)
    if running is None:
        return ""
    start = events[running]
    first = next(e["time"] for e in events if e["event"] == "start" and e["exercise"] == start["exercise"])
    if time.time() - first <= timeout_s:
        return ""
    if _importing(events[running:]):
        return (f"timed out after {timeout_s:g} s while importing {start['file']}: a loop or a sleep at the top "
                "level of the file?")
    return (f"timed out: an infinite loop? {start['exercise']} was still running after {timeout_s:g} s; "
            "look for a while loop whose condition never changes")


def _main_process(events: list[dict]) -> list[dict]:
    """The lines of the pytest process itself (a copy forked by the student's code writes its own)."""
    pid = events[0].get("pid") if events else None
    return [e for e in events if e.get("pid") == pid]


def _running(events: list[dict]) -> int | None:
    """The index of the start line of the check now running (None between checks, before any)."""
    running = None
    for i, e in enumerate(events):
        if e["event"] == "start":
            running = i
        elif e["event"] == "end":
            running = None
    return running


def _importing(events: list[dict]) -> bool:
    """Whether the check whose start line leads ``events`` was still importing the student's file."""
    return not any(e["event"] in ("imported", "end") for e in events[1:])


def _blamed(events: list[dict], ran: sandbox.Ran) -> int:
    """The index of the start line of the check a stop or a crash is blamed on; len(events) if none.

    The check that was running; for too many processes, the first check whose fork was refused if
    one says so (pytest may have gone on to later checks before the watchdog looked).
    """
    if ran.stopped.startswith("started too many processes"):
        refused = next((e for e in events if e["event"] == "end" and "started too many processes" in e["message"]),
                       None)
        if refused is not None:
            return max(i for i, e in enumerate(events[:events.index(refused)])
                       if e["event"] == "start" and e["check"] == refused["name"])
    running = _running(events)
    if running is not None:
        return running
    if ran.stopped:  # stopped between two checks: the last one to start
        return max((i for i, e in enumerate(events) if e["event"] == "start"), default=len(events))
    return len(events)


def _explained(event: dict, limits: Limits, box: sandbox.Scratch) -> dict:
    """A progress line whose failure message names the limit or the wall it ran into (sandbox.explain)."""
    if event["event"] != "end" or event["outcome"] == "passed":
        return event
    wall = sandbox.wall_hit(event["message"], limits, box)
    return {**event, "message": sandbox.explain(event["message"], limits, box), "stopped": wall}


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


def _collect(events: list[dict], done: dict[str, _Exercise]) -> dict | None:
    """Add the finished checks to ``done``; return the start line of a check that never ended, if any."""
    for e in events:
        if e["event"] == "collected":
            continue
        ex = done.setdefault(e["exercise"], _Exercise(e["exercise"], e["title"], e["file"], e["lesson"], []))
        if e["event"] == "end":
            ex.checks.append(CheckResult(e["name"], e["outcome"], e["message"], e.get("seconds", 0.0),
                                         e.get("mistake", ""), e.get("stopped", "")))
    return events[-1] if events[-1]["event"] == "start" else None


def _collected(events: list[dict], exercise: str) -> list[str]:
    """The names of an exercise's checks, in the order pytest runs them."""
    return next((e["checks"] for e in events if e["event"] == "collected" and e["exercise"] == exercise), [])


def _stopped_message(start: dict, ran: sandbox.Ran, importing: bool, limits: Limits) -> str:
    """One line: why the check that ``start`` began was stopped or how its process ended."""
    after = f"(in check {start['check']}; the exercise's later checks did not run)"
    if ran.stopped:
        return f"{ran.stopped} {after}"
    limit = sandbox.explain_crash(ran.returncode, ran.output, limits)
    if limit:
        return f"{limit} {after}"
    code = ran.returncode
    how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    if importing:
        return (f"exited during import of {start['file']} ({how}) {after}: os._exit(), sys.exit() or a crash at "
                "the top level of the file?")
    memory = (f" (or out of the grader's {limits.memory_mib} MiB of memory: torch's native code may crash so)"
              if -code in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS) else "")
    return (f"crashed: the Python process ended ({how}) {after}; os._exit(), sys.exit() or a crash in "
            f"native code in your file?{memory}")


def _last_line(output: str) -> str:
    lines = output.strip().splitlines()
    return f": {lines[-1]}" if lines else ""
