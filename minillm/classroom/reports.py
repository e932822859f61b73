"""A whole class at once: every student graded in parallel, then the grades as files for the teacher.

    minillm check --student-dir class/* --report-dir grades

    grade_class        run_checks for each student's folder, min(cores, students) at a time
    write_reports      grades/grades.csv                         a row per student, a column per exercise, total
                       grades/grades.json                        every student, every exercise: score, status,
                                                                 the failing check, its message, named mistakes
                       grades/gradescope/<student>/results.json  Gradescope's autograder format
                       grades/class_report.html                  pass rate per exercise, the most common named
                                                                 mistakes, a row per student (no JavaScript)

Scoring (:data:`SCORING`): 1 point per exercise whose checks all pass, the class table's "passed";
a failed exercise scores 0 however many of its checks pass, as a stub does. A check passed by
accident (a stub's shape check, a half-written function) earns nothing, and the score is the
count a student sees in the table. Every format carries the same score.

A named mistake is one of tests/exercises/mistakes.py ("mask_window_ignored") that answers as the
student's code did on the input where a differential check failed (CheckResult.mistake): a hint
that one input cannot prove, counted once per student and exercise.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Callable

import jinja2

from ..cpu_policy import usable_cores
from .grading import DEFAULT_TIMEOUT_S, ExerciseResult, run_checks

SCORING = "1 point per exercise whose checks all pass; 0 for a failed or not attempted exercise"
MAX_MISTAKES_SHOWN = 20  # the HTML report's list of the most common named mistakes

Results = dict[str, list[ExerciseResult]]  # student's name -> their results, in the exercises' order


# -- grading a class ---------------------------------------------------------------------------------


def grade_class(folders: list[Path], exercises: list[str], root: Path | None = None, verbose: bool = False,
                timeout_s: float = DEFAULT_TIMEOUT_S, workers: int | None = None,
                on_graded: Callable[[Path], None] | None = None) -> dict[Path, list[ExerciseResult]]:
    """:func:`run_checks` on every student's folder, ``workers`` students at a time; results in the
    order of ``folders``.

    Each student is graded exactly as alone: run_checks, in the main thread of a worker process of
    a pool, starts and watches that student's own sandboxed pytest process, so ``workers`` of those
    run at once (default: one per usable core, at most one per student). With workers == 1 the
    students are graded one after the other in this process. ``on_graded(folder)`` is called here,
    in the calling thread, as each student finishes (a progress bar).
    Raises what run_checks raises, for the first student it fails for; ValueError for workers < 1.
    """
    folders = list(dict.fromkeys(folders))
    workers = max(1, min(usable_cores(), len(folders))) if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    graded: dict[Path, list[ExerciseResult]] = {}
    if workers == 1 or len(folders) <= 1:
        for folder in folders:
            graded[folder] = run_checks(exercises, folder, root, verbose, timeout_s)
            if on_graded is not None:
                on_graded(folder)
        return graded
    with ProcessPoolExecutor(max_workers=min(workers, len(folders))) as pool:
        futures = {pool.submit(run_checks, exercises, folder, root, verbose, timeout_s): folder for folder in folders}
        try:
            for future in as_completed(futures):
                graded[futures[future]] = future.result()
                if on_graded is not None:
                    on_graded(futures[future])
        except BaseException:  # one student's error (or Ctrl-C) ends the run: start no one else
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return {folder: graded[folder] for folder in folders}


# -- one exercise, one student -----------------------------------------------------------------------


def exercise_score(r: ExerciseResult) -> int:
    """1 when every check of the exercise passed, else 0 (:data:`SCORING`)."""
    return int(r.status == "passed")


def named_mistakes(r: ExerciseResult) -> list[str]:
    """The known mistakes its failed checks named, each once, in the checks' order."""
    return list(dict.fromkeys(c.mistake for c in r.checks if c.outcome == "failed" and c.mistake))


def exercise_record(r: ExerciseResult) -> dict:
    """One exercise of one student, as grades.json holds it: score, status, the first failed check."""
    failed = next((c for c in r.checks if c.outcome == "failed"), None)
    return {"id": r.id, "title": r.title, "score": exercise_score(r), "max_score": 1, "status": r.status,
            "checks_passed": r.count("passed"), "checks": len(r.checks),
            "failed_check": failed.name if failed else None, "message": failed.message if failed else "",
            "mistakes": named_mistakes(r), "lesson": r.lesson, "file": r.file, "seconds": round(r.seconds, 3)}


# -- the class ---------------------------------------------------------------------------------------


