"""Honest checks, part 4: solutions written blind (from the stubs and lessons alone, see blind/README.md).

The right ones pass every check of their exercise; each wrong one is rejected by the checks its
patch names, with a teaching message (an AssertionError), never a crash of the check itself.
The wrong ones (and exercise 4's right one) are stored as patches: the files are written at test
time into a scratch folder and graded there, as ``minillm check exNN --student-dir FOLDER`` would.
"""

import re
import shutil
from pathlib import Path

import pytest

from exercises.registry import EXERCISES, student
from exercises.test_mistakes_are_caught import checks_of

pytestmark = pytest.mark.grader

BLIND = Path(__file__).parent / "blind"
BY_FILE = {ex.file: ex for ex in EXERCISES.values()}
WRONG = sorted((BLIND / "wrong").glob("*.diff"))


def apply_diff(diff: Path, source: Path, dest: Path) -> str:
    """Write the file ``diff`` makes from ``source/NAME`` (its ``--- a/NAME``) into ``dest``; return its name.

    A hunk's old lines (context and ``-``) must stand exactly once in the file: the line numbers
    after ``@@`` are not used. AssertionError, naming the patch and the file, where they do not.
    """
    text = diff.read_text()
    names = re.search(r"^--- a/(\S+)\n\+\+\+ b/(\S+)$", text, re.M)
    assert names, f"{diff.name} is not a unified diff of one file (no '--- a/NAME', '+++ b/NAME' lines)"
    old_name, new_name = names.groups()
    code = "\n" + (source / old_name).read_text()
    for hunk in re.split(r"^@@ .*$", text, flags=re.M)[1:]:
        lines = [line or " " for line in hunk.splitlines()[1:]]  # an editor may strip a blank context line's space
        old = "".join(f"\n{line[1:]}" for line in lines if line[0] in " -")
        new = "".join(f"\n{line[1:]}" for line in lines if line[0] in " +")
        found = code.count(old + "\n")
        assert found == 1, f"blind/{diff.parent.name}/{diff.name} no longer applies to blind/correct/{old_name}: " \
                           f"its lines stand there {found} times, not once:{old}"
        code = code.replace(old + "\n", new + "\n")
    (dest / new_name).write_text(code[1:])
    return new_name


@pytest.fixture(scope="module")
def correct(tmp_path_factory) -> Path:
    """blind/correct/ as a folder of exercise files, its patches applied."""
    folder = tmp_path_factory.mktemp("correct")
    for path in (BLIND / "correct").glob("*.py"):
        shutil.copy(path, folder)
    for diff in (BLIND / "correct").glob("*.diff"):
        apply_diff(diff, folder, folder)
    return folder


def run_checks(ex, folder: Path) -> tuple[list[str], list[str]]:
    """(rejections, crashes) of the exercise's checks on ``folder``'s solution."""
    impl = student(ex, folder)
    rejected, crashed = [], []
    for check in checks_of(ex.id):
        try:
            check(impl)
        except AssertionError as e:
            rejected.append(f"{check.__name__}: {str(e).splitlines()[0]}")
        except Exception as e:  # noqa: BLE001
            crashed.append(f"{check.__name__}: {type(e).__name__}: {e}")
    return rejected, crashed


@pytest.mark.parametrize("name", sorted(BY_FILE))
def test_a_right_solution_written_blind_passes(name, correct):
    ex = BY_FILE[name]
    rejected, crashed = run_checks(ex, correct)
    assert not rejected and not crashed, f"the checks of {ex.id} fail a right solution: {rejected + crashed}"


@pytest.mark.parametrize("diff", WRONG, ids=[p.stem for p in WRONG])
def test_a_wrong_solution_written_blind_is_rejected(diff, correct, tmp_path):
    ex = BY_FILE[apply_diff(diff, correct, tmp_path)]
    rejected, crashed = run_checks(ex, tmp_path)
    assert not crashed, f"{diff.stem} crashed checks of {ex.id} instead of failing them: {crashed}"
    named = re.findall(r"^Rejected by: (\w+)$", diff.read_text(), re.M)
    assert named, f"{diff.name} names no check that rejects it (a line 'Rejected by: test_...')"
    passed = [check for check in named if not any(r.startswith(f"{check}: ") for r in rejected)]
    assert not passed, f"{diff.stem}: {passed} of {ex.id} no longer reject it (rejected by: {rejected or 'none'})"
