"""One parameter source: a section's notebook takes one ``params`` mapping and types it with the section's params
class, so for every profile the notebook runs the very parameters ``python -m exactness <section> --profile P``
runs, defaults and derived values included; no notebook holds a default of its own."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from exactness.receipt.cli import section_parameters
from exactness.receipt.overrides import declared_parameters, plan_parameters
from exactness.profiles import PROFILES, get_profile
from exactness.receipt.sections import SECTIONS

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = [s.notebook for s in SECTIONS.values()]


@pytest.fixture(scope="module")
def declared():
    return declared_parameters(NOTEBOOKS, NAMES)


def cells(notebook: str) -> tuple[str, str]:
    """(the parameters cell, the cell that types ``params``) of a notebook, as source."""
    nb = json.loads((NOTEBOOKS / f"{notebook}.ipynb").read_text())
    code = [("".join(c["source"]), c["metadata"].get("tags", [])) for c in nb["cells"] if c["cell_type"] == "code"]
    params = next(src for src, tags in code if "parameters" in tags)
    typing = next(src for src, _ in code if "notebook_params(" in src)
    return params, typing


def notebook_run(notebook: str, injected: dict):
    """The typed parameters the notebook computes with: its parameters cell, papermill's injected values, then its
    cell that types ``params`` (the analysis imports included)."""
    params_cell, typing = cells(notebook)
    ns: dict = {}
    exec(params_cell, ns)
    ns.update(injected)
    exec(typing, ns)
    return ns["p"]


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("name", list(SECTIONS))
def test_the_notebook_and_the_command_line_run_the_same_parameters(declared, profile, name):
    s = SECTIONS[name]
    injected = plan_parameters(get_profile(profile).parameters(), {}, declared)[s.notebook]
    assert set(injected) == {"params"}
    cli = s.typed(section_parameters(profile, [], s.params, [name]))
    assert notebook_run(s.notebook, injected) == cli


@pytest.mark.parametrize("name", list(SECTIONS))
def test_a_notebook_alone_runs_the_default_profile(name):
    """Run without the runner (``params = {}``), a notebook computes what the subcommand's default profile does."""
    s = SECTIONS[name]
    assert notebook_run(s.notebook, {}) == s.typed(section_parameters("standard", [], s.params, [name]))


def test_ci_streams_prompt_length_is_derived_in_both(declared):
    base = get_profile("ci").parameters()
    assert "stream_prompt_tokens" not in base and base["prompt_max_tokens"] == 300
    plan = plan_parameters(base, {}, declared)["40_streams"]
    assert notebook_run("40_streams", plan).stream_prompt_tokens == 75                             # 300 // 4
    over = plan_parameters(base, {"stream_prompt_tokens": 40}, declared)["40_streams"]
    assert notebook_run("40_streams", over).stream_prompt_tokens == 40                             # an override wins


def test_a_notebook_refuses_a_bad_mapping():
    from exactness.params import ParamError

    with pytest.raises(ParamError, match="params must be a mapping"):
        notebook_run("10_output_hashes", {"params": ["gen_tokens", 8]})
    with pytest.raises(ParamError, match="unknown parameter 'bogus'"):
        notebook_run("10_output_hashes", {"params": {"bogus": 1}})