def exercise_columns(results: Results) -> list[tuple[str, str]]:
    """(id, title) of every exercise any student was graded on, in the order they were graded."""
    columns: dict[str, str] = {}
    for rs in results.values():
        columns.update((r.id, r.title) for r in rs if r.id not in columns)
    return list(columns.items())


def pass_rates(results: Results) -> dict[str, tuple[int, int]]:
    """Exercise id -> (students who passed it, students graded on it)."""
    rates = {}
    for ex_id, _ in exercise_columns(results):
        graded = [r for rs in results.values() for r in rs if r.id == ex_id]
        rates[ex_id] = (sum(exercise_score(r) for r in graded), len(graded))
    return rates


def common_mistakes(results: Results) -> list[tuple[str, str, list[str]]]:
    """(exercise id, mistake, the students whose checks named it), the most common first."""
    students: dict[tuple[str, str], list[str]] = {}
    for name, rs in results.items():
        for r in rs:
            for mistake in named_mistakes(r):
                students.setdefault((r.id, mistake), []).append(name)
    counts = Counter({key: len(names) for key, names in students.items()})
    return [(ex_id, mistake, students[ex_id, mistake]) for (ex_id, mistake), _ in counts.most_common()]


def class_json(results: Results) -> dict:
    """grades.json: the scoring rule, each exercise's pass rate, every student's every exercise."""
    rates = pass_rates(results)
    return {
        "scoring": SCORING,
        "exercises": [{"id": ex_id, "title": title, "passed": rates[ex_id][0], "graded": rates[ex_id][1]}
                      for ex_id, title in exercise_columns(results)],
        "students": [{"name": name, "score": sum(exercise_score(r) for r in rs), "max_score": len(rs),
                      "exercises": [exercise_record(r) for r in rs]} for name, rs in results.items()],
    }


def class_csv(results: Results) -> str:
    """grades.csv: ``student,ex01,...,exNN,total``, a row per student; an exercise a student was not
    graded on is an empty cell."""
    ids = [ex_id for ex_id, _ in exercise_columns(results)]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["student", *ids, "total"])
    for name, rs in results.items():
        scores = {r.id: exercise_score(r) for r in rs}
        writer.writerow([name, *(scores.get(ex_id, "") for ex_id in ids), sum(scores.values())])
    return out.getvalue()


def gradescope_results(rs: list[ExerciseResult]) -> dict:
    """One student's results.json in Gradescope's autograder format: the total ``score``, an
    ``output`` line, and a test per exercise (name, number, score, max_score, status "passed" or
    "failed", output: every failure's message once, visibility "visible")."""
    tests = [{"name": f"{r.id} {r.title}", "number": r.id.removeprefix("ex").lstrip("0") or "0",
              "score": exercise_score(r), "max_score": 1,
              "status": "passed" if exercise_score(r) else "failed", "output": _test_output(r),
              "visibility": "visible"} for r in rs]
    passed = sum(t["score"] for t in tests)
    return {"score": passed, "output": f"{passed} of {len(rs)} exercises pass ({SCORING}).",
            "visibility": "visible", "tests": tests}


def _test_output(r: ExerciseResult) -> str:
    """What the student reads under one exercise: the outcome, then each failure's message once."""
    if r.status == "passed":
        return f"passed: all {len(r.checks)} checks"
    if r.status == "not attempted":
        return f"not attempted: {r.file} still raises NotImplementedError (or is missing)"
    failures: dict[str, list[str]] = {}  # one message, the checks that gave it (a load error fails them all)
    for c in r.checks:
        if c.outcome == "failed":
            failures.setdefault(c.message, []).append(c.name)
    lines = [f"failed: {r.count('passed')} of {len(r.checks)} checks pass"]
    for message, names in failures.items():
        lines += ["", f"FAILED {', '.join(names)}", message]
    return "\n".join(lines)


# -- the HTML report ---------------------------------------------------------------------------------

