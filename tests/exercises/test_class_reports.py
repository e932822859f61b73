"""Grading a class at once (minillm check --student-dir class/* --report-dir DIR): the pool, and the
reports checked against the in-memory results of the same run.

The class: alice (the reference solutions), bob (the untouched stubs) and carol (two known mistakes
of mistakes.py), on two quick exercises.
"""

import csv
import dataclasses
import io
import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from minillm.classroom import CheckResult, ExerciseResult, find_checkout, reference_answers
from minillm.classroom.reports import (SCORING, class_csv, class_html, class_json, exercise_score, grade_class,
                                       gradescope_results, named_mistakes, pass_rates, write_reports)
from minillm.cli import main

pytestmark = pytest.mark.grader
jsonschema = pytest.importorskip("jsonschema", reason="the reports' schema check needs jsonschema (pip install -e '.[dev]')")

EXERCISES = ["ex01", "ex02"]
CAROLS_MISTAKES = {"ex01": "mask_window_ignored", "ex02": "attention_without_scale"}


def make_class(folder: Path) -> list[Path]:
    """alice: the references; bob: the stubs; carol: one known mistake in each exercise."""
    alice = reference_answers(folder / "alice")
    bob = folder / "bob"
    bob.mkdir()
    for stub in (find_checkout() / "lessons" / "exercises").glob("ex[0-9][0-9]_*.py"):
        shutil.copy(stub, bob)
    carol = folder / "carol"
    carol.mkdir()
    (carol / "ex01_causal_mask.py").write_text(
        f"from exercises.mistakes import {CAROLS_MISTAKES['ex01']} as causal_mask  # noqa: F401\n")
    (carol / "ex02_attention.py").write_text(
        f"from exercises.mistakes import {CAROLS_MISTAKES['ex02']} as eager_attention  # noqa: F401\n")
    return [alice, bob, carol]


@pytest.fixture(scope="module")
def klass(tmp_path_factory):
    return make_class(tmp_path_factory.mktemp("class"))


@pytest.fixture(scope="module")
def graded(klass):
    """The class graded by the pool, two students at a time; keyed by the student's name."""
    return {folder.name: rs for folder, rs in grade_class(klass, EXERCISES, workers=2).items()}


def without_times(rs: list[ExerciseResult]) -> list[ExerciseResult]:
    return [dataclasses.replace(r, checks=tuple(dataclasses.replace(c, seconds=0.0) for c in r.checks)) for r in rs]


def test_the_pool_grades_as_one_at_a_time_does(klass, graded):
    finished = []
    sequential = grade_class(klass, EXERCISES, workers=1, on_graded=finished.append)
    assert finished == klass  # one after the other, in order
    assert list(graded) == ["alice", "bob", "carol"]  # the pool's results in the folders' order
    for folder, rs in sequential.items():
        assert without_times(rs) == without_times(graded[folder.name]), folder.name
    assert {name: [r.status for r in rs] for name, rs in graded.items()} == {
        "alice": ["passed", "passed"], "bob": ["not attempted"] * 2, "carol": ["failed", "failed"]}


def test_a_failed_check_carries_the_mistake_it_names(graded):
    for r in graded["carol"]:
        assert named_mistakes(r) == [CAROLS_MISTAKES[r.id]]
        named = [c for c in r.checks if c.mistake]
        assert all(c.outcome == "failed" and f"known mistake '{c.mistake}'" in c.message for c in named)
    assert not any(c.mistake for name in ("alice", "bob") for r in graded[name] for c in r.checks)


def test_csv_has_a_score_per_exercise_and_the_total(graded):
    rows = list(csv.DictReader(io.StringIO(class_csv(graded))))
    assert list(rows[0]) == ["student", *EXERCISES, "total"]
    assert [row["student"] for row in rows] == list(graded)
    for row in rows:
        rs = graded[row["student"]]
        assert [int(row[r.id]) for r in rs] == [int(r.status == "passed") for r in rs]
        assert int(row["total"]) == sum(r.status == "passed" for r in rs)
    assert [row["total"] for row in rows] == ["2", "0", "0"]


