"""Failure messages that teach: expected vs got on a tiny case, the shapes, a hint, the lesson.

A check describes its tiny case once and asserts through it::

    c = Case("causal_mask(2, 5)", "2 new queries after 3 cached keys",
             shapes="[n_queries, n_keys] = [2, 5]",
             hint="query i sits at position n_keys - n_queries + i", lesson=LESSON)
    c.equal(c.call(impl.causal_mask, 2, 5), expected)

which, when wrong, fails with::

    causal_mask(2, 5): wrong values
      case:     2 new queries after 3 cached keys
      shapes:   [n_queries, n_keys] = [2, 5]
      expected: 1 1 1 1 0
                1 1 1 1 1
      got:      1 1 0 0 0
                1 1 1 0 0
      hint:     query i sits at position n_keys - n_queries + i
      lesson:   lessons/02-prefill-and-decode.md#the-causal-mask

Every failure is an AssertionError (also when the code under test crashes), which is
what ``test_mistakes_are_caught.py`` counts as "the check rejected the mistake".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

import torch

MAX_SHOWN = 32  # tensors with more elements are summarised


@dataclass
class Case:
    """One tiny case of one check.

    Attributes:
        what: the call being checked, e.g. "eager_attention(q, k, v)".
        case: the situation in words, e.g. "decode: 1 query, 3 keys".
        hint: what a correct implementation does here (points at the usual mistake).
        lesson: the lesson section to read.
        shapes: the shapes involved, e.g. "q [1, 2, 1, 4], k/v [1, 2, 3, 4] ([B, heads, T, head_dim])".
    """

    what: str
    case: str
    hint: str
    lesson: str
    shapes: str = ""

    def fail(self, problem: str, expected=None, got=None, hint: str | None = None, detail: str = "",
             mistake: str = "", mistake_name: str = "") -> NoReturn:
        """Raise the AssertionError that teaches; ``mistake`` is its line naming a known mistake, and
        ``mistake_name`` that mistake's name in mistakes.py, carried on the error as ``.mistake``
        (conftest.py writes it beside the message: minillm check's class report counts them)."""
        __tracebackhide__ = True
        lines = [f"{self.what}: {problem}", _field("case", self.case)]
        if self.shapes:
            lines.append(_field("shapes", self.shapes))
        if expected is not None or got is not None:
            lines += [_field("expected", fmt(expected)), _field("got", fmt(got))]
        if detail:
            lines.append(_field("where", detail))
        if mistake:
            lines.append(_field("mistake", mistake))
        lines += [_field("hint", hint or self.hint), _field("lesson", self.lesson)]
        error = AssertionError("\n".join(lines))
        error.mistake = mistake_name
        raise error

    def call(self, fn, *args, **kwargs):
        """fn(*args, **kwargs); a crash becomes a failure that names this case.

        NotImplementedError passes through: it means "not attempted" (see conftest.py).
        """
        __tracebackhide__ = True
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - any crash of the code under test is a failed check
            self.fail(f"raised {type(e).__name__}: {e}")

    def raises(self, error: type[Exception], fn, *args, **kwargs) -> None:
        """fn(*args, **kwargs) must raise ``error`` (the docstring promises it); returning is a failure."""
        __tracebackhide__ = True
        try:
            got = fn(*args, **kwargs)
        except NotImplementedError:
            raise
        except error:
            return
        except Exception as e:  # noqa: BLE001 - the wrong error is a failed check too
            self.fail(f"raised {type(e).__name__}: {e}", expected=f"{error.__name__} naming the problem",
                      got=type(e).__name__)
        self.fail(f"returned instead of raising {error.__name__}", expected=error.__name__, got=_short(got))

    def equal(self, got, expected, hint: str | None = None) -> None:
        """Exactly equal: tensors (shape, dtype kind and values), numbers, tuples, None."""
        __tracebackhide__ = True
        if isinstance(expected, torch.Tensor):
            self._same_shape(got, expected, hint)
            if got.dtype != expected.dtype:
                self.fail(f"wrong dtype: expected {_dtype(expected)}, got {_dtype(got)}", hint=hint)
            if not torch.equal(got.cpu(), expected.cpu()):
                self.fail("wrong values", expected, got, hint, _first_difference(got, expected))
        else:
            self._same_type(got, expected, hint)
            if got != expected:
                self.fail("wrong value", expected, got, hint)

    def close(self, got, expected, hint: str | None = None, atol: float = 1e-5, rtol: float = 1e-4) -> None:
        """Equal up to float rounding: tensors of the same shape, or numbers (None must match None)."""
        __tracebackhide__ = True
        if isinstance(expected, torch.Tensor):
            self._same_shape(got, expected, hint)
            g, e = got.detach().cpu().double(), expected.detach().cpu().double()
            if not torch.allclose(g, e, atol=atol, rtol=rtol, equal_nan=False):
                self.fail("wrong values", expected, got, hint, _largest_difference(g, e))
        elif isinstance(expected, (tuple, list)):
            self._same_type(got, expected, hint)
            ok = len(got) == len(expected) and all(
                _is_number(g) and math.isclose(g, e, rel_tol=rtol, abs_tol=atol) for g, e in zip(got, expected))
            if not ok:
                self.fail("wrong values", expected, got, hint)
        elif expected is None or not _is_number(expected):
            self._same_type(got, expected, hint)
            if got != expected:
                self.fail("wrong value", expected, got, hint)
        elif not _is_number(got):
            self.fail(f"wrong type: expected a number, got {type(got).__name__}", expected, got, hint)
        elif not math.isclose(float(got), float(expected), rel_tol=rtol, abs_tol=atol):
            self.fail("wrong value", expected, got, hint)

    def true(self, ok: bool, problem: str, expected=None, got=None, hint: str | None = None) -> None:
        """Fail with ``problem`` unless ``ok``."""
        __tracebackhide__ = True
        if not ok:
            self.fail(problem, expected, got, hint)

    def _same_type(self, got, expected, hint) -> None:
        """Strict about types: a one-element tensor is not an int, True is not 1, a list is not a tuple."""
        __tracebackhide__ = True
        if isinstance(expected, bool) or expected is None:
            ok = got is expected if expected is None else isinstance(got, bool)
        elif isinstance(expected, int):
            ok = isinstance(got, int) and not isinstance(got, bool)
        elif isinstance(expected, float):
            ok = _is_number(got)
        elif isinstance(expected, (tuple, list)):
            ok = isinstance(got, (tuple, list))
        else:
            ok = True
        if not ok:
            self.fail(f"wrong type: expected {type(expected).__name__}, got {type(got).__name__}", expected, got,
                      hint)

    def _same_shape(self, got, expected: torch.Tensor, hint) -> None:
        __tracebackhide__ = True
        if not isinstance(got, torch.Tensor):
            self.fail(f"expected a tensor of shape {shape(expected)}, got {type(got).__name__}", hint=hint)
        if got.shape != expected.shape:
            self.fail(f"wrong shape: expected {shape(expected)}, got {shape(got)}", hint=hint)


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 200 else text[:200] + "..."


def shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(map(str, t.shape)) + "]"


def fmt(x) -> str:
    """A short, readable rendering: bool masks as 0/1 grids, small tensors rounded to 4 decimals."""
    if not isinstance(x, torch.Tensor):
        if isinstance(x, float):
            return f"{x:.6g}"
        if isinstance(x, (tuple, list)) and x and all(isinstance(v, float) for v in x):
            return "(" + ", ".join(f"{v:.6g}" for v in x) + ")"
        return repr(x)
    t = x.detach().cpu()
    if t.numel() == 0:
        return f"tensor {shape(t)} {_dtype(t)} (empty)"
    if t.numel() > MAX_SHOWN:
        flat = ", ".join(_num(v) for v in t.reshape(-1)[:6].tolist())
        return f"tensor {shape(t)} {_dtype(t)}, starting {flat}, ..."
    if t.dtype == torch.bool and t.dim() == 2:
        return "\n".join(" ".join("1" if v else "0" for v in row) for row in t.tolist())
    if t.dim() <= 1:
        return "[" + ", ".join(_num(v) for v in t.reshape(-1).tolist()) + "]" + (" (scalar)" if t.dim() == 0 else "")
    rows = t.reshape(-1, t.shape[-1]).tolist()
    return "\n".join("[" + ", ".join(_num(v) for v in row) + "]" for row in rows) + f"   {shape(t)}"


def _num(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(name: str, text: str) -> str:
    pad = " " * 12
    body = str(text).replace("\n", "\n" + pad)
    return f"  {name + ':':<10}{body}"


def _first_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    idx = (got.cpu() != expected.cpu()).nonzero()[0].tolist()
    e, g = expected[tuple(idx)].item(), got[tuple(idx)].item()
    return f"first difference at {idx}: expected {_num(e)}, got {_num(g)}"


def _largest_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    # equal infinities (two -inf of a filtered token) differ by nan, not by nothing: count them as equal
    diff = torch.where(got == expected, 0.0, (got - expected).abs()).nan_to_num(nan=math.inf)
    flat = int(diff.reshape(-1).argmax())
    idx = list(torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else []
    idx = [int(i) for i in idx]
    e, g = expected.reshape(-1)[flat].item(), got.reshape(-1)[flat].item()
    return f"largest difference at {idx}: expected {e:.6g}, got {g:.6g}"