_HTML = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Class report: {{ students|length }} students, {{ exercises|length }} exercises</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
  table { border-collapse: collapse; margin-bottom: 2em; }
  th, td { padding: 0.2em 0.6em; border-bottom: 1px solid #ddd; text-align: left; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .bar { background: #eee; width: 10em; height: 0.9em; }
  .bar div { background: #2a7; height: 100%; }
  td.passed { background: #d9f2e3; text-align: center; }
  td.failed { background: #f8d7d7; text-align: center; }
  td.not-attempted { color: #999; text-align: center; }
  code { font-size: 0.95em; }
</style>
</head>
<body>
<h1>Class report</h1>
<p>{{ students|length }} students, {{ exercises|length }} exercises. Scoring: {{ scoring }}.</p>

<h2>Pass rate per exercise</h2>
<table id="pass-rates">
<tr><th>exercise</th><th>topic</th><th>passed</th><th>failed</th><th>not attempted</th><th>pass rate</th><th></th></tr>
{% for ex in exercises %}
<tr data-exercise="{{ ex.id }}"><td>{{ ex.id }}</td><td>{{ ex.title }}</td>
<td class="num" data-passed="{{ ex.passed }}" data-graded="{{ ex.graded }}">{{ ex.passed }}/{{ ex.graded }}</td>
<td class="num">{{ ex.failed }}</td><td class="num">{{ ex.not_attempted }}</td>
<td class="num rate">{{ "%.0f"|format(ex.rate * 100) }}%</td>
<td><div class="bar"><div style="width: {{ "%.1f"|format(ex.rate * 100) }}%"></div></div></td></tr>
{% endfor %}
</table>

<h2>The most common named mistakes</h2>
{% if mistakes %}
<p>A differential check names the known mistake (tests/exercises/mistakes.py) that answers as the
student's code did on the input where they differ: a lead, not a proof.</p>
<table id="mistakes">
<tr><th>exercise</th><th>mistake</th><th>students</th><th>who</th></tr>
{% for ex_id, mistake, names in mistakes %}
<tr><td>{{ ex_id }}</td><td><code>{{ mistake }}</code></td><td class="num">{{ names|length }}</td>
<td>{{ names|join(", ") }}</td></tr>
{% endfor %}
</table>
{% else %}
<p>No check named a known mistake.</p>
{% endif %}

<h2>Students</h2>
<table id="students">
<tr><th>student</th>{% for ex in exercises %}<th title="{{ ex.title }}">{{ ex.id[2:] }}</th>{% endfor %}<th>score</th></tr>
{% for s in students %}
<tr data-student="{{ s.name }}"><td>{{ s.name }}</td>
{% for ex in exercises %}{% set r = s.by_id.get(ex.id) %}{% if r is none %}<td></td>
{% else %}<td class="{{ r.status|replace(' ', '-') }}" title="{{ r.tip }}">{{ marks[r.status] }}</td>
{% endif %}{% endfor %}
<td class="num">{{ s.score }}/{{ s.max_score }}</td></tr>
{% endfor %}
</table>
<p>+ passed, x failed (hover for the first failed check and the named mistakes), . not attempted</p>
</body>
</html>
"""


def class_html(results: Results) -> str:
    """class_report.html: plain HTML with inline CSS, every student's name and message escaped."""
    grades = class_json(results)
    exercises = []
    for ex in grades["exercises"]:
        statuses = Counter(r.status for rs in results.values() for r in rs if r.id == ex["id"])
        exercises.append({**ex, "failed": statuses["failed"], "not_attempted": statuses["not attempted"],
                          "rate": ex["passed"] / ex["graded"] if ex["graded"] else 0.0})
    students = [{**s, "by_id": {e["id"]: {**e, "tip": _tip(e)} for e in s["exercises"]}} for s in grades["students"]]
    env = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True)
    return env.from_string(_HTML).render(
        scoring=SCORING, exercises=exercises, students=students,
        mistakes=common_mistakes(results)[:MAX_MISTAKES_SHOWN],
        marks={"passed": "+", "failed": "x", "not attempted": "."})


def _tip(record: dict) -> str:
    if record["status"] != "failed":
        return record["status"]
    named = f"; named mistake: {', '.join(record['mistakes'])}" if record["mistakes"] else ""
    why = record["message"].strip().split("\n")[0][:200]  # what the sandbox stopped is said on this line
    return (f"{record['checks_passed']}/{record['checks']} checks pass; first failed: {record['failed_check']}"
            f"{named}: {why}")


# -- the files ---------------------------------------------------------------------------------------


def write_reports(results: Results, folder: Path) -> list[Path]:
    """Write the four reports into ``folder`` (created if missing; files there replaced).

    ``results``: student's name -> their results; each name becomes a folder name under
    gradescope/. Returns the paths written: grades.csv, grades.json, class_report.html, then each
    student's gradescope/<name>/results.json.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [_write(folder / "grades.csv", class_csv(results)),
               _write(folder / "grades.json", json.dumps(class_json(results), indent=2) + "\n"),
               _write(folder / "class_report.html", class_html(results))]
    for name, rs in results.items():
        student = folder / "gradescope" / name
        student.mkdir(parents=True, exist_ok=True)
        written.append(_write(student / "results.json", json.dumps(gradescope_results(rs), indent=2) + "\n"))
    return written


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path