def test_json_holds_every_exercise_of_every_student(graded):
    grades = json.loads(json.dumps(class_json(graded)))  # what grades.json holds
    assert grades["scoring"] == SCORING
    assert [(e["id"], e["passed"], e["graded"]) for e in grades["exercises"]] == [("ex01", 1, 3), ("ex02", 1, 3)]
    for student in grades["students"]:
        rs = graded[student["name"]]
        assert student["score"] == sum(r.status == "passed" for r in rs) and student["max_score"] == len(rs)
        for record, r in zip(student["exercises"], rs, strict=True):
            failed = [c for c in r.checks if c.outcome == "failed"]
            assert (record["id"], record["status"], record["score"], record["max_score"]) == (
                r.id, r.status, exercise_score(r), 1)
            assert (record["checks_passed"], record["checks"]) == (r.count("passed"), len(r.checks))
            assert record["failed_check"] == (failed[0].name if failed else None)
            assert record["message"] == (failed[0].message if failed else "")
            assert record["mistakes"] == named_mistakes(r)
    carol = next(s for s in grades["students"] if s["name"] == "carol")
    assert [e["mistakes"] for e in carol["exercises"]] == [["mask_window_ignored"], ["attention_without_scale"]]


# Gradescope's autograder results.json, as its documentation describes it (the fields written here).
GRADESCOPE = {
    "type": "object",
    "required": ["score", "tests"],
    "properties": {
        "score": {"type": "number"},
        "output": {"type": "string"},
        "visibility": {"enum": ["hidden", "after_due_date", "after_published", "visible"]},
        "tests": {"type": "array", "items": {
            "type": "object",
            "required": ["name", "score", "max_score", "status", "output"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string"}, "number": {"type": "string"},
                "score": {"type": "number"}, "max_score": {"type": "number"},
                "status": {"enum": ["passed", "failed"]}, "output": {"type": "string"},
                "visibility": {"enum": ["hidden", "after_due_date", "after_published", "visible"]},
            }}},
    },
}


def test_gradescope_results_per_student(graded):
    for name, rs in graded.items():
        results = json.loads(json.dumps(gradescope_results(rs)))
        jsonschema.validate(results, GRADESCOPE)
        assert results["score"] == sum(t["score"] for t in results["tests"]) == sum(r.status == "passed" for r in rs)
        for test, r in zip(results["tests"], rs, strict=True):
            assert test["name"].startswith(r.id) and test["max_score"] == 1
            assert test["score"] == (r.status == "passed")
            assert test["status"] == ("passed" if test["score"] else "failed")
            for c in r.checks:
                if c.outcome == "failed":
                    assert c.name in test["output"] and c.message in test["output"]
    bob = gradescope_results(graded["bob"])["tests"][0]["output"]
    assert bob.startswith("not attempted: ex01_causal_mask.py still raises NotImplementedError"), bob


