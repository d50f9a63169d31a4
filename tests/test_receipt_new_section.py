"""A new section is its analysis module, its notebook and one table entry: a toy section written here into tmp_path
(a module with its params class, ``run_section`` and its view ``blocks``, and a notebook) and registered with one
``Section`` is run by the receipt runner, stored as computed, summarised, rendered, compared by the diff, offered as
a subcommand, and has its parameters checked by every entry point."""
from __future__ import annotations

import copy
import json
import os
import textwrap

import nbformat
import pytest

from exactness.receipt import runner
from exactness.receipt.cli import analysis_command, section_parameters
from exactness.receipt.diff import diff_receipts
from exactness.profiles import get_profile
from exactness.receipt.runfolder import ReceiptError
from exactness.receipt.sections import SECTIONS, Section, Verdict

MODULE = '''
from dataclasses import dataclass
from typing import ClassVar

from exactness.params import Common, ParamError


@dataclass(frozen=True, kw_only=True)
class ToyParams(Common):
    SECTION: ClassVar[str] = "toy"
    NEEDS: ClassVar[tuple[str, ...]] = ("gen_tokens",)

    toy_rows: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.toy_rows, int) or self.toy_rows < 1:
            raise ParamError(f"toy_rows must be an int >= 1, got {self.toy_rows!r}")


def run_section(params) -> dict:
    p = ToyParams.from_dict(params)
    return {"section": "toy", "rows": [{"set": "fast", "i": i, "hash": f"{i:012x}", "equal": i % 2 == 0,
                                        "tokens": p.gen_tokens} for i in range(p.toy_rows)]}


def blocks(section: dict) -> list:
    from exactness.blocks import heading, text
    return [heading("Toy section"), text(f"{len(section['rows'])} toy rows.")]
'''

NOTEBOOK_CODE = '''import toy_section
from exactness.receipt.sections import save_section

p = toy_section.ToyParams.from_dict(params)
save_section(toy_section.run_section(p), out_json)'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy section's two files in tmp_path/toy and its one table entry; returns that folder."""
    folder = tmp_path / "toy"
    folder.mkdir()
    (folder / "toy_section.py").write_text(textwrap.dedent(MODULE))
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "exactness", "display_name": "Python (exactness)",
                                                           "language": "python"}})
    params = nbformat.v4.new_code_cell('params = {}\nout_json = ""\nprecomputed_json = ""')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(NOTEBOOK_CODE)]
    nbformat.write(nb, str(folder / "70_toy.ipynb"))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    from toy_section import ToyParams
    monkeypatch.setitem(SECTIONS, "toy", Section(
        "toy", "toy_section", "70_toy", "a toy section", ToyParams,
        summary=(Verdict("toy rows equal", lambda o: o.get("rows") or [], lambda r: r.get("equal")),),
        diff_keys=("set", "i")))
    monkeypatch.setattr(runner, "DEFAULT_NOTEBOOKS_DIR", folder)
    return folder


def test_a_new_section_is_one_table_entry(toy, tmp_path):
    res = runner.run_receipts("ci", tmp_path / "r", {"toy_rows": 2}, sections=["toy"])
    data = json.loads((res.folder / "receipt.json").read_text())
    gen = get_profile("ci").gen_tokens   # the profile's value reaches the new section's notebook
    assert res.status == "ok", data["errors"]
    assert [(r["i"], r["tokens"]) for r in data["sections"]["toy"]["rows"]] == [(0, gen), (1, gen)]
    md = (res.folder / "receipt.md").read_text()
    assert "## Toy section\n\n2 toy rows." in md
    assert "toy rows equal" in md and "| fast" in md and "1/2" in md      # its summary column

    same = diff_receipts(data, data)
    assert not same["moved"] and same["compared"] == {"toy": 2}
    moved = copy.deepcopy(data)
    moved["sections"]["toy"]["rows"][1]["hash"] = "ffffffffffff"
    changes = diff_receipts(data, moved)["changes"]
    assert [(c["section"], c["field"], c["pr"]) for c in changes] == [("toy", "hash", "ffffffffffff")]


def test_a_new_sections_parameters_are_checked_everywhere(toy, tmp_path):
    with pytest.raises(ReceiptError, match="toy: toy_rows must be an int >= 1, got 0"):
        runner.run_receipts("ci", tmp_path / "r2", {"toy_rows": 0}, sections=["toy"])
    with pytest.raises(ReceiptError, match="toy: toy_rows must be an int >= 1, got 0"):
        section_parameters("ci", ["toy_rows=0"], SECTIONS["toy"].params, ["toy"])
    with pytest.raises(ReceiptError, match="unknown parameter 'toy_cols'"):
        runner.run_receipts("ci", tmp_path / "r3", {"toy_cols": 1}, sections=["toy"])
    cmd = analysis_command(SECTIONS["toy"])
    assert cmd.help == "a toy section"
    args = type("A", (), {"profile": "ci", "param": ["toy_rows=4"], "out": str(tmp_path / "toy.json")})()
    assert cmd.handler(args) == 0
    assert len(json.loads((tmp_path / "toy.json").read_text())["rows"]) == 4
