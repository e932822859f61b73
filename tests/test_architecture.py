"""The architecture the course promises, checked: model.py is the lesson alone, the layers hold.

- ``minillm/model.py`` imports torch and the core only (no speed layer, no C), in at most 400 lines.
- The import contracts in pyproject.toml (``lint-imports``, import-linter): the course's core imports
  nothing from fast/, serving/, views/, formats/, bench/ or cli/; the serving engine does not import
  its HTTP server; no import cycle anywhere in the package (imports inside functions count).
- No module uses another module's private name (``from x import _name``, ``x._name`` on an imported
  module): what two modules share is public, with a docstring.
- Both maps of the package, README.md's and ``minillm/__init__.py``'s docstring, name every
  subpackage and top-level module.
"""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minillm"
README = PACKAGE.parent / "README.md"
MODEL_IMPORTS = {"__future__", "math", "typing", "torch", "torch.nn.functional", "torch.nn", ".config", ".rope",
                 ".kv_cache"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_model_py_imports_torch_and_the_core_only():
    assert _imports(PACKAGE / "model.py") <= MODEL_IMPORTS


def test_model_py_is_at_most_400_lines():
    assert len((PACKAGE / "model.py").read_text().splitlines()) <= 400


@pytest.mark.cli
def test_the_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed (pip install -e '.[lint]')")
    run = subprocess.run([lint], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]


# -- private names stay in their module -----------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p) for p in PACKAGE.rglob("*.py")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))  # dunders are public


def _private_uses(path: Path, source: str | None = None) -> list[str]:
    """Where the module at ``path`` (its text, or ``source``) uses a private name of another minillm module:
    ``from x import _name`` (relative or absolute, inside functions too), or ``x._name`` where ``x`` is a
    minillm module it imported."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text() if source is None else source)
    modules, found = {}, []  # the names this file binds to minillm modules -> the modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            origin = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                if _private(alias.name) and origin.startswith("minillm") and origin != me:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from {origin} import {alias.name}")
                if f"{origin}.{alias.name}" in MODULES:
                    modules[alias.asname or alias.name] = f"{origin}.{alias.name}"
        elif isinstance(node, ast.Import):  # import minillm.x as m: m is minillm.x; import minillm.x: minillm
            for alias in node.names:
                if alias.name in MODULES:
                    modules[alias.asname or "minillm"] = alias.name if alias.asname else "minillm"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and _private(node.attr) and modules[node.value.id] != me):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value.id}.{node.attr} "
                         f"({modules[node.value.id]})")
    return found


def test_no_module_uses_another_modules_private_names():
    """The oracle is the source itself (ast), every module of the package; nothing is exempt."""
    found = [use for path in sorted(PACKAGE.rglob("*.py")) for use in _private_uses(path)]
    assert not found, "private names used across modules (make them public, with a docstring):\n" + "\n".join(found)


def test_the_private_names_check_finds_both_kinds():
    """The check itself, on a text that does both (a check that finds nothing proves nothing)."""
    source = "from ..trace import _short\nfrom .. import cpu_policy\nx = cpu_policy._START\ny = cpu_policy.OPT_OUT\n"
    assert [use.split(": ", 1)[1] for use in _private_uses(PACKAGE / "cli" / "serve.py", source)] == [
        "from minillm.trace import _short", "cpu_policy._START (minillm.cpu_policy)"]


# -- the maps ----------------------------------------------------------------------------------------


def _package_parts() -> list[str]:
    """Every subpackage (``serving/``) and top-level module (``model.py``) of minillm/, but the map itself."""
    packages = [f"{p.parent.name}/" for p in sorted(PACKAGE.glob("*/__init__.py"))]
    return packages + [p.name for p in sorted(PACKAGE.glob("*.py")) if p.name != "__init__.py"]


def _readme_map() -> str:
    text = README.read_text()
    start = text.index("## The package, one concept per file")
    return text[start: text.index("\n## ", start + 1)]


@pytest.mark.parametrize("where", ["README.md", "minillm/__init__.py"])
def test_both_maps_name_every_subpackage_and_top_level_module(where):
    text = _readme_map() if where == "README.md" else ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    missing = [name for name in _package_parts() if not re.search(rf"(?<![\w/]){re.escape(name)}", text)]
    assert not missing, f"{where}'s map does not name {', '.join(missing)}"
