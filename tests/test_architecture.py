"""The architecture the course promises, checked: model.py is the lesson alone, the layers hold.

- ``minillm/model.py`` imports torch and the core only (no speed layer, no C), in at most 400 lines.
- The import contracts in pyproject.toml (``lint-imports``, import-linter): the course's core imports
  nothing from fast/, serving/, views/, formats/, bench/ or cli/; the serving engine does not import
  its HTTP server; no import cycle anywhere in the package (imports inside functions count).
"""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minillm"
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


def test_the_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed (pip install -e '.[lint]')")
    run = subprocess.run([lint], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
