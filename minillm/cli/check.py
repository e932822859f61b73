"""minillm check: grade the classroom exercises (lessons/exercises) with their checks."""

from __future__ import annotations

import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from ..classroom import DEFAULT_TIMEOUT_S  # stdlib only: cheap to import with the parser
from .common import UsageError, check_out_dir, ensure_model, warn, wrote

CORE_EXERCISES = ("ex01", "ex02", "ex03", "ex04", "ex05", "ex06", "ex07", "ex08", "ex14")  # the assembled engine's


def add_check(sub) -> None:
    p = sub.add_parser("check", help="grade the classroom exercises (lessons/exercises) with their checks")
    p.add_argument("exercises", nargs="*", metavar="EXERCISE", help="ex01, ex02, ... or 1, 2, ... (default: all)")
    p.add_argument("--student-dir", nargs="+", metavar="DIR",
                   help="a student's copy of lessons/exercises/ (default: the checkout's); several: a class table; "
                        "exercise ids may follow the folders (--student-dir alice ex03)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"stop an exercise whose checks run longer than this (an infinite loop?); "
                        f"default {DEFAULT_TIMEOUT_S:g}")
    p.add_argument("--reference", action="store_true",
                   help="grade the reference solutions (a folder of files importing minillm's), as a teacher's "
                        "check that every exercise passes; instead of --student-dir")
    p.add_argument("--report-dir", metavar="DIR",
                   help="also write the grades into DIR: grades.csv (a row per student), grades.json (every "
                        "exercise's score, status, failing check, message, named mistakes), class_report.html "
                        "and gradescope/STUDENT/results.json; 1 point per exercise whose checks all pass "
                        "(default: the table only)")
    p.add_argument("--jobs", "-j", type=int, metavar="N",
                   help="grade N students at a time, each in its own pytest process (default: one per usable "
                        "core, at most one per student; 1: one after the other)")
    p.add_argument("--no-engine", dest="engine", action="store_false",
                   help="skip the assembled engine that ends a full check once ex01-ex08 and ex14 pass "
                        "(the default model, two short generations)")
    p.add_argument("-v", "--verbose", action="store_true", help="also show pytest's own output (tracebacks)")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    p.set_defaults(run=run_check)


def run_check(args) -> int:
    from ..classroom import exercise_ids, find_checkout, normalize_exercise, reference_answers

    root = find_checkout()
    known = exercise_ids(root)
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be a number of seconds > 0, got {args.timeout:g}")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be a number of students >= 1, got {args.jobs}")
    if args.report_dir is not None:
        check_out_dir("--report-dir", args.report_dir)
    dirs, named = _student_dirs(args.student_dir or [], known)
    _student_names(dirs)  # two students of one name would share their reports: refused before grading
    for folder in dirs:
        if not any(folder.glob("ex[0-9][0-9]_*.py")):
            warn(f"{folder} holds none of the exercise files (ex01_causal_mask.py ...): is it the right folder?")
    try:
        wanted = [normalize_exercise(e, known) for e in [*args.exercises, *named]] or known
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.reference:
        if dirs:
            raise UsageError("--reference grades minillm's own solutions: drop --student-dir")
        with tempfile.TemporaryDirectory() as tmp:
            return _check(args, root, [reference_answers(Path(tmp) / "reference", root)], wanted, known)
    return _check(args, root, dirs or [None], wanted, known)  # None: the checkout's lessons/exercises


def _check(args, root, dirs, wanted, known) -> int:
    from rich.console import Console

    from ..classroom import run_checks
    from ..classroom.reports import grade_class, write_reports

    start = time.perf_counter()
    if len(dirs) == 1:
        results = {dirs[0]: run_checks(wanted, dirs[0], root, args.verbose, args.timeout)}
    else:
        with _progress_bar(len(dirs)) as graded:
            results = grade_class(dirs, wanted, root, args.verbose, args.timeout, args.jobs, on_graded=graded)
    console = Console()
    if len(dirs) == 1:
        where = dirs[0] or root / "lessons" / "exercises"
        _print_exercise_results(console, results[dirs[0]], str(where), time.perf_counter() - start)
    else:
        console.print(class_table(results))
        for line in _stopped_lines(results):
            console.print(line, markup=False, highlight=False)
        console.print(f"checked in {time.perf_counter() - start:.1f} s", markup=False, highlight=False)
    if args.report_dir is not None:
        named = dict(zip(_student_names(list(results)), results.values()))
        for path in write_reports(named, Path(args.report_dir)):
            if path.name != "results.json":
                wrote(path)
        wrote(Path(args.report_dir) / "gradescope" / f"*/results.json ({len(named)} student{'s' * (len(named) != 1)})")
    failed = any(r.status == "failed" for rs in results.values() for r in rs)
    engine_ok = True
    if len(dirs) == 1 and args.engine and set(CORE_EXERCISES) <= set(wanted) and set(wanted) == set(known):
        engine_ok = _assembled_engine(console, results[dirs[0]], dirs[0] or root / "lessons" / "exercises",
                                      args.timeout)
    return 1 if failed or not engine_ok else 0


