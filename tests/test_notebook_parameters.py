"""One parameter source: a receipt's notebook receives, for every parameter it declares, the value the section's
command line computes from the same profile (defaults and derived values included), never its own cell's default."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from exactness.receipt.overrides import declared_parameters, plan_parameters
from exactness.receipt.profiles import PROFILES, get_profile
from exactness.receipt.sections import SECTIONS, section_of

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb") if section_of(p.stem) in SECTIONS)


@pytest.fixture(scope="module")
def declared():
    return declared_parameters(NOTEBOOKS, NAMES)


def _literal(v):
    return json.loads(json.dumps(list(v) if isinstance(v, tuple) else v))


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_notebook_gets_the_command_lines_values(declared, profile):
    base = get_profile(profile).parameters()
    plan = plan_parameters(base, {}, declared)
    for nb in NAMES:
        cls = SECTIONS[section_of(nb)].params_class
        typed = cls.from_dict({k: v for k, v in base.items() if k in cls.names()})
        mine = declared[nb] & cls.names()
        assert mine <= set(plan[nb]), (nb, sorted(mine - set(plan[nb])))   # no name left to the cell's default
        got = cls.from_dict({k: plan[nb][k] for k in mine})      # what the notebook's run_section computes with
        for k in mine:
            assert _literal(getattr(got, k)) == _literal(getattr(typed, k)), (profile, nb, k, getattr(got, k))


def test_ci_streams_prompt_length_is_derived_in_both(declared):
    base = get_profile("ci").parameters()
    assert "stream_prompt_tokens" not in base and base["prompt_max_tokens"] == 300
    assert plan_parameters(base, {}, declared)["40_streams"]["stream_prompt_tokens"] == 75        # 300 // 4
    over = plan_parameters(base, {"stream_prompt_tokens": 40}, declared)["40_streams"]
    assert over["stream_prompt_tokens"] == 40                                                      # an override wins
