"""The Colab notebooks in ``colab/``: stored without outputs, sized by a first parameter cell, and executed top
to bottom on CPU with ``SMALL = True`` (the CI-sized run) through nbclient; any error in any cell fails the test.

Each notebook runs in a fresh Jupyter kernel of this Python, in a temporary working directory (what a notebook
writes, e.g. ``runs/``, stays there). The injected cell ``SMALL = True`` follows the cell tagged ``parameters``,
as papermill injects parameters.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))

nbformat = pytest.importorskip("nbformat")


def _read(path: Path):
    return nbformat.read(path, as_version=4)


def _parameters_index(nb) -> int:
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert "parameters" in cell.metadata.get("tags", []), (
                "the first code cell must be the parameter cell, tagged 'parameters'")
            return i
    raise AssertionError("no code cell")


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    for expected in ("01_quickstart.ipynb", "02_compare_methods.ipynb", "03_train_less.ipynb", "04_kernels.ipynb"):
        assert expected in names, f"colab/{expected} is missing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_clean(path):
    """No outputs, no execution counts; a first code cell of parameters that defines SMALL and KVJAX_SOURCE (where
    the install cell installs kvjax from: kvjax has no public repository, so no Colab badge can open it); a first
    cell that says how to run it in Colab."""
    nb = _read(path)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.get("outputs"), f"{path.name} cell {i} has stored outputs: clear them"
            assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count: clear it"
    params = nb.cells[_parameters_index(nb)].source
    assert "SMALL" in params, f"{path.name}: the parameter cell must define SMALL"
    assert "KVJAX_SOURCE = " in params, f"{path.name}: the parameter cell must define KVJAX_SOURCE"
    first = nb.cells[0].source
    assert "In Colab: upload this notebook" in first and "KVJAX_SOURCE" in first, f"{path.name}: no Colab how-to"


#: the longest (2.5, 2 and 0.7 min) run in CI's second line (.ci/run), not the default run (docs/testing.md); 04's
#: kernels are checked against their references in tests/kernels_pallas
EXTENDED_NOTEBOOKS = ("02_compare_methods", "03_train_less", "04_kernels")


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.extended if p.stem in EXTENDED_NOTEBOOKS else ()) for p in NOTEBOOKS],
    ids=lambda p: p.stem,
)
def test_notebook_runs_small_on_cpu(path, tmp_path):
    nbclient = pytest.importorskip("nbclient")
    nb = _read(path)
    i = _parameters_index(nb)
    injected = nbformat.v4.new_code_cell("# Injected by tests/colab/test_notebooks.py\nSMALL = True")
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(i + 1, injected)
    env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg")
    # The kernel inherits the environment: put the repository first so an uninstalled checkout runs too.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    client.execute(env=env)
    print(f"{path.name}: executed in {time.perf_counter() - t0:.1f} s")
