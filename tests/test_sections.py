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
from exactness.params import Common, ParamError
from exactness.profiles import PROFILES, Profile, get_profile
from exactness.receipt.runner import ReceiptError
from exactness.receipt.sections import SECTIONS, section_of

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
RUNNER_ONLY = {"out_json", "precomputed_json", "params"}   # set by the runner, never by a user


def declared(section) -> dict:
    """name -> default value of the section's notebook parameters cell."""
    info = papermill.inspect_notebook(str(NOTEBOOKS / f"{section.notebook}.ipynb"))
    return {k: ast.literal_eval(v["default"]) for k, v in info.items()}


def code_of(section) -> str:
    nb = json.loads((NOTEBOOKS / f"{section.notebook}.ipynb").read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
                     and "parameters" not in c["metadata"].get("tags", []))


def test_the_table_drives_the_runner_the_cli_and_the_renderer():
    nbs = [s.notebook for s in SECTIONS.values() if "reference" in s.runs_on]
    assert all(receipt.run_notebooks(p) == nbs for p in PROFILES)
    for kind, key in (("engines", "engine"), ("dumps", "dumps")):
        assert receipt.run_kinds({key: "x"}) == {kind}
        assert receipt.run_notebooks("ci", {kind}) == [s.notebook for s in SECTIONS.values() if kind in s.runs_on]
    assert receipt.run_notebooks("ci", {"engines"}) == ["10_output_hashes"]   # one hash matrix, any engine
    assert all(section_of(s.notebook) == s.name for s in SECTIONS.values()) and section_of("fixture") == "fixture"
    for s in SECTIONS.values():
        assert s.name in SUBCOMMANDS and SUBCOMMANDS[s.name].help == s.help
        mod = s.load()
        assert callable(mod.run_section) and callable(s.renderer())
        assert callable(s.merger()) == s.mergeable
        for ref, fn in ((s.blocks, s.view()), (s.merge, s.merger())):
            assert not ref or fn.__module__ == ref.partition(":")[0], f"{s.name}: {ref} names a re-export"
        assert (NOTEBOOKS / f"{s.notebook}.ipynb").is_file()
    assert not render.RENDERERS.keys() & SECTIONS.keys()


def _literal(v):
    return json.loads(json.dumps(list(v) if isinstance(v, tuple) else v))


@pytest.mark.parametrize("name", list(SECTIONS))
def test_every_section_parameter_is_accepted_by_every_entry_point(name):
    """Each parameter a section takes is accepted by the section's subcommand and by the receipt runner, which hands
    it to the notebook in its one ``params`` mapping; the notebook declares nothing else."""
    s = SECTIONS[name]
    defaults = declared(s)
    assert defaults == {"params": {}, "out_json": "", "precomputed_json": ""}, s.notebook
    assert f'notebook_params("{name}", params)' in code_of(s), f"{s.notebook} does not type its params"
    profile = get_profile("ci").parameters()
    typed = s.typed(profile)
    for p in s.params:
        value = _literal(getattr(typed, p))
        assert section_parameters("ci", [f"{p}={json.dumps(value)}"], s.params, [name])[p] == value
        per_nb = receipt.plan_parameters(profile, {p: value}, {s.notebook: set(defaults)})
        assert per_nb[s.notebook] == {"params": {k: _literal(v) for k, v in {**profile, p: value}.items()
                                                 if k in s.params_class.names()}}


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


def test_the_tables_preflight_facts_agree_with_the_params_classes():
    """A section takes a checkpoint exactly when its params class has the field, and the parameters its entry names
    for generated tokens and prompt cuts are its own."""
    for s in SECTIONS.values():
        names = s.params_class.names()
        assert s.takes_checkpoint == ("checkpoint" in names), s.name
        assert set(s.generated_by) | set(s.cut_by) <= names, s.name
        assert not s.selected_by or s.selected_by in names, s.name
        assert (s.runs_on == ("reference",)) == (not s.selected_by) and bool(s.selected_kind) == bool(s.selected_by), s.name
