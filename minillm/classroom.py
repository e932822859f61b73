"""Grading the classroom exercises: run their checks on a student's files, one result per exercise.

The exercises are stubs in ``lessons/exercises/``; their checks are the pytest tests in
``tests/exercises/`` (see ``lessons/exercises/README.md``). :func:`run_checks` runs

    python -m pytest tests/exercises --impl student [--student-dir DIR] -m "ex01 or ex03"

in a subprocess (a fresh interpreter imports the student's latest code) and reads back
the JSON report the checks write: for every check, passed, failed (with its teaching
message) or "not attempted" (the stub still raises NotImplementedError). Both folders
live in the repository, so this works from a clone of minillm, not from a wheel.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import MiniLLMError

CHECKS_DIR = Path("tests") / "exercises"
STUBS_DIR = Path("lessons") / "exercises"


@dataclass(frozen=True)
class CheckResult:
    """One check: its test name, "passed" / "failed" / "not attempted", and the failure message."""

    name: str
    outcome: str
    message: str = ""


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
    candidates = [Path(__file__).resolve().parents[1], start.resolve(), *start.resolve().parents]
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


def pytest_command(root: Path, exercises: list[str], student_dir: Path | None, report: Path,
                   verbose: bool = False) -> list[str]:
    """The pytest call that checks ``exercises`` against the student's files."""
    cmd = [sys.executable, "-m", "pytest", str(root / CHECKS_DIR), "--impl", "student",
           "-m", " or ".join(exercises), "--exercise-report", str(report), "-p", "no:cacheprovider"]
    if student_dir is not None:
        cmd += ["--student-dir", str(Path(student_dir).resolve())]
    return cmd + (["--tb=short", "-rfE"] if verbose else ["-q", "--tb=no", "-rN", "--no-header"])


def run_checks(exercises: list[str], student_dir: Path | None = None, root: Path | None = None,
               verbose: bool = False) -> list[ExerciseResult]:
    """Run the checks of ``exercises`` (ids) on ``student_dir`` (default: the checkout's lessons/exercises).

    With ``verbose`` pytest's own output (tracebacks) goes to the terminal; otherwise it is
    captured and only shown if pytest could not run the checks at all.
    Raises MiniLLMError if pytest is missing or the checks did not run.
    """
    if importlib.util.find_spec("pytest") is None:
        raise MiniLLMError("the exercise checks need pytest: pip install -e '.[dev]'")
    root = find_checkout() if root is None else root
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = pytest_command(root, exercises, student_dir, report, verbose)
        proc = subprocess.run(cmd, cwd=root, capture_output=not verbose, text=True)
        if not report.is_file():
            tail = (proc.stdout or "").strip().splitlines()[-1:] if not verbose else []
            raise MiniLLMError(f"the checks did not run (pytest exit code {proc.returncode})"
                               + (f": {tail[0]}" if tail else ""))
        data = json.loads(report.read_text())
    return [ExerciseResult(e["id"], e["title"], e["file"], e["lesson"],
                           tuple(CheckResult(c["name"], c["outcome"], c["message"]) for c in e["checks"]))
            for e in data["exercises"]]
