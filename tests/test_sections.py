"""The one table of sections (sections.SECTIONS): the command line, the receipt runner, the notebooks and the
markdown renderer all read it, and a parameter is accepted by every entry point or by none."""
from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import papermill
import pytest

from exactness.receipt import runner as receipt
from exactness.receipt import render
from exactness.receipt.cli import SUBCOMMANDS, section_parameters
from exactness.receipt.params import Common, ParamError
from exactness.receipt.profiles import PROFILES, Profile, get_profile
from exactness.receipt.runner import ReceiptError
from exactness.receipt.sections import SECTIONS, section_of

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
RUNNER_ONLY = {"out_json", "precomputed_json"}   # set by the runner, never by a user


def declared(section) -> dict:
    """name -> default value of the section's notebook parameters cell."""
    info = papermill.inspect_notebook(str(NOTEBOOKS / f"{section.notebook}.ipynb"))
    return {k: ast.literal_eval(v["default"]) for k, v in info.items()}


def code_of(section) -> str:
    nb = json.loads((NOTEBOOKS / f"{section.notebook}.ipynb").read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
                     and "parameters" not in c["metadata"].get("tags", []))


def test_the_table_drives_the_runner_the_cli_and_the_renderer():
    nbs = [s.notebook for s in SECTIONS.values() if s.runs_on == "reference"]
    assert all(receipt.run_notebooks(p) == nbs for p in PROFILES)
    for kind, key in (("engines", "engine"), ("dumps", "dumps")):
        assert receipt.run_kinds({key: "x"}) == {kind}
        assert receipt.run_notebooks("ci", {kind}) == [s.notebook for s in SECTIONS.values() if s.runs_on == kind]
    assert all(section_of(s.notebook) == s.name for s in SECTIONS.values()) and section_of("fixture") == "fixture"
    for s in SECTIONS.values():
        assert s.name in SUBCOMMANDS and SUBCOMMANDS[s.name].help == s.help
        mod = s.load()
        assert callable(mod.run_section) and callable(mod.render_md)
        assert callable(getattr(mod, "merge_sections", None)) == s.mergeable
        assert (NOTEBOOKS / f"{s.notebook}.ipynb").is_file()
    assert not render.RENDERERS.keys() & SECTIONS.keys()


@pytest.mark.parametrize("name", list(SECTIONS))
def test_every_section_parameter_is_accepted_by_every_entry_point(name):
    """Each parameter a section takes is declared by its notebook, passed on by the notebook to the section, and
    accepted by the section's subcommand and by the receipt runner, with the notebook's default as the value."""
    s = SECTIONS[name]
    defaults = declared(s)
    profile = get_profile("ci").parameters()
    code = code_of(s)
    for p in s.params:
        assert p in defaults, f"{s.notebook} does not declare {p}"
        assert f"{p}={p}" in code, f"{s.notebook} does not pass {p} to its section"
        value = json.dumps(defaults[p])
        assert section_parameters("ci", [f"{p}={value}"], s.params, [name])[p] == defaults[p]
        per_nb = receipt.plan_parameters(profile, {p: defaults[p]},
                                         {s.notebook: set(defaults) | RUNNER_ONLY})
        assert per_nb[s.notebook][p] == defaults[p]
    stray = set(defaults) - set(s.params) - set(profile) - RUNNER_ONLY
    assert stray == set(), f"{s.notebook} declares parameters that no entry point accepts: {stray}"


@pytest.mark.parametrize("name", list(SECTIONS))
def test_a_name_no_section_takes_is_refused_by_every_entry_point(name):
    s = SECTIONS[name]
    with pytest.raises(ReceiptError, match="unknown parameter 'bogus'"):
        section_parameters("ci", ["bogus=1"], s.params, [name])
    with pytest.raises(ReceiptError, match="unknown parameter 'bogus'"):
        receipt.plan_parameters(get_profile("ci").parameters(), {"bogus": 1},
                                {s.notebook: set(declared(s)) | RUNNER_ONLY})


def test_the_parameter_names_are_the_fields_of_the_typed_parameters():
    """Each section's names are its params class's fields beyond Common; the profile's fields are Common's and
    every extra a profile sets is a field of some section."""
    common = {f.name for f in dataclasses.fields(Common)}
    assert {f.name for f in dataclasses.fields(Profile)} - {"name", "extra", "side_by_side"} | {"profile"} == common
    for s in SECTIONS.values():
        assert issubclass(s.params_class, Common) and s.params_class.SECTION == s.name
        assert set(s.params) == s.params_class.names() - common
    for prof in PROFILES.values():
        for key, _ in prof.extra:
            assert any(key in s.params for s in SECTIONS.values()), (prof.name, key)


