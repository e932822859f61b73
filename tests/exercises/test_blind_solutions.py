"""Honest checks, part 4: solutions written blind (from the stubs and lessons alone, see blind/README.md).

The right ones pass every check of their exercise; each wrong one is rejected by at least one,
with a teaching message (an AssertionError), never a crash of the check itself.
"""

from pathlib import Path

import pytest

from exercises.registry import EXERCISES, student
from exercises.test_mistakes_are_caught import checks_of

BLIND = Path(__file__).parent / "blind"
BY_FILE = {ex.file: ex for ex in EXERCISES.values()}


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
def test_a_right_solution_written_blind_passes(name):
    ex = BY_FILE[name]
    rejected, crashed = run_checks(ex, BLIND / "correct")
    assert not rejected and not crashed, f"the checks of {ex.id} fail a right solution: {rejected + crashed}"


WRONG = sorted(p for p in (BLIND / "wrong").iterdir() if p.is_dir())


@pytest.mark.parametrize("folder", WRONG, ids=[p.name for p in WRONG])
def test_a_wrong_solution_written_blind_is_rejected(folder):
    [file] = [p.name for p in folder.glob("ex*.py")]
    ex = BY_FILE[file]
    rejected, crashed = run_checks(ex, folder)
    assert not crashed, f"{folder.name} crashed checks of {ex.id} instead of failing them: {crashed}"
    assert rejected, f"no check of {ex.id} rejects {folder.name}"
