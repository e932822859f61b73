"""How the exercise checks get their implementation, and what counts as "not attempted".

    pytest tests/exercises                         checks vs minillm (must pass), mistakes, drift
    pytest tests/exercises --impl student          checks vs lessons/exercises/ (the student's files)
    pytest tests/exercises --impl student --student-dir PATH     ... vs another copy of them
    pytest tests/exercises --impl mistakes         only test_mistakes_are_caught.py

The options themselves are declared in tests/conftest.py (pytest reads options only from
conftests it loads before collection). A check calling a stub that still raises the
stub's NotImplementedError is reported as skipped, reason "not attempted".
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:  # tests/ holds tiny_models and the exercises package (pytest adds it in prepend mode)
    sys.path.insert(0, TESTS)

from exercises.registry import EXERCISES, STUBS_DIR, reference, student  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = pytest.StashKey[dict]()


def student_dir(config) -> Path:
    return Path(config.getoption("student_dir") or STUBS_DIR).resolve()


def exercise_of(item):
    return next((EXERCISES[m.name] for m in item.iter_markers() if m.name in EXERCISES), None)


def is_check(item) -> bool:
    """A check of an exercise (tests/exercises/test_exNN_*.py), not a test of the exercise kit itself."""
    return item.path.resolve().parent == HERE and item.path.name.startswith("test_ex")


@pytest.fixture(autouse=True)
def one_thread():
    """The checks' tensors are tiny: one thread computes them fastest, and a busy machine's
    spinning OpenMP threads slowed a run 5x (ex02: 52 s with 2 threads at load 10, 11 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def impl(request):
    """The implementation under test for this check's exercise (its exNN marker)."""
    ex = exercise_of(request.node)
    if ex is None:
        pytest.fail(f"{request.node.nodeid} has no exNN marker, so no exercise to check", pytrace=False)
    if request.config.getoption("impl") != "student":
        return reference(ex)
    folder = student_dir(request.config)
    try:
        loaded = student(ex, folder)
    except FileNotFoundError as e:
        pytest.skip(f"not attempted: {e}")
    except Exception as e:  # noqa: BLE001 - a syntax error in the student's file is a failed check
        pytest.fail(f"could not load {folder / ex.file}: {type(e).__name__}: {e}", pytrace=False)
    progress = request.config.getoption("exercise_progress")
    if progress:  # so `minillm check` tells a process that ended in the import from one that ended in the check
        _append(progress, {"event": "imported", "exercise": ex.id})
    return loaded


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except NotImplementedError as e:
        if item.config.getoption("impl") == "student" and _raised_in(e, student_dir(item.config)):
            pytest.skip(f"not attempted: {e}")
        raise


def _raised_in(error: BaseException, folder: Path) -> bool:
    """Whether the innermost frame of the traceback is a file of ``folder`` (the stub's raise)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().parent == folder


def pytest_collection_modifyitems(config, items):
    """--impl student keeps only the checks; --impl mistakes keeps only the mistakes meta-test."""
    mode = config.getoption("impl")
    if mode == "reference":
        return
    wanted = is_check if mode == "student" else (lambda item: item.path.name == "test_mistakes_are_caught.py")
    keep = [item for item in items if item.path.resolve().parent != HERE or wanted(item)]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


# -- the per-exercise report that `minillm check` reads ------------------------------------------


def pytest_configure(config):
    config.stash[RESULTS] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    outcome = _outcome(report)
    ex = exercise_of(item)
    if is_check(item) and ex is not None and outcome is not None:
        checks = item.config.stash[RESULTS].setdefault(ex.id, {})
        previous = checks.get(item.name)
        if previous is None or previous["outcome"] == "passed":  # a teardown error overrides a pass
            checks[item.name] = {"name": item.name, "outcome": outcome,
                                 "message": "" if outcome == "passed" else _message(report),
                                 "mistake": "" if outcome == "passed" else _mistake(call)}
    return report


def _mistake(call) -> str:
    """The name of the known mistake (mistakes.py) the failure says the code answers like, or ""
    (checking.Case.fail carries it on its AssertionError; differential checks name one)."""
    return getattr(call.excinfo.value, "mistake", "") if call.excinfo is not None else ""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With --exercise-progress, one JSON line before and one after each check, flushed at once.

    A check that hangs or ends the process (os._exit, a segfault) leaves a "start" line with
    no "end": `minillm check` (minillm/classroom.py) then knows which check it was, stops the
    run, and carries on with the next exercises in a fresh process.
    """
    ex = exercise_of(item)
    path = item.config.getoption("exercise_progress")
    if not (path and is_check(item) and ex is not None):
        return (yield)
    about = {"exercise": ex.id, "title": ex.title, "file": ex.file, "lesson": ex.lesson, "check": item.name}
    start = time.time()
    _append(path, {"event": "start", "time": start, **about})
    result = yield
    check = item.config.stash[RESULTS].get(ex.id, {}).get(item.name)
    if check is not None:
        _append(path, {"event": "end", **about, **check, "seconds": time.time() - start})
    return result


def pytest_collection_finish(session):
    """With --exercise-progress, first a line per exercise naming its checks (to tell which never ran)."""
    path = session.config.getoption("exercise_progress")
    if not path:
        return
    checks: dict[str, list[str]] = {}
    for item in session.items:
        ex = exercise_of(item)
        if is_check(item) and ex is not None:
            checks.setdefault(ex.id, []).append(item.name)
    for ex_id, names in checks.items():
        ex = EXERCISES[ex_id]
        _append(path, {"event": "collected", "exercise": ex.id, "title": ex.title, "file": ex.file,
                       "lesson": ex.lesson, "checks": names})


def _append(path: str, line: dict) -> None:
    """One progress line, with the writer's pid: a copy of pytest forked by a student's code writes
    here too, and `minillm check` keeps only the first process's lines."""
    with open(path, "a") as f:
        f.write(json.dumps({**line, "pid": os.getpid()}) + "\n")


def _outcome(report) -> str | None:
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.passed:
            return "passed"
        if report.skipped:
            return "not attempted" if "not attempted" in _message(report) else "skipped"
        return "failed"
    if report.when == "teardown" and report.failed:
        return "failed"
    return None


def _message(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, "Skipped: reason")
        return longrepr[2].removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    return without_hypothesis_notes(text.removeprefix("AssertionError: ").removeprefix("Failed: "))


# The notes hypothesis appends to a failure (PEP 678): the test's arguments, each draw, its
# explanation. The kit's message above them already shows the smallest input in the student's
# terms (differential.py), so a student sees it once, without hypothesis's internals.
_HYPOTHESIS_NOTE = re.compile(r"^(Failing test case:|Falsifying (explicit )?example|Draw \d+|Explanation:|"
                              r"You can reproduce this example|Trying example|Highest target score)", re.MULTILINE)


def without_hypothesis_notes(message: str) -> str:
    """``message`` cut before hypothesis's first note ("Failing test case:", "Draw 1 (n_keys): 0", ...)."""
    note = _HYPOTHESIS_NOTE.search(message)
    return message if note is None else message[:note.start()].rstrip()


def pytest_sessionfinish(session):
    path = session.config.getoption("exercise_report")
    if not path:
        return
    results = session.config.stash[RESULTS]
    exercises = []
    for ex_id in sorted(results):
        ex = EXERCISES[ex_id]
        exercises.append({"id": ex.id, "title": ex.title, "file": ex.file, "lesson": ex.lesson,
                          "checks": list(results[ex_id].values())})
    report = {"impl": session.config.getoption("impl"), "student_dir": str(student_dir(session.config)),
              "exercises": exercises}
    Path(path).write_text(json.dumps(report, indent=2))