def _assembled_engine(console, results, folder, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """A full check ends with the student's engine answering, once its core exercises pass: in a child
    process, in the checks' sandbox (classroom.grading.run_assembled_engine), its report printed here."""
    from ..classroom.grading import run_assembled_engine
    from ..formats.weights import DEFAULT_MODEL
    from .generate import DEFAULT_STUDENT_PROMPT, STUDENT_MAX_NEW_TOKENS

    core = {r.id: r.status for r in results if r.id in CORE_EXERCISES}
    todo: dict[str, list[str]] = {}  # status -> the core exercises in it
    for ex in CORE_EXERCISES:
        if core.get(ex) != "passed":
            todo.setdefault(core.get(ex, "not run"), []).append(ex)
    command = f"minillm generate --student-dir {folder}"
    if todo:
        console.print(f"\nThe assembled engine ({command}: your pieces running {DEFAULT_MODEL}) runs once "
                      f"ex01-ex08 and ex14 pass; not yet: "
                      + "; ".join(f"{status} {', '.join(ids)}" for status, ids in todo.items()) + ".",
                      markup=False, highlight=False, soft_wrap=True)
        return True
    console.print(f"\nAll core exercises pass: your pieces assembled into one engine ({command}).\n",
                  markup=False, highlight=False, soft_wrap=True)
    model_dir = ensure_model(DEFAULT_MODEL, None)  # fetched here: the sandbox has no network
    start = time.perf_counter()
    ran = run_assembled_engine(Path(folder), model_dir, DEFAULT_STUDENT_PROMPT, STUDENT_MAX_NEW_TOKENS, timeout)
    console.print(ran.output.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)
    if ran.stopped:
        console.print(f"minillm: the assembled engine was stopped: {ran.stopped}", markup=False, highlight=False,
                      soft_wrap=True)
    console.print(f"(assembled engine, in the sandbox: {time.perf_counter() - start:.1f} s with loading the model)",
                  markup=False, highlight=False)
    return ran.returncode == 0 and not ran.stopped


def _student_dirs(values: list[str], known: list[str]):
    """Split --student-dir's words into (folders, exercise ids).

    nargs="+" makes argparse take every word after the flag, so ``--student-dir alice ex03``
    arrives as ["alice", "ex03"]: a word that is no folder but names an exercise is one.
    """
    from pathlib import Path

    from ..classroom import normalize_exercise

    dirs, named = [], []
    for value in values:
        if Path(value).is_dir():
            dirs.append(Path(value))
            continue
        try:
            named.append(normalize_exercise(value, known))
        except ValueError:
            raise UsageError(f"--student-dir {value} is not a folder (nor an exercise id: {', '.join(known)})") from None
    if values and not dirs:
        raise UsageError(f"--student-dir needs a folder before the exercise ids, got only {' '.join(values)}")
    return dirs, named


def _student_names(dirs) -> list[str]:
    """Each folder's name, the student's name in the reports (None: the checkout's lessons/exercises).

    Raises UsageError when two different folders have one name (class1/alice, class2/alice)."""
    names = [(Path(d).resolve().name if d is not None else "exercises") for d in dirs]
    seen: dict[str, Path] = {}
    for name, d in zip(names, dirs):
        if d is not None and seen.setdefault(name, Path(d).resolve()) != Path(d).resolve():
            raise UsageError(f"--student-dir: two folders are named {name} ({seen[name]} and {Path(d).resolve()}); "
                             "each student's folder needs its own name")
    return names


@contextmanager
def _progress_bar(students: int):
    """A progress bar on stderr while a class is graded; yields the callback that advances it.

    Redrawn as each student finishes, with no refresh thread: the grading pool forks its workers
    after the bar starts, and a fork copies no other thread (nor the locks one might hold)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("grading"), BarColumn(), MofNCompleteColumn(), TextColumn("students"),
               TimeElapsedColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=Console(stderr=True), auto_refresh=False) as progress:
        task = progress.add_task("", total=students)
        progress.refresh()
        yield lambda folder: progress.update(task, advance=1, description=f"last: {Path(folder).name}",
                                             refresh=True)


_STATUS_STYLE = {"passed": "green", "failed": "red", "not attempted": "dim"}


def _print_exercise_results(console, results, where: str, seconds: float | None = None) -> None:
    from rich.table import Table

    table = Table(title=f"exercises in {where}")
    for column in ("exercise", "topic", "result", "checks"):
        table.add_column(column)
    table.add_column("time", justify="right")
    for r in results:
        style = _STATUS_STYLE[r.status]
        todo = f" ({r.count('not attempted')} not attempted)" if r.status == "failed" and r.count("not attempted") else ""
        table.add_row(r.id, r.title, f"[{style}]{r.status}[/{style}]", f"{r.count('passed')}/{len(r.checks)} passed{todo}",
                      f"{r.seconds:.1f} s")
    console.print(table)
    for r in results:
        failures: dict[str, list[str]] = {}  # one message, the checks that gave it (a load error fails them all)
        for check in r.checks:
            if check.outcome == "failed":
                failures.setdefault(check.message, []).append(check.name)
        for message, names in failures.items():
            console.print(f"\n[red]FAILED[/red] {r.id} {r.file}: {', '.join(names)}")
            console.print(message, markup=False, highlight=False, soft_wrap=True)
    totals = {s: sum(r.status == s for r in results) for s in _STATUS_STYLE}
    todo = _to_do([r for r in results if r.status != "passed"], where)
    took = "" if seconds is None else (f" in {seconds:.1f} s (the checks {sum(r.seconds for r in results):.1f} s, "
                                       "the rest starting Python and pytest)")
    console.print("\n" + ", ".join(f"{n} {s}" for s, n in totals.items()) + f" (of {len(results)} exercises)"
                  + took + "." + todo, markup=False, soft_wrap=True)


def _to_do(unfinished, where: str) -> str:
    """What to open next: the files of the exercises not passed yet (their docstrings say what to write)."""
    if not unfinished:
        return ""
    files = ", ".join(f"{where}/{r.file}" for r in unfinished[:3]) + (", ..." if len(unfinished) > 3 else "")
    first = unfinished[0].id
    return (f" Next: {files} (each file's docstring says what to write and which lesson explains it); "
            f"'minillm check {first} -v --student-dir {where}' shows tracebacks.")


def _stopped_lines(results: dict) -> list[str]:
    """One line per student's exercise that the sandbox or the watchdog stopped (a fork bomb, a memory
    balloon, endless output, a write outside its folder, an exit, a hang): the table shows only an x."""
    lines = []
    for folder, rs in results.items():
        for r in rs:
            stopped = next((c.stopped for c in r.checks if c.stopped), "")
            if stopped:
                lines.append(f"{folder.name} {r.id}: {stopped}")
    return lines


def class_table(results: dict):
    """One row per student, one narrow column per exercise (its number): 21 exercises fit in 80 columns,
    a long student name cut short (…) to make room, never the passed count."""
    from rich import box
    from rich.table import Table

    ids = [r.id for r in next(iter(results.values()))]
    table = Table(title="class results", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, padding=(0, 0),
                  caption="columns: exercises   + passed   x failed   . not attempted")
    table.add_column("student", max_width=16, overflow="ellipsis")
    for ex_id in ids:
        table.add_column(ex_id.removeprefix("ex"), justify="center", min_width=2, no_wrap=True)
    table.add_column("passed", justify="right", no_wrap=True)
    marks = {"passed": "[green]+[/green]", "failed": "[red]x[/red]", "not attempted": "[dim].[/dim]"}
    for folder, rs in results.items():
        passed = sum(r.status == "passed" for r in rs)
        table.add_row(folder.name, *(marks[r.status] for r in rs), f"{passed}/{len(rs)}")
    return table