@pytest.mark.parametrize("name", list(SECTIONS))
def test_the_typed_parameters_are_frozen_and_refuse_unknown_names(name):
    cls = SECTIONS[name].params_class
    p = cls.from_dict(get_profile("ci").parameters())   # another section's names are left to it
    assert cls.from_dict(p) is p
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.preset = "small"
    with pytest.raises(ParamError, match=f"unknown parameter 'bogus' for section {name}; allowed: .*deep_threshold"):
        cls.from_dict({**get_profile("ci").parameters(), "bogus": 1})


@pytest.mark.parametrize("name, param, match", [
    ("bench", "bench_path=fastest", "bench_path 'fastest' is not a path; allowed: decode, batched, deep"),
    ("bench", "bench_reps=0", "bench_reps must be an int >= 1, got 0"),
    ("streams", "drafts=[eagle]", "unknown draft sources \\['eagle'\\]; allowed: mtp, self"),
    ("hashes", "hash_offload_paths=[prefill]", "hash_offload_paths must be a non-empty list"),
    ("fp64", "fp64_rows=0", "fp64_rows and fp64_cert must be >= 1, got 0, "),
])
def test_a_bad_section_value_is_refused_by_every_entry_point_before_it_runs(name, param, match):
    s = SECTIONS[name]
    with pytest.raises(ReceiptError, match=f"{name}: {match}"):
        section_parameters("ci", [param], s.params, [name])
    key, value = receipt.parse_overrides([param]).popitem()
    with pytest.raises(ReceiptError, match=f"{name}: {match}"):
        receipt.plan_parameters(get_profile("ci").parameters(), {key: value},
                                {s.notebook: set(declared(s)) | RUNNER_ONLY})
    with pytest.raises(ValueError, match=match):
        s.params_class.from_dict({**get_profile("ci").parameters(), key: value})


def test_a_new_section_is_one_table_entry(monkeypatch, tmp_path, capsys):
    """A section added to the table alone (module, notebook and params class in tests/fixtures) is run by the
    receipt runner, stored as computed, rendered, offered as a subcommand and has its parameters checked by every
    entry point."""
    from exactness.receipt.cli import analysis_command
    from exactness.receipt.sections import Section
    fixtures = Path(__file__).parent / "fixtures"
    monkeypatch.syspath_prepend(str(fixtures))
    from toy_section import ToyParams
    monkeypatch.setitem(SECTIONS, "toy", Section("toy", "toy_section", "70_toy", "a toy section", ToyParams))
    monkeypatch.setattr(receipt, "DEFAULT_NOTEBOOKS_DIR", fixtures)
    monkeypatch.setenv("PYTHONPATH", f"{fixtures}:{__import__('os').environ.get('PYTHONPATH', '')}")
    res = receipt.run_receipts("ci", tmp_path / "r", {"toy_rows": 2}, sections=["toy"])
    data = json.loads((res.folder / "receipt.json").read_text())
    gen = get_profile("ci").gen_tokens   # the profile's value reaches the new section's notebook
    assert res.status == "ok" and data["sections"] == {"toy": {"section": "toy", "rows": [
        {"i": 0, "tokens": gen}, {"i": 1, "tokens": gen}]}}
    assert "## Toy section\n\n2 toy rows." in (res.folder / "receipt.md").read_text()
    with pytest.raises(ReceiptError, match="toy: toy_rows must be an int >= 1, got 0"):
        receipt.run_receipts("ci", tmp_path / "r2", {"toy_rows": 0}, sections=["toy"])
    with pytest.raises(ReceiptError, match="toy: toy_rows must be an int >= 1, got 0"):
        section_parameters("ci", ["toy_rows=0"], SECTIONS["toy"].params, ["toy"])
    cmd = analysis_command(SECTIONS["toy"])
    assert cmd.help == "a toy section"
    args = type("A", (), {"profile": "ci", "param": ["toy_rows=4"], "out": str(tmp_path / "toy.json")})()
    assert cmd.handler(args) == 0
    assert len(json.loads((tmp_path / "toy.json").read_text())["rows"]) == 4
