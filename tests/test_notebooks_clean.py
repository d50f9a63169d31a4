"""Notebooks are committed clean: no outputs, no execution counts, a kernelspec, and one ``parameters`` cell of
literals only (declaring ``out_json``, through which the receipt runner collects the notebook's section).

Strip a notebook with ``nbstripout notebooks/*.ipynb`` (it keeps cell tags).
"""
from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "tests" / "fixtures").glob("*.ipynb"))


def literal_assignments(source: str) -> dict:
    """``{name: value}`` of a parameters cell; raises ValueError on anything but ``name = <literal>`` statements."""
    out = {}
    for stmt in ast.parse(source).body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            raise ValueError(f"line {stmt.lineno}: not a plain `name = literal` assignment")
        out[stmt.targets[0].id] = ast.literal_eval(stmt.value)
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_is_stripped(path):
    nb = nbformat.read(str(path), as_version=4)
    assert nb.metadata.get("kernelspec", {}).get("name"), "set a kernelspec (papermill.inspect_notebook needs one)"
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code":
            assert c.outputs == [], f"cell {i} has outputs: run nbstripout {path.relative_to(ROOT)}"
            assert c.execution_count is None, f"cell {i} has an execution count: run nbstripout"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_has_one_literal_parameters_cell(path):
    nb = nbformat.read(str(path), as_version=4)
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"expected exactly one cell tagged 'parameters', found {len(cells)}"
    assert cells[0].cell_type == "code"
    params = literal_assignments(cells[0].source)
    assert "out_json" in params, "the receipt runner passes out_json: declare it"


def test_literal_assignments_rejects_code():
    assert literal_assignments("a = 1\nb = [1, 'x']  # comment\nc = None") == {"a": 1, "b": [1, "x"], "c": None}
    for bad in ("a = f(1)", "a, b = 1, 2", "import os", "a += 1", "a = b = 1"):
        with pytest.raises(ValueError):
            literal_assignments(bad)
