"""Every notebook runs top to bottom, so none can rot."""

from pathlib import Path

import pytest
from children import HANG_GUARD_S

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
  assert NOTEBOOKS


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
  notebook = nbformat.read(path, as_version=4)
  nbclient.NotebookClient(
    notebook, timeout=HANG_GUARD_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
  ).execute()
  errors = [
    out for cell in notebook.cells for out in cell.get("outputs", []) if out.get("output_type") == "error"
  ]
  assert not errors
  copies = [
    out
    for cell in notebook.cells
    for out in cell.get("outputs", [])
    if "TableCopyWarning" in out.get("text", "")
  ]
  assert not copies, "a notebook's jitted step copied a table: donate it"
