"""The notebooks in notebooks/ are part of the course: each must run top to bottom, and the
committed copy must carry its outputs (readers see the numbers without running anything).

Two checks per notebook, parametrized over every ``notebooks/*.ipynb``:

- ``test_committed_notebook_has_outputs``: every code cell of the committed file was run, in
  order, by one kernel (execution counts 1, 2, 3, ...), the outputs were saved, and none is an
  error. Fast, no kernel.
- ``test_one_calibration_printed`` and ``test_no_floor_beaten_silently`` read the committed outputs:
  every notebook that uses this machine's calibration (``get_hardware``) prints it, all print the
  same one, and a measured time is never shown below its roofline floor (a ratio ``0.7x`` next to
  the word "floor") unless the cell also says why ("faster than the floor").
- ``test_notebook_executes``: runs the notebook with nbclient in a fresh ``python3`` kernel
  (this interpreter's ipykernel), cwd ``notebooks/``, and fails on the first cell that raises
  (or runs past CELL_TIMEOUT_S: a hang, not a slow machine). The only test here that runs a kernel,
  so the only one of the slow kind ``notebook``.
"""

import re
from pathlib import Path

import pytest

NEEDS = "is not installed (pip install -e '.[notebooks]')"
nbformat = pytest.importorskip("nbformat", reason=f"nbformat {NEEDS}")
nbclient = pytest.importorskip("nbclient", reason=f"nbclient {NEEDS}")
pytest.importorskip("ipykernel", reason=f"ipykernel {NEEDS}")

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600


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


# The calibrated CPU as HardwareProfile.__str__ prints it ("cpu (AMD EPYC): 0.187 TFLOP/s, 32.73 GB/s")
# and as the notebooks print it in GFLOP/s ("peak 186.6 GFLOP/s, 32.7 GB/s").
CALIBRATION_TFLOPS = re.compile(r"cpu \([^)]*\): ([\d.]+) TFLOP/s, ([\d.]+) GB/s")
CALIBRATION_GFLOPS = re.compile(r"peak ([\d.]+) GFLOP/s, ([\d.]+) GB/s")
# A measured/floor ratio: "2.94x the floor", "0.7× for prefill" on a line about floors, "2.4x" in an
# "x floor" column. Any such number next to the word "floor" in one cell's output is checked.
RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s?[x×](?![\w])")
BEATEN_EXPLAINED = "faster than the floor"


def cell_texts(nb) -> list[str]:
    """The printed text of each code cell's outputs (streams and plain-text results)."""
    texts = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        parts = [out.get("text", "") if out.output_type == "stream" else out.get("data", {}).get("text/plain", "")
                 for out in cell.outputs]
        texts.append("".join(parts))
    return texts


def printed_calibrations(nb) -> list[tuple[float, float]]:
    """Every calibration of this machine printed in the outputs, as (GFLOP/s, GB/s)."""
    found = []
    for text in cell_texts(nb):
        found += [(float(f) * 1e3, float(b)) for f, b in CALIBRATION_TFLOPS.findall(text)]
        found += [(float(f), float(b)) for f, b in CALIBRATION_GFLOPS.findall(text)]
    return found


def same_calibration(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Equal up to the rounding of the printed digits (3 significant figures at worst)."""
    return all(abs(x - y) <= 0.005 * max(x, y) for x, y in zip(a, b))


def floor_problems(nb) -> list[str]:
    """Measured times shown below their roofline floor (ratio < 1) without an explanation."""
    problems = []
    for i, text in enumerate(cell_texts(nb)):
        if "floor" not in text or BEATEN_EXPLAINED in text:
            continue
        for line in text.splitlines():
            beaten = [r for r in RATIO.findall(line) if float(r) < 1]
            if beaten:
                problems.append(f"code cell {i}: measured / floor {beaten} without saying why: {line.strip()}")
    return problems


def test_one_calibration_printed():
    seen = {}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        uses = any("get_hardware(" in cell.source for cell in nb.cells if cell.cell_type == "code")
        cals = printed_calibrations(nb)
        if uses:
            assert cals, f"{path.name} uses get_hardware() but never prints the calibration: print(hw)"
        seen.update({f"{path.name} #{k}": c for k, c in enumerate(cals)})
    first_name, first = next(iter(seen.items()))
    different = {name: c for name, c in seen.items() if not same_calibration(c, first)}
    assert not different, (f"notebooks print different calibrations: {first_name} {first} vs {different}; "
                           "run `minillm calibrate` once on a quiet machine, then re-execute all notebooks")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_floor_beaten_silently(path):
    assert floor_problems(nbformat.read(path, as_version=4)) == [], path.name


def test_calibration_and_floor_checks_find_problems():
    v4 = nbformat.v4

    def notebook(*texts):
        return v4.new_notebook(cells=[v4.new_code_cell("", execution_count=i + 1,
                                                       outputs=[v4.new_output("stream", name="stdout", text=t)])
                                      for i, t in enumerate(texts)])

    nb = notebook("cpu (AMD EPYC): 0.187 TFLOP/s, 32.73 GB/s, ridge 5.7 FLOP/byte\n",
                  "cpu (AMD EPYC): peak 186.6 GFLOP/s, 32.7 GB/s, ridge point 5.7 FLOP/byte\n")
    a, b = printed_calibrations(nb)
    assert a == pytest.approx((187.0, 32.73)) and b == (186.6, 32.7) and same_calibration(a, b)
    assert not same_calibration((84.8, 20.76), (186.6, 32.7))
    assert floor_problems(notebook("measured / floor = 0.7× for prefill, 1.6× for decode\n")) == [
        "code cell 0: measured / floor ['0.7'] without saying why: measured / floor = 0.7× for prefill, 1.6× for decode"]
    assert floor_problems(notebook("measured 293 ms is 2.94x the floor\n", "prefill 1 0.50 39.4 2.4x memory-bound floor\n")) == []
    assert floor_problems(notebook("measured 30 ms is 0.80x the floor (faster than the floor: ...)\n")) == []
    assert floor_problems(notebook("a cell about tokens: 0.5x the cost\n")) == []          # no "floor": not a roofline ratio


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, smollm2_dir, monkeypatch):
    from minillm.formats import weights

    # The kernel inherits this environment: the same weights folder as the tests use
    # (smollm2_dir has made sure the default model is there), plots rendered inline.
    monkeypatch.setenv("MINILLM_WEIGHTS", str(weights.weights_dir()))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    # kernel_name "python3" with argv "python": jupyter_client starts it with this
    # interpreter (sys.executable), so the kernel sees the same minillm and torch.
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{path.name} failed:\n{error}", pytrace=False)
