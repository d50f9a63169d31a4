"""One view per section (blocks.py): what a section's notebook shows (blocks.show) and what receipt.md writes
(its renderer) are the same blocks — the same headings, texts and table cells, in the same order; plots are drawn in
the notebook and named in receipt.md."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest

from exactness import blocks
from exactness.receipt.diff import section
from exactness.receipt.sections import SECTIONS
from exactness.tables import Table

matplotlib.use("Agg")
GPU = Path(__file__).resolve().parents[1] / "receipts" / "gpu" / "receipt.json"


@pytest.fixture(scope="module")
def receipt() -> dict:
    return json.loads(GPU.read_text(encoding="utf-8"))


def _shown(monkeypatch, view: list) -> list[str]:
    """What blocks.show displays, each item as markdown (a Table as its markdown, a figure as "<figure>")."""
    seen = []

    def display(obj):
        seen.append(obj.to_markdown() if isinstance(obj, Table) else getattr(obj, "data", None) or "<figure>")
    monkeypatch.setattr("IPython.display.display", display)
    blocks.show(view)
    return seen


@pytest.mark.parametrize("name", ["hashes", "contract", "fp64", "streams", "bench"])
def test_the_notebook_shows_what_receipt_md_writes(monkeypatch, receipt, name):
    obj = section(receipt, name)
    view = SECTIONS[name].view()(obj)
    assert view and all(isinstance(b, blocks.Block) for b in view)
    shown = _shown(monkeypatch, view)
    md = SECTIONS[name].renderer()(obj)
    plots = [b for b in view if b.plot is not None]
    assert shown.count("<figure>") == len(plots)
    assert [s for s in shown if s != "<figure>"] == [blocks.to_markdown([b]) for b in view if b.plot is None
                                                        and (b.text or b.table is not None)]
    assert md.rstrip("\n") == blocks.to_markdown(view)          # receipt.md: the same blocks, in order
    assert all(f"_Plot: {b.text}" in md for b in plots)


def test_a_block_renders_each_kind_once():
    t = Table([{"a": 1, "b": None}], {"a": "A", "b": "B"})
    view = [blocks.heading("Title"), blocks.text("one", "", "two"), blocks.table(t),
            blocks.plot(lambda: None, "a curve")]
    assert blocks.to_markdown(view) == ("## Title\n\none\n\ntwo\n\n" + t.to_markdown()
                                        + "\n\n_Plot: a curve (in receipt.html and the notebook)._")
    assert blocks.to_markdown([blocks.heading("Part", 3)]) == "### Part"
