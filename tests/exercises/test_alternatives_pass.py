"""Honest checks, part 3: correct solutions written another way pass every check of their exercise."""

import pytest

from exercises.alternatives import ALTERNATIVES, Alternative
from exercises.mistakes import swap_in
from exercises.registry import EXERCISES, reference
from exercises.test_mistakes_are_caught import checks_of

pytestmark = pytest.mark.grader


@pytest.mark.parametrize("alt", [pytest.param(a, id=f"{a.exercise}-{a.name}", marks=getattr(pytest.mark, a.exercise))
                                 for a in ALTERNATIVES])
def test_alternative_passes_every_check(alt: Alternative):
    impl = swap_in(alt, reference(EXERCISES[alt.exercise]))
    failed = []
    for check in checks_of(alt.exercise):
        try:
            check(impl)
        except Exception as e:  # noqa: BLE001 - any failure of a right answer is the check's fault
            failed.append(f"{check.__name__}: {type(e).__name__}: {str(e).splitlines()[0]}")
    assert not failed, f"checks of {alt.exercise} reject the correct {alt.name}: {failed}"


def test_every_exercise_has_an_alternative():
    missing = sorted(set(EXERCISES) - {a.exercise for a in ALTERNATIVES})
    assert not missing, f"exercises with no correct alternative solution in alternatives.py: {missing}"
