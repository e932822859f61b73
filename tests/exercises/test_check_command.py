"""`minillm check`, run as a student runs it: on a fresh checkout, and on a folder of answers."""

import importlib
import re
import subprocess
import sys
import textwrap

import pytest

from minillm import classroom
from minillm.classroom import CheckResult, ExerciseResult
from minillm.cli import main
from minillm.cli.check import _student_dirs, class_table
from minillm.cli.common import UsageError
from minillm.errors import MiniLLMError

pytestmark = pytest.mark.grader


def minillm(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def test_fresh_checkout_is_not_attempted(tmp_path):
    r = minillm("check", "ex01", "5", cwd=tmp_path)  # from anywhere: the checkout is found from the package
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("not attempted") >= 2 and "ex01" in r.stdout and "ex05" in r.stdout
    assert "0 passed, 0 failed, 2 not attempted" in r.stdout


def test_a_students_folder_passed_failed_not_attempted(tmp_path):
    (tmp_path / "ex01_causal_mask.py").write_text("from minillm.model import causal_mask  # noqa: F401\n")
    (tmp_path / "ex02_attention.py").write_text(textwrap.dedent("""\
        from exercises.mistakes import attention_without_scale as eager_attention  # noqa: F401
    """))
    r = minillm("check", "--student-dir", str(tmp_path), "ex01", "ex02", "5")  # the teacher's guide's order
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {line.split()[1]: line for line in r.stdout.splitlines() if line.startswith("│ ex")}
    assert "passed" in rows["ex01"] and "failed" in rows["ex02"] and "not attempted" in rows["ex05"]
    assert "FAILED ex02 ex02_attention.py: test_scores_are_scaled_by_sqrt_head_dim" in r.stdout
    assert "hint:" in r.stdout and "lesson:   lessons/01-what-is-inference.md#attention" in r.stdout


def test_a_folder_without_exercise_files_is_warned_about(tmp_path):
    (tmp_path / "notes.txt").write_text("not an exercise")
    r = minillm("check", "--student-dir", str(tmp_path), "ex01")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr == (f"minillm: warning: {tmp_path} holds none of the exercise files (ex01_causal_mask.py ...): "
                        "is it the right folder?\n"), r.stderr
    assert "not attempted" in r.stdout


def test_unknown_exercise_is_a_usage_error():
    r = minillm("check", "ex99")
    assert r.returncode == 2 and "unknown exercise 'ex99'; known: ex01" in r.stderr


def test_outside_a_checkout_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(classroom.grading, "__file__",
                        str(tmp_path / "site-packages" / "minillm" / "classroom" / "grading.py"))
    with pytest.raises(MiniLLMError, match="run 'minillm check' from a clone of the minillm repository"):
        classroom.find_checkout(tmp_path)


def test_exercise_names_are_normalized():
    known = ["ex01", "ex03", "ex11"]
    assert [classroom.normalize_exercise(n, known) for n in ("3", "ex3", "EX03", "11")] == ["ex03"] * 3 + ["ex11"]


def test_status_of_an_exercise():
    def ex(*outcomes):
        return ExerciseResult("ex01", "t", "f.py", "l", tuple(CheckResult(f"c{i}", o) for i, o in enumerate(outcomes)))

    assert ex("passed", "passed").status == "passed"
    assert ex("not attempted", "not attempted").status == "not attempted"
    assert ex("passed", "not attempted").status == "failed"
    assert ex("passed", "failed").status == "failed"


def test_class_table_has_a_row_per_student(tmp_path):
    from rich.console import Console

    def results(*statuses):
        outcome = {"+": "passed", "x": "failed", ".": "not attempted"}
        return [ExerciseResult(f"ex{i + 1:02d}", "t", "f.py", "l", (CheckResult("c", outcome[s]),))
                for i, s in enumerate(statuses)]

    table = class_table({tmp_path / "alice": results("+", "x"), tmp_path / "bob": results(".", "+")})
    console = Console(width=80, record=True)
    console.print(table)
    text = console.export_text()
    assert "alice" in text and "bob" in text and "1/2" in text and " 02 " in text

    eighteen = {tmp_path / name: results(*"+x." * 6) for name in ("alice", "bartholomew")}
    console = Console(width=80, record=True)
    console.print(class_table(eighteen))
    rows = {line.split()[0]: line for line in console.export_text().splitlines() if line.strip()}
    assert rows["bartholomew"].split()[1:] == [*"+x." * 6, "6/18"], "18 exercises must fit in 80 columns"

    twenty_one = {tmp_path / name: results(*"+x." * 7) for name in ("alice", "bartholomew")}
    console = Console(width=80, record=True)
    console.print(class_table(twenty_one))
    rows = [line.split() for line in console.export_text().splitlines() if line.strip().startswith(("alice", "barth"))]
    assert [row[1:] for row in rows] == [[*"+x." * 7, "7/21"]] * 2, "21 exercises fit in 80 columns, the count whole"


def test_a_hang_or_a_crash_stops_only_its_own_exercise(tmp_path):
    files = {
        "ex01_causal_mask.py": "def causal_mask(n_queries, n_keys, device=None):\n    while True:\n        pass\n",
        "ex02_attention.py": "import os\n\ndef eager_attention(q, k, v, hook=None, name=''):\n    os._exit(3)\n",
        "ex03_rope.py": "def apply_rope(x, cos, sin)\n    return x\n",
        "ex04_gqa.py": "from minillm.no_such_module import eager_attention  # noqa: F401\n",
        "ex05_kv_cache.py": "from minillm.kv_cache import KVCache  # noqa: F401\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    results = classroom.run_checks(["ex01", "ex02", "ex03", "ex04", "ex05"], tmp_path, timeout_s=10)
    by_id = {r.id: r for r in results}
    assert [r.status for r in results] == ["failed"] * 4 + ["passed"], [(r.id, r.status) for r in results]
    messages = {ex: " ".join(c.message for c in by_id[ex].checks if c.outcome == "failed") for ex in by_id}
    assert messages["ex01"].startswith("timed out: an infinite loop? ex01 was still running after 10 s")
    assert messages["ex02"].startswith("crashed: the Python process ended (exit code 3)")
    assert "SyntaxError" in messages["ex03"] and "ModuleNotFoundError" in messages["ex04"]
    n_checks = sum(name.startswith("test_") for name in vars(importlib.import_module("exercises.test_ex01_causal_mask")))
    assert [c.outcome for c in by_id["ex01"].checks] == ["failed"] + ["not run"] * (n_checks - 1)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be > 0 seconds, got 0"):
        classroom.run_checks(["ex01"], timeout_s=0)


def test_student_dir_words_split_into_folders_and_exercises(tmp_path):
    (tmp_path / "alice").mkdir()
    (tmp_path / "bob").mkdir()
    known = ["ex01", "ex03", "ex05"]
    folders = [str(tmp_path / "alice"), str(tmp_path / "bob")]
    assert _student_dirs([*folders, "ex03", "5"], known) == ([tmp_path / "alice", tmp_path / "bob"], ["ex03", "ex05"])
    with pytest.raises(UsageError, match="--student-dir .*carol is not a folder"):
        _student_dirs([*folders, str(tmp_path / "carol")], known)
    with pytest.raises(UsageError, match="needs a folder before the exercise ids"):
        _student_dirs(["ex03"], known)


def test_timeout_must_be_positive_on_the_command_line(capsys):
    assert main(["check", "ex01", "--timeout", "0"]) == 2
    assert "minillm: error: --timeout must be a number of seconds > 0, got 0" in capsys.readouterr().err


def test_a_failure_shows_the_kits_message_without_hypothesis_notes_and_times(tmp_path):
    (tmp_path / "ex01_causal_mask.py").write_text(textwrap.dedent("""\
        import torch

        def causal_mask(n_queries, n_keys, device=None, window=None):  # off by one, the window ignored
            return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(n_keys - n_queries + 1)
    """))
    r = minillm("check", "--student-dir", str(tmp_path), "ex01")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "the smallest input hypothesis found where yours differs" in r.stdout  # the kit's differential message
    for note in ("Failing test case", "Falsifying example", "Draw 1", "Explanation"):
        assert note not in r.stdout, note
    row = next(line for line in r.stdout.splitlines() if line.startswith("│ ex01"))
    assert re.search(r"│ +\d+\.\d s │$", row), row  # the exercise's time
    assert re.search(r"\(of 1 exercises\) in \d+\.\d s \(the checks \d+\.\d s", r.stdout)


def test_hypothesis_notes_are_cut_from_a_message():
    from exercises.conftest import without_hypothesis_notes

    message = ("causal_mask(0, 0): wrong values\n  hint:     the last positions\nFailing test case: test_x(\n"
               "    impl=namespace(...),\n)\nDraw 1 (n_keys): 0\nExplanation:\n    These lines were always run")
    assert without_hypothesis_notes(message) == "causal_mask(0, 0): wrong values\n  hint:     the last positions"
    assert without_hypothesis_notes("Falsifying example: f(x=1)") == ""
    assert without_hypothesis_notes("no notes here\nDraw the mask") == "no notes here\nDraw the mask"


def test_a_full_check_of_the_stubs_says_when_the_engine_will_run(tmp_path):
    r = minillm("check", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("runs once ex01-ex08 and ex14 pass; not yet: not attempted ex01, ex02, ex03, ex04, ex05, ex06, ex07, "
            "ex08, ex14.") in r.stdout
    assert "All core exercises pass" not in r.stdout


def test_the_engine_ends_a_check_once_the_core_passes(monkeypatch, tmp_path):
    from rich.console import Console

    from minillm.classroom import grading
    from minillm.cli import check

    calls = []
    monkeypatch.setattr(check, "ensure_model", lambda name, weights_dir: tmp_path / name)  # no download
    monkeypatch.setattr(grading, "run_assembled_engine", lambda folder, model_dir, prompt, max_new_tokens, timeout: (
        calls.append((folder, prompt, timeout)) or grading.EngineRun(1, "Your engine differs\n", "")))
    passed = [ExerciseResult(ex, "t", "f.py", "l", (CheckResult("c", "passed"),)) for ex in check.CORE_EXERCISES]
    console = Console(record=True, width=200)
    assert check._assembled_engine(console, passed, tmp_path, 7.0) is False  # the engine differs: the check fails
    assert calls == [(tmp_path, "What is the capital of France?", 7.0)]  # check's --timeout bounds the engine too
    text = console.export_text()
    assert "All core exercises pass" in text and "Your engine differs" in text  # the sandboxed run's report
    failed = [*passed[:-1], ExerciseResult("ex14", "t", "f.py", "l", (CheckResult("c", "failed"),))]
    assert check._assembled_engine(console, failed, tmp_path) is True and len(calls) == 1
    assert "not yet: failed ex14." in console.export_text()


def test_check_and_the_assembly_agree_on_the_core_exercises():
    from minillm.classroom.assembly import CORE_EXERCISES, PIECES
    from minillm.cli import check

    assert check.CORE_EXERCISES == CORE_EXERCISES == tuple(sorted({ex for ex, _, _ in PIECES}))


def test_the_references_pass_their_checks(tmp_path, run_main):
    r = minillm("check", "--reference", "ex01", "ex14")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed, 0 failed, 0 not attempted (of 2 exercises)" in r.stdout
    r = run_main("check", "--reference", "--student-dir", str(tmp_path))  # refused before any check runs
    assert r.returncode == 2 and "--reference grades minillm's own solutions: drop --student-dir" in r.stderr


def test_reference_answers_import_the_references(tmp_path):
    folder = classroom.reference_answers(tmp_path)
    assert (folder / "ex01_causal_mask.py").read_text().endswith("from minillm.model import causal_mask  # noqa: F401\n")
    assert "from minillm.generate import generate" in (folder / "ex14_generate.py").read_text()
