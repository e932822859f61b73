"""The notebooks in notebooks/ are part of the course: each must run top to bottom, and the
committed copy must carry its outputs (readers see the numbers without running anything).

Two checks per notebook, parametrized over every ``notebooks/*.ipynb``:

- ``test_committed_notebook_has_outputs``: every code cell of the committed file was run, in
  order, by one kernel (execution counts 1, 2, 3, ...), the outputs were saved, and none is an
  error. Fast, no kernel.
- ``test_notebook_executes``: runs the notebook with nbclient in a fresh ``python3`` kernel
  (this interpreter's ipykernel), cwd ``notebooks/``, and fails on the first cell that raises.
  Each notebook should finish in under 2 minutes on a laptop CPU; the test allows
  ``MINILLM_NOTEBOOK_BUDGET_S`` seconds (default 300, generous for shared CI machines).
"""

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600
BUDGET_S = float(os.environ.get("MINILLM_NOTEBOOK_BUDGET_S", 300))


def committed_problems(nb) -> list[str]:
    """What is wrong with a notebook as committed: unexecuted or out-of-order cells, no outputs, errors."""
    cells = [(i, cell) for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and cell.source.strip()]
    problems = []
    # A cell that ran has an execution count (an import cell may rightly print nothing);
    # counts 1, 2, 3, ... mean one kernel ran the cells top to bottom, once each.
    counts = [cell.execution_count for _, cell in cells]
    if counts != list(range(1, len(cells) + 1)):
        problems.append(f"execution counts {counts}: run it top to bottom in a fresh kernel and save it")
    if cells and not any(cell.outputs for _, cell in cells):
        problems.append("no outputs at all: save it with its outputs")
    for i, cell in cells:
        for out in cell.outputs:
            if out.output_type == "error":
                problems.append(f"cell {i} has an error output: {out.get('ename')}: {out.get('evalue')}")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_has_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert committed_problems(nb) == [], path.name


def test_committed_problems_are_found():
    v4 = nbformat.v4
    good = v4.new_notebook(cells=[v4.new_code_cell("import math", execution_count=1),
                                  v4.new_code_cell("math.pi", execution_count=2,
                                                   outputs=[v4.new_output("execute_result", {"text/plain": "3.14"},
                                                                          execution_count=2)])])
    assert committed_problems(good) == []
    unexecuted = v4.new_notebook(cells=[v4.new_code_cell("1 + 1")])
    assert any("execution counts" in p for p in committed_problems(unexecuted))
    failed = v4.new_notebook(cells=[v4.new_code_cell("1 / 0", execution_count=1, outputs=[
        v4.new_output("error", ename="ZeroDivisionError", evalue="division by zero", traceback=[])])])
    assert any("ZeroDivisionError" in p for p in committed_problems(failed))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, smollm2_dir, monkeypatch):
    from minillm import weights

    # The kernel inherits this environment: the same weights folder as the tests use
    # (smollm2_dir has made sure the default model is there), plots rendered inline.
    monkeypatch.setenv("MINILLM_WEIGHTS", str(weights.weights_dir()))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    # kernel_name "python3" with argv "python": jupyter_client starts it with this
    # interpreter (sys.executable), so the kernel sees the same minillm and torch.
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    start = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{path.name} failed:\n{error}", pytrace=False)
    elapsed = time.perf_counter() - start
    assert elapsed < BUDGET_S, f"{path.name} took {elapsed:.0f} s to run (budget {BUDGET_S:.0f} s; target < 120 s)"