class ReportParser(HTMLParser):
    """The pass-rate rows (data-exercise), the students' rows (data-student) and the mistakes' table, as text."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[dict]] = {}
        self.table = self.row = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.table = self.tables.setdefault(attrs["id"], [])
        elif tag == "tr" and self.table is not None:
            self.row = {"attrs": attrs, "cells": []}
            self.table.append(self.row)
        elif tag in ("td", "th") and self.row is not None:
            self.row["cells"].append({"attrs": attrs, "text": ""})

    def handle_data(self, data):
        if self.row is not None and self.row["cells"]:
            self.row["cells"][-1]["text"] += data.strip()

    def handle_endtag(self, tag):
        if tag == "table":
            self.table = self.row = None


def parse_report(html: str) -> dict[str, list[dict]]:
    parser = ReportParser()
    parser.feed(html)
    return parser.tables


def test_html_report_shows_the_computed_pass_rates(graded):
    tables = parse_report(class_html(graded))
    rates = pass_rates(graded)
    rows = [row for row in tables["pass-rates"] if "data-exercise" in row["attrs"]]
    assert [row["attrs"]["data-exercise"] for row in rows] == EXERCISES
    for row in rows:
        passed, graded_on = rates[row["attrs"]["data-exercise"]]
        cells = [cell["text"] for cell in row["cells"]]
        assert cells[2] == f"{passed}/{graded_on}" and cells[5] == f"{100 * passed / graded_on:.0f}%"
        statuses = [r.status for rs in graded.values() for r in rs if r.id == row["attrs"]["data-exercise"]]
        assert cells[3:5] == [str(statuses.count("failed")), str(statuses.count("not attempted"))]
    mistakes = [[cell["text"] for cell in row["cells"]] for row in tables["mistakes"][1:]]
    assert sorted(mistakes) == [["ex01", "mask_window_ignored", "1", "carol"],
                                ["ex02", "attention_without_scale", "1", "carol"]]
    students = {row["attrs"]["data-student"]: row["cells"] for row in tables["students"][1:]}
    assert list(students) == list(graded)
    for name, cells in students.items():
        assert [cell["attrs"]["class"] for cell in cells[1:-1]] == [r.status.replace(" ", "-") for r in graded[name]]
        assert cells[-1]["text"] == f"{sum(r.status == 'passed' for r in graded[name])}/{len(graded[name])}"


def test_html_escapes_names_and_messages():
    check = CheckResult("test_x", "failed", "<script>alert(1)</script>", mistake="a<b")
    html = class_html({"<img src=x>": [ExerciseResult("ex01", "causal mask", "f.py", "l", (check,))]})
    assert "<img src=x>" not in html and "&lt;img src=x&gt;" in html
    assert "<script>" not in html and "a&lt;b" in html


def test_the_command_writes_the_reports(klass, graded, tmp_path):
    report = tmp_path / "grades"
    r = subprocess.run([sys.executable, "-m", "minillm", "check", "--student-dir", *map(str, klass), *EXERCISES,
                        "--report-dir", str(report)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr  # carol failed
    assert "grading" in r.stderr and "3/3 students" in r.stderr  # the progress bar, on stderr
    assert f"wrote {report / 'grades.csv'}" in r.stderr
    assert (report / "grades.csv").read_text() == class_csv(graded)  # as the in-memory run of the pool
    assert json.loads((report / "grades.json").read_text())["students"][2]["exercises"][0]["mistakes"] == [
        "mask_window_ignored"]
    assert parse_report((report / "class_report.html").read_text())["pass-rates"][1]["cells"][2]["text"] == "1/3"
    for name in graded:
        results = json.loads((report / "gradescope" / name / "results.json").read_text())
        assert results["score"] == sum(r.status == "passed" for r in graded[name])


def test_reports_need_distinct_names_and_a_writable_folder(tmp_path, capsys):
    for name in ("one/alice", "two/alice"):
        (tmp_path / name).mkdir(parents=True)
    assert main(["check", "--student-dir", str(tmp_path / "one/alice"), str(tmp_path / "two/alice"), "ex01"]) == 2
    assert "two folders are named alice" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["check", "--student-dir", str(tmp_path / "one/alice"), "--report-dir", str(tmp_path / "file")]) == 2
    assert "--report-dir: " in capsys.readouterr().err
    assert main(["check", "--student-dir", str(tmp_path / "one/alice"), "--jobs", "0"]) == 2
    assert "--jobs must be a number of students >= 1, got 0" in capsys.readouterr().err


def test_write_reports_lays_out_the_folder(graded, tmp_path):
    written = write_reports(graded, tmp_path / "out")
    assert [p.relative_to(tmp_path / "out").as_posix() for p in written] == [
        "grades.csv", "grades.json", "class_report.html",
        "gradescope/alice/results.json", "gradescope/bob/results.json", "gradescope/carol/results.json"]


def test_what_the_sandbox_stopped_is_said_in_the_table_and_the_html():
    """A fork bomb is not a wrong mask: the class run prints its one line under the table, and the HTML's cell
    says it on hover (the JSON and Gradescope files carry the whole message)."""
    from minillm.cli.check import _stopped_lines

    bomb = "started too many processes (more than 64 at once, the grader's limit): a fork bomb?\nTraceback ..."
    wrong = "the mask lets query 0 see key 1\nexpected ..."
    results = {Path("/class/mallory"): [_exercise("ex01", bomb, stopped=bomb.splitlines()[0])],
               Path("/class/carol"): [_exercise("ex01", wrong)]}
    assert _stopped_lines(results) == [f"mallory ex01: {bomb.splitlines()[0]}"]
    page = class_html({folder.name: rs for folder, rs in results.items()})
    assert f"first failed: test_mask: {bomb.splitlines()[0]}" in page.replace("&#39;", "'")
    assert f"first failed: test_mask: {wrong.splitlines()[0]}" in page


def _exercise(ex_id: str, message: str, stopped: str = "") -> ExerciseResult:
    checks = (CheckResult("test_mask", "failed", message, stopped=stopped), CheckResult("test_shape", "passed"))
    return ExerciseResult(ex_id, "causal mask", "ex01_causal_mask.py", "lessons/02-prefill-and-decode.md", checks)
