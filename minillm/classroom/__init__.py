"""The classroom: grading the exercises (``minillm check``) and running the student's pieces as one engine.

    grading.py   run the checks of tests/exercises/ on a student's files, one result per exercise
    sandbox.py   how a student's code is run: a child process with limits, in a scratch folder,
                 walled off from the network, the homes and the other students where the machine allows
    reports.py   a whole class: graded min(cores, students) at a time, then its grades as files
                 (CSV, JSON, Gradescope's results.json, an HTML page; ``--report-dir DIR``)
    assembly.py  the real model with the student's mask, attention, RoPE, KV cache, prefill,
                 decode, sampling and generate loop swapped in, against minillm's own
                 (``minillm generate --student-dir DIR``)

The core (model.py, phases.py, kv_cache.py, sampling.py, rope.py) imports nothing from here
(pyproject.toml's import contracts): the assembly swaps the student's functions in from outside,
for the length of one run.
"""

from __future__ import annotations

from .grading import (CHECKS_DIR, DEFAULT_TIMEOUT_S, POLL_S, STUBS_DIR, CheckResult, ExerciseResult,
                      exercise_ids, find_checkout, normalize_exercise, pytest_command, reference_answers,
                      run_checks)

__all__ = ["CHECKS_DIR", "DEFAULT_TIMEOUT_S", "POLL_S", "STUBS_DIR", "CheckResult", "ExerciseResult",
           "exercise_ids", "find_checkout", "normalize_exercise", "pytest_command", "reference_answers",
           "run_checks"]
