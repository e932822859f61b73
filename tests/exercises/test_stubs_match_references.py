"""Drift: every stub in lessons/exercises/ has exactly the signature and docstring of its
reference in minillm, and still raises NotImplementedError pointing at the lesson; every
exercise's pytest mark is registered in pyproject.toml."""

import inspect

import pytest

from exercises.registry import EXERCISES, STUBS_DIR, load_module, reference


def own(namespace, written: str):
    """The function written by the student: ``name`` or ``Class.method`` as defined in that class itself."""
    if "." not in written:
        return getattr(namespace, written)
    cls_name, method = written.split(".")
    raw = vars(getattr(namespace, cls_name)).get(method)
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw


EACH = pytest.mark.parametrize("exercise", list(EXERCISES.values()), ids=list(EXERCISES))


@EACH
def test_stub_file_exists_and_imports(exercise):
    assert (STUBS_DIR / exercise.file).is_file(), f"missing stub lessons/exercises/{exercise.file}"
    load_module(STUBS_DIR / exercise.file, f"stub_{exercise.stem}")


@EACH
def test_stub_signatures_and_docstrings_match(exercise):
    stub = load_module(STUBS_DIR / exercise.file, f"stub_{exercise.stem}")
    ref = reference(exercise)
    for name in exercise.refs:
        if inspect.isclass(getattr(ref, name)):
            assert issubclass(getattr(stub, name), getattr(ref, name)), \
                f"{exercise.file}: {name} must subclass minillm's {name} (the student writes only some methods)"
    for written in exercise.written:
        s, r = own(stub, written), own(ref, written)
        assert s is not None, f"{exercise.file} does not define {written}"
        assert inspect.signature(s) == inspect.signature(r), \
            f"{exercise.file}: {written}{inspect.signature(s)} differs from minillm's {written}{inspect.signature(r)}"
        assert inspect.cleandoc(s.__doc__ or "") == inspect.cleandoc(r.__doc__ or ""), \
            f"{exercise.file}: the docstring of {written} differs from minillm's; copy it again"


@EACH
def test_stubs_raise_not_implemented_with_a_pointer(exercise):
    stub = load_module(STUBS_DIR / exercise.file, f"stub_{exercise.stem}")
    for written in exercise.written:
        fn = own(stub, written)
        n_required = sum(p.default is p.empty for p in inspect.signature(fn).parameters.values())
        with pytest.raises(NotImplementedError) as e:
            fn(*[None] * n_required)
        message = str(e.value)
        assert message.startswith(f"Exercise {exercise.number} "), f"{written}: {message!r}"
        assert "lessons/" in message and ".md" in message, f"{written}: no lesson pointer in {message!r}"


@EACH
def test_its_pytest_mark_is_registered(exercise, pytestconfig):
    """An unregistered mark (ex18 was) makes every pytest run print PytestUnknownMarkWarning."""
    registered = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert exercise.id in registered, (f"add \"{exercise.id}: exercise {exercise.number}, {exercise.title}\" to "
                                       "[tool.pytest.ini_options] markers in pyproject.toml")
