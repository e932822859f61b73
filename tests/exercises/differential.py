"""Differential checks: the student's function against the reference over its whole documented domain.

A scripted case tests what its author thought of; a wrong solution passes when its mistake
lies elsewhere. Here hypothesis draws inputs from everything the docstring allows (dtypes,
batch sizes, positions far from 0, edge sizes, every invalid input it names) and each draw
runs through the reference and the student's code side by side::

    @given(data=st.data())
    @settings(CHECKS)
    def test_agrees_with_the_reference(impl, data):
        n_queries, n_keys = data.draw(...)
        agree(impl.causal_mask, REF.causal_mask, lambda: ((n_queries, n_keys), {}),
              what="causal_mask", exercise="ex01", lesson=LESSON, hint="...")

``agree`` requires the same Python types, shapes and dtypes, values within the dtype's
rounding, inputs left as they were, and on invalid input the same exception class. When it
fails, hypothesis has shrunk the input to the smallest that still fails, and the message
shows that input, the reference's answer, the student's, and the named mistake of
``mistakes.py`` that gives the same answer, if one does.

Runs are reproducible (``derandomize``): a class sees the same inputs on every run.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Callable, Sequence

import torch
from hypothesis import HealthCheck, Phase, settings

from exercises.checking import Case, fmt

# A budget a class can wait for: each differential check runs in well under a second or two
# on the reference. derandomize: the same inputs on every run and machine, so a grade is stable.
# No explain phase: its notes about covered lines mean nothing to a student.
CHECKS = settings(max_examples=60, deadline=None, derandomize=True, database=None, report_multiple_bugs=False,
                  phases=[Phase.explicit, Phase.generate, Phase.shrink],
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                         HealthCheck.data_too_large, HealthCheck.filter_too_much])

# (atol, rtol) for values computed in each dtype: a few units in the last place of the dtype,
# since a correct solution may add in another order than the reference.
TOLERANCE = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-5, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}

Inputs = Callable[[], tuple[tuple, dict]]


def agree(student: Callable, reference: Callable, inputs: Inputs, *, what: str, exercise: str, lesson: str,
          hint: str, tol: tuple[float, float] | None = None, check: Callable | None = None,
          tell_apart: Sequence[Inputs] = ()) -> Any:
    """Call both on fresh copies of ``inputs()`` and fail with a teaching message where they differ.

    inputs: builds (args, kwargs) anew on each call (a generator is consumed once; a tensor
        may be changed in place by wrong code), so both sides get equal, untouched inputs.
    tol: (atol, rtol) for floating values; default by the expected tensor's dtype.
    check: an extra demand, ``check(args, kwargs, got) -> problem or None`` (a view that must
        share the input's storage, say).
    tell_apart: more inputs on which a known mistake must also answer as the student's code
        does to be named: the smallest failing input often fits several (a window of 1 over 2
        keys: ignoring the window and a window one key too wide both see both keys).
    Returns the reference's answer (None when it raises).
    """
    __tracebackhide__ = True
    args, kwargs = inputs()
    case = Case(f"{what}({describe(args, kwargs)})", "the smallest input hypothesis found where yours differs",
                hint=hint, lesson=lesson)
    expected, ref_error = _run(reference, inputs)
    student_args, student_kwargs = inputs()
    try:
        got = student(*student_args, **student_kwargs)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - compared with what the reference does below
        if ref_error is not None and isinstance(e, type(ref_error)):
            return None
        expected_text = f"raises {type(ref_error).__name__}: {ref_error}" if ref_error else expected
        case.fail(f"raised {type(e).__name__}: {e}", expected_text, f"raises {type(e).__name__}",
                  **_known_mistake(exercise, what, inputs, error=e, tell_apart=_answers(student, tell_apart)))
    if ref_error is not None:
        case.fail(f"returned instead of raising {type(ref_error).__name__}",
                  f"raises {type(ref_error).__name__}: {ref_error}", got,
                  **_known_mistake(exercise, what, inputs, got=got, tell_apart=_answers(student, tell_apart)))
    problem = difference(got, expected, tol)
    if problem:
        case.fail(problem, expected, got,
                  **_known_mistake(exercise, what, inputs, got=got, tell_apart=_answers(student, tell_apart)))
    fresh_args, fresh_kwargs = inputs()
    changed = _changed_input(student_args, student_kwargs, fresh_args, fresh_kwargs)
    if changed:
        case.fail(f"changed its input {changed} in place", hint="work on new tensors (or clone) and leave the "
                  "caller's inputs as they were: the caller may still need them")
    if check is not None:
        extra = check(student_args, student_kwargs, got)
        if extra:
            case.fail(extra)
    return expected


def difference(got, expected, tol: tuple[float, float] | None = None, where: str = "") -> str | None:
    """What differs between ``got`` and ``expected`` (types, shapes, dtypes, values), or None when equal.

    Strict about types: a one-element tensor is not an int, an int is not a float, a list is
    not a tuple, True is not 1.
    """
    at = f" at {where}" if where else ""
    if isinstance(expected, torch.Tensor):
        return _tensor_difference(got, expected, tol, at)
    if expected is None or isinstance(expected, (bool, str)):
        return None if type(got) is type(expected) and got == expected else _value(got, expected, at)
    if isinstance(expected, int):
        if not isinstance(got, int) or isinstance(got, bool):
            return f"wrong type{at}: expected an int, got {type(got).__name__}"
        return None if got == expected else _value(got, expected, at)
    if isinstance(expected, float):
        if not isinstance(got, float):
            return f"wrong type{at}: expected a float, got {type(got).__name__}"
        return None if _close(got, expected, tol or (1e-9, 1e-9)) else _value(got, expected, at)
    if isinstance(expected, (tuple, list)):
        if type(got) is not type(expected):
            return f"wrong type{at}: expected a {type(expected).__name__}, got {type(got).__name__}"
        if len(got) != len(expected):
            return f"wrong length{at}: expected {len(expected)}, got {len(got)}"
        return _first(difference(g, e, tol, f"{where}[{i}]") for i, (g, e) in enumerate(zip(got, expected)))
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            return f"wrong keys{at}: expected {sorted(map(str, expected))}, got {_keys(got)}"
        return _first(difference(got[k], expected[k], tol, f"{where}[{k!r}]") for k in expected)
    if dataclasses.is_dataclass(expected):
        if not isinstance(got, type(expected).__mro__[0]) and type(got).__name__ != type(expected).__name__:
            return f"wrong type{at}: expected a {type(expected).__name__}, got {type(got).__name__}"
        return _first(difference(getattr(got, f.name), getattr(expected, f.name), tol,
                                 f"{where}.{f.name}" if where else f.name) for f in dataclasses.fields(expected))
    return None if got == expected else _value(got, expected, at)


def _tensor_difference(got, expected: torch.Tensor, tol, at: str) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"wrong type{at}: expected a tensor, got {type(got).__name__}"
    if got.shape != expected.shape:
        return f"wrong shape{at}: expected {list(expected.shape)}, got {list(got.shape)}"
    if got.dtype != expected.dtype:
        return f"wrong dtype{at}: expected {expected.dtype}, got {got.dtype}"
    if got.device != expected.device:
        return f"wrong device{at}: expected {expected.device}, got {got.device}"
    g, e = got.detach().cpu(), expected.detach().cpu()
    if not (e.is_floating_point() or e.is_complex()):
        return None if torch.equal(g, e) else f"wrong values{at}"
    atol, rtol = tol or TOLERANCE.get(e.dtype, (1e-5, 1e-4))
    g, e = g.double(), e.double()
    if not torch.equal(g.isnan(), e.isnan()):
        return f"wrong values{at}: NaN where the reference has {'none' if not e.isnan().any() else 'other values'}"
    same = torch.isclose(g, e, atol=atol, rtol=rtol) | (g.isnan() & e.isnan()) | (g == e)
    if bool(same.all()):
        return None
    i = int((~same).reshape(-1).nonzero()[0])
    index = [int(x) for x in torch.unravel_index(torch.tensor(i), e.shape)] if e.dim() else []
    return (f"wrong values{at}: at {index} expected {e.reshape(-1)[i].item():.6g}, got {g.reshape(-1)[i].item():.6g} "
            f"(allowed difference {atol:g} + {rtol:g}·|expected| for {expected.dtype})")


def _close(got: float, expected: float, tol: tuple[float, float]) -> bool:
    if math.isnan(expected) or math.isnan(got):
        return math.isnan(expected) and math.isnan(got)
    return got == expected or math.isclose(got, expected, abs_tol=tol[0], rel_tol=tol[1])


def _value(got, expected, at: str) -> str:
    return f"wrong value{at}: expected {fmt(expected)}, got {fmt(got)}"


def _keys(got) -> str:
    return str(sorted(map(str, got))) if isinstance(got, dict) else type(got).__name__


def _first(problems) -> str | None:
    return next((p for p in problems if p), None)


def _run(fn: Callable, inputs: Inputs):
    args, kwargs = inputs()
    try:
        return fn(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - the reference's error is the expected behaviour
        return None, e


def _changed_input(args, kwargs, fresh_args, fresh_kwargs) -> str | None:
    for i, (a, b) in enumerate(zip(args, fresh_args)):
        if _mutable(a) and difference(a, b, (0.0, 0.0)):
            return f"argument {i + 1}"
    for name, value in kwargs.items():
        if _mutable(value) and difference(value, fresh_kwargs[name], (0.0, 0.0)):
            return name
    return None


def _mutable(x) -> bool:
    return isinstance(x, (torch.Tensor, list, dict))


def describe(args: tuple, kwargs: dict) -> str:
    """The call's arguments, short: tensors by shape and dtype (their values follow on their own lines)."""
    parts = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        values = fmt(x) if x.numel() <= 8 else ""
        shown = f" = {values}" if values and "\n" not in values else ""
        return f"tensor{list(x.shape)} {str(x.dtype).removeprefix('torch.')}{shown}"
    if isinstance(x, torch.Generator):
        return f"Generator(seed={x.initial_seed()})"
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


def _known_mistake(exercise: str, what: str, inputs: Inputs, got=None, error: Exception | None = None,
                   tell_apart: Sequence[tuple[Inputs, Any, Exception | None]] = ()) -> dict:
    """Case.fail's ``mistake`` (a line) and ``mistake_name`` for the mistake of mistakes.py that gives
    the same answer on this input, and on each of ``tell_apart`` (inputs, the student's answer, its
    error) the student's; {} when none does."""
    for m, wrong in _mistakes_of(exercise, what.split("(")[0]):
        if _answers_as(wrong, inputs, got, error) and all(_answers_as(wrong, *more) for more in tell_apart):
            return _same_as(m, len(tell_apart))
    return {}


def _answers(student: Callable, tell_apart: Sequence[Inputs]) -> list[tuple[Inputs, Any, Exception | None]]:
    return [(more, *_run(student, more)) for more in tell_apart]


def _answers_as(wrong: Callable, inputs: Inputs, got, error: Exception | None) -> bool:
    """Whether ``wrong`` on ``inputs()`` returns ``got``, or raises the class of ``error``."""
    args, kwargs = inputs()
    try:
        theirs = wrong(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        return error is not None and type(e) is type(error)
    return error is None and difference(got, theirs) is None


def _same_as(m, more_inputs: int = 0) -> dict:
    # one input cannot tell two mistakes apart: a hint to look at, not a diagnosis
    where = f"on this input, and on {more_inputs} more that tell the known mistakes apart," if more_inputs else \
        "on this input"
    return {"mistake": f"{where} yours answers as the known mistake '{m.name}' does ({m.what}); it may be "
                       "yours, or another with the same answer here",
            "mistake_name": m.name}


def _mistakes_of(exercise: str, name: str):
    """(mistake, callable) for the mistakes replacing ``name``: a function ("sample"), or a
    classmethod ("RequestMetrics.from_timestamps"), called on the wrong subclass."""
    from exercises.mistakes import MISTAKES, swap_in  # mistakes.py imports the kit's users, not the other way
    from exercises.registry import EXERCISES, reference

    for m in MISTAKES:
        if m.exercise != exercise:
            continue
        if "." not in m.replaces:
            if m.replaces == name.split(".")[-1]:
                yield m, m.fn
            continue
        cls_name, method = m.replaces.split(".")
        if m.replaces != name:
            continue
        wrong_class = getattr(swap_in(m, reference(EXERCISES[exercise])), cls_name)
        if isinstance(inspect.getattr_static(wrong_class, method), (classmethod, staticmethod)):
            yield m, getattr(wrong_class, method)
