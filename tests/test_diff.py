"""The receipt diff (exactness.receipt.diff): a receipt against itself moves nothing; each planted edit is reported exactly,
and only it; receipts that do not match are named not comparable; a planted fault kernel set moves exactly the rows
whose fields it changed."""
import copy
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from faults import row0_rmsnorm_perturbed

from exactness.receipt import diff
from exactness.receipt.diff_md import render
from exactness.kernels import KERNEL_SETS

REAL = Path(__file__).resolve().parents[1] / "receipts" / "gpu" / "receipt.json"
SECTIONS = ("hashes", "contract", "fp64", "streams", "bench")


@pytest.fixture(scope="module")
def flat():
    """A real receipt of schema 1 (each section's rows or data under its name, the rest under <name>_extra)."""
    return json.loads(REAL.read_text())


@pytest.fixture
def receipt(flat):
    """The same receipt in schema 2: every section object under ``sections``."""
    out = {k: v for k, v in flat.items() if k.split("_extra")[0] not in SECTIONS}
    out["schema"], out["sections"] = 2, {n: copy.deepcopy(diff.section(flat, n)) for n in SECTIONS}
    return out


def _secs(r):
    return r["sections"]


def _edited(receipt, edit):
    pr = copy.deepcopy(receipt)
    edit(pr)
    return diff.diff_receipts(receipt, pr)


def _reported(result) -> list[tuple]:
    """Everything the diff reports, as comparable tuples."""
    return ([("change", c["section"], c["what"], c["field"], c["base"], c["pr"]) for c in result["changes"]]
            + [(side, c["section"], c["what"]) for side in ("only_base", "only_pr") for c in result[side]]
            + [("not_comparable", c["section"], c["what"], c["why"]) for c in result["not_comparable"]])


def test_both_layouts_give_the_same_section_objects(flat, receipt):
    for name in SECTIONS:
        assert diff.section(flat, name) == diff.section(receipt, name)
        assert diff.section(flat, name)["section"] == name
    assert diff.section({"schema": 2, "sections": {}}, "hashes") is None


@pytest.mark.parametrize("layout", ["flat", "receipt"])
def test_a_receipt_against_itself_moves_nothing(layout, request):
    r = request.getfixturevalue(layout)
    result = diff.diff_receipts(r, copy.deepcopy(r))
    assert _reported(result) == [] and not result["moved"]
    assert set(result["compared"]) == set(SECTIONS) and all(result["compared"].values())
    assert result["within_spread"] > 0   # bench figures with repeats were judged, not skipped
    assert "**Nothing moved.**" in render(result)


def _hash_row(r, path="batched"):
    return next(x for x in _secs(r)["hashes"]["rows"] if x["path"] == path and not x["offload"])


def test_a_moved_token_hash_is_reported_with_its_engine_prompt_and_configuration(receipt):
    row = _hash_row(receipt)
    result = _edited(receipt, lambda pr: _hash_row(pr).update(hash="0123456789ab"))
    what = f"reference · {row['prompt']} · {row['kernels']} batched@{row['step']}"
    assert _reported(result) == [("change", "hashes", what, "hash", row["hash"], "0123456789ab")]
    md = render(result)
    assert f"{row['prompt']}: {row['hash']} → 0123456789ab" in md and "**Moved: 1 change(s)" in md


@pytest.mark.parametrize("field,words", [("equals_oracle", "tokens: stopped equalling its oracle"),
                                         ("prompt_logits_equal", "prompt logits: stopped equalling its oracle"),
                                         ("kv_equal", "KV cache: stopped equalling its oracle")])
def test_each_oracle_equality_that_flips_is_reported_separately(receipt, field, words):
    i = next(i for i, x in enumerate(_secs(receipt)["hashes"]["rows"]) if x[field] is True and x["path"] != "decode")
    flipped = copy.deepcopy(receipt)
    _secs(flipped)["hashes"]["rows"][i][field] = False
    result = diff.diff_receipts(receipt, flipped)
    assert [(c[0], c[3], c[4], c[5]) for c in _reported(result)] == [("change", field, True, False)]
    assert words in render(result)
    assert words.replace("stopped", "started") in render(diff.diff_receipts(flipped, receipt))


def test_a_contract_count_change_is_reported(receipt):
    row = _secs(receipt)["contract"]["rows"][3]
    result = _edited(receipt, lambda pr: _secs(pr)["contract"]["rows"][3].update(mismatches=row["mismatches"] + 7))
    what = f"{row['set']} {row['class']} {row['dtype']} {row['device']}"
    assert _reported(result) == [("change", "contract", what, "mismatches", row["mismatches"], row["mismatches"] + 7)]
    assert "## Contract pairs whose mismatch count changed" in render(result)


def test_an_fp64_verdict_change_is_reported(receipt):
    i, row = next((i, x) for i, x in enumerate(_secs(receipt)["fp64"]["rows"]) if x["verdict"] == "within bound")
    result = _edited(receipt, lambda pr: _secs(pr)["fp64"]["rows"][i].update(verdict="outside bound"))
    assert [(c[0], c[1], c[3], c[4], c[5]) for c in _reported(result)] == [
        ("change", "fp64", "verdict", "within bound", "outside bound")]
    assert f"K={row['K']}" in result["changes"][0]["what"]


def test_a_stream_equality_that_fails_is_reported(receipt):
    i, row = next((i, x) for i, x in enumerate(_secs(receipt)["streams"]["data"]["resumed"]) if x["equal"] is True)
    result = _edited(receipt, lambda pr: _secs(pr)["streams"]["data"]["resumed"][i].update(equal=False))
    assert [(c[0], c[1], c[3], c[4], c[5]) for c in _reported(result)] == [("change", "streams", "equal", True, False)]
    assert result["changes"][0]["what"].startswith(f"resumed · set={row['set']} prompt={row['prompt']}")
    assert "equal: stopped holding" in render(result)


def _itl(r):
    return _secs(r)["bench"]["data"]["itl"][0]


def _scale_decode(factor):
    return lambda pr: [run.update(decode_tps=run["decode_tps"] * factor) for run in _itl(pr)["runs"]]


def test_a_bench_figure_beyond_its_spread_is_reported_and_one_within_it_is_not(receipt):
    vals = [run["decode_tps"] for run in _itl(receipt)["runs"]]
    spread = max(vals) - min(vals)
    result = _edited(receipt, _scale_decode(2.0))
    assert [(c[0], c[1], c[3]) for c in _reported(result)] == [("change", "bench", "decode_tps")]
    c = result["changes"][0]
    assert c["spread"] == pytest.approx(max(spread, 2 * spread)) and "ITL repetitions" in c["spread_of"]
    assert result["speed_moved"] == 1 and result["moved"] is False   # speed is listed, not an exactness move
    # negative control: a shift smaller than the spread is not a move
    small = _edited(receipt, lambda pr: [run.update(decode_tps=run["decode_tps"] + spread / 4)
                                         for run in _itl(pr)["runs"]])
    assert _reported(small) == [] and small["within_spread"] == result["within_spread"] + 1


def test_figures_without_a_spread_are_named_not_judged(receipt):
    result = _edited(receipt, lambda pr: _secs(pr)["bench"]["data"]["plain"][0]["runs"][1].update(ttft_s=99.0))
    assert _reported(result) == []
    nj = [c for c in result["not_judged"] if c["what"].startswith("plain · ") and c["field"] == "ttft_s"]
    assert nj and all("BASE has 1, PR has 1 warm repeats" in c["why"] for c in nj)
    assert "## Not judged" in render(result)


@pytest.mark.parametrize("edit,why", [
    (lambda pr: pr.update(profile="other"), lambda r: f"profile {r['profile']!r} vs 'other'"),
    (lambda pr: pr["parameters"].update(preset="other"),
     lambda r: f"weights differ: preset {r['parameters']['preset']!r} vs 'other'"),
    (lambda pr: pr.update(weights={"sha256": "ab" * 32}), lambda r: "weights differ: checkpoint_sha256 None vs"),
])
def test_receipts_of_other_profiles_or_weights_are_not_compared_and_say_why(receipt, edit, why):
    result, why = _edited(receipt, edit), why(receipt)
    assert result["changes"] == [] and result["compared"] == {} and result["moved"]
    assert [(c["section"], c["what"]) for c in result["not_comparable"]] == [(s, "the whole section") for s in SECTIONS]
    assert all(c["why"].startswith(why) for c in result["not_comparable"])
    assert "not comparable: " + why in render(result)


def test_bench_timed_on_another_device_is_not_compared_and_the_rest_is(receipt):
    result = _edited(receipt, lambda pr: pr["env"].update(device="another GPU"))
    assert _reported(result) == [("not_comparable", "bench", "every figure",
                                  f"timed on different devices: {receipt['env']['device']!r} vs 'another GPU'")]
    assert set(result["compared"]) == set(SECTIONS) - {"bench"}


def test_rows_of_one_receipt_only_and_rows_of_other_inputs_are_listed(receipt):
    rows = _secs(receipt)["hashes"]["rows"]
    gone, other = rows[1], rows[2]

    def edit(pr):
        _secs(pr)["hashes"]["rows"].pop(1)
        _secs(pr)["hashes"]["rows"][1]["gen_tokens"] = other["gen_tokens"] + 1
        del _secs(pr)["streams"]
    result = _edited(receipt, edit)
    label = lambda r: f"reference · {r['prompt']} · {diff.configuration(r)}"  # noqa: E731
    assert _reported(result) == [
        ("only_base", "hashes", label(gone)), ("only_base", "streams", "the whole section"),
        ("not_comparable", "hashes", label(other), f"gen_tokens {other['gen_tokens']} vs {other['gen_tokens'] + 1}")]


def test_a_section_the_diff_cannot_compare_is_named_not_dropped(receipt):
    receipt["sections"]["novel"] = {"section": "novel", "rows": []}
    result = diff.diff_receipts(receipt, copy.deepcopy(receipt))
    assert _reported(result) == [("not_comparable", "novel", "the whole section",
                                  "the diff has no comparison for this section")]


def test_engines_whose_identity_differs_are_not_compared_and_a_version_bump_is_only_context(receipt):
    _secs(receipt)["hashes"]["engines"] = [{"spec": "reference", "kind": "reference", "version": "1",
                                            "model": {"sha256": "aa"}}]
    n = len(_secs(receipt)["hashes"]["rows"])
    other = _edited(receipt, lambda pr: _secs(pr)["hashes"]["engines"][0]["model"].update(sha256="bb"))
    assert [c["why"] for c in other["not_comparable"]] == ["engine reference differs in model"] * n
    assert other["changes"] == [] and not other["compared"]["hashes"]
    bumped = _edited(receipt, lambda pr: _secs(pr)["hashes"]["engines"][0].update(version="2"))
    assert _reported(bumped) == [] and bumped["compared"]["hashes"] == n
    assert {"what": "engine reference: version", "base": "1", "pr": "2"} in bumped["context"]


# -------------------------------------------------------------------------------------------- command line

def test_exit_status_outputs_and_bad_input(receipt, tmp_path, capsys):
    from exactness.receipt.cli import main as cli

    base, pr = tmp_path / "base", tmp_path / "pr.json"
    base.mkdir()
    (base / "receipt.json").write_text(json.dumps(receipt))
    moved = copy.deepcopy(receipt)
    _hash_row(moved).update(hash="0123456789ab")
    pr.write_text(json.dumps(moved))
    assert cli(["diff", str(base), str(base)]) == 0
    out = tmp_path / "out"
    assert cli(["diff", str(base), str(pr), "--out", str(out)]) == 1
    md = (out / "diff.md").read_text()
    assert md in capsys.readouterr().out and json.loads((out / "diff.json").read_text())["moved"] is True
    assert cli(["diff", str(base), str(pr), "--out", str(out)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err and (out / "diff.md").read_text() == md
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[]")
    for bad, msg in ((tmp_path / "missing", "no receipt at"), (tmp_path / "bad.json", "cannot read"),
                     (tmp_path / "list.json", "is not a receipt")):
        assert cli(["diff", str(base), str(bad)]) == 2
        assert msg in capsys.readouterr().err


# -------------------------------------------------------------------------------- a real pair, planted fault

FIELDS = ("hash", "equals_oracle", "prompt_logits_equal", "gen_logits_equal", "kv_equal")


def _one_section_receipt(section: dict, params: dict) -> dict:
    return {"schema": 2, "status": "ok", "profile": "ci", "parameters": params, "env": {"device": "cpu"},
            "sections": {section["section"]: section}}


def _labelled_rows(section: dict) -> dict[str, dict]:
    """label the diff gives -> row, for the rows of a hashes section, of our engine or run on engines (its stream rows
    included)."""
    if "engines" not in section:
        return {f"reference · {r['prompt']} · {r['kernels']} {r['path']}" + (f"@{r['step']}" if r["step"] else ""): r
                for r in section["rows"]}
    out = {f"{r['engine']} · {r['prompt']} · {r['config']}": r for r in section["rows"]}
    out.update({f"{e} · {r['check']} · {r['prompt']} · {r['config']}": r for e, checks in section["streams"].items()
                for part in ("drafted", "resumed", "concurrent") for r in checks[part]})
    return out


@pytest.mark.parametrize("name", ["ours", "engines"])
def test_a_planted_fault_kernel_set_moves_exactly_what_it_changed(monkeypatch, name):
    """Two sections computed here, the second with the invariant set's RMSNorm one ulp off on row 0 of every
    multi-row call (registered under the same name): the diff names exactly the fields that differ, and the fault
    is seen (prompt logits of a multi-row prefill stop equalling the oracle's)."""
    from exactness.receipt.sections import SECTIONS as TABLE

    run_section = TABLE["hashes"].load().run_section
    params = {"preset": "tiny", "device": "cpu", "dtype": "bfloat16", "prompts": ["short"], "prompt_max_tokens": 12,
              "steps": [5], "gen_tokens": 4, "deep_threshold": 4, "kernel_sets": ["invariant"]}
    params.update({"hash_rerun": False} if name == "ours" else {"engine": ["reference"]})
    base = run_section(params)
    with monkeypatch.context() as m:
        m.setitem(KERNEL_SETS, "invariant", replace(row0_rmsnorm_perturbed(), name="invariant"))
        faulted = run_section(params)
    result = diff.diff_receipts(_one_section_receipt(base, params), _one_section_receipt(faulted, params))
    b, p = _labelled_rows(base), _labelled_rows(faulted)
    assert set(b) == set(p) and sum(result["compared"].values()) == len(b)
    want = sorted((what, f, b[what].get(f), p[what].get(f)) for what in b for f in FIELDS
                  if b[what].get(f) != p[what].get(f))
    got = sorted((c["what"], c["field"], c["base"], c["pr"]) for c in result["changes"])
    assert got == want
    assert any(f == "prompt_logits_equal" and (x, y) == (True, False) for _, f, x, y in got)   # the fault acts
    assert result["only_base"] == result["only_pr"] == result["not_comparable"] == []


def test_folders_of_section_jsons_compare_like_receipts(receipt, tmp_path):
    """``exactness sections --out DIR`` folders (one JSON per section, env.json) are diffed as receipts."""
    for side in ("base", "pr"):
        (tmp_path / side).mkdir()
        (tmp_path / side / "env.json").write_text(json.dumps(receipt.get("env") or {}))
    moved = copy.deepcopy(receipt)
    _hash_row(moved).update(hash="0123456789ab")
    for name in receipt["sections"]:
        (tmp_path / "base" / f"{name}.json").write_text(json.dumps(diff.section(receipt, name)))
        (tmp_path / "pr" / f"{name}.json").write_text(json.dumps(diff.section(moved, name)))
    base, pr = diff.load_receipt(tmp_path / "base"), diff.load_receipt(tmp_path / "pr")
    assert not diff.diff_receipts(base, base)["moved"]
    result = diff.diff_receipts(base, pr)
    assert result["moved"] and [c["pr"] for c in result["changes"] if c["kind"] == "hash"] == ["0123456789ab"]


def test_a_check_only_pr_records_is_not_a_move_and_one_pr_drops_is(receipt):
    """A flag PR's rows add (BASE made no such check) is listed as not judged, nothing moved; a flag PR's rows drop
    is a change."""
    result = _edited(receipt, lambda pr: [r.update(new_equal=True) for r in _secs(pr)["hashes"]["rows"]])
    assert result["moved"] is False and result["changes"] == []
    added = [c for c in result["not_judged"] if c["section"] == "hashes"]
    assert {c["field"] for c in added} == {"new_equal"} and len(added) == len(_secs(receipt)["hashes"]["rows"])
    assert "| reference | new_equal | 54 | recorded by PR only" in re.sub(" +", " ", render(result))
    result = _edited(receipt, lambda pr: _secs(pr)["hashes"]["rows"][1].pop("kv_equal"))
    assert result["moved"] is True and [c["field"] for c in result["changes"]] == ["kv_equal"]


def test_a_matrix_of_our_engine_and_one_of_engines_are_not_compared(receipt):
    """A receipt of our engine's sections against one run on engines under test: the hash matrix is named not
    comparable with the reason, not listed row by row as in one receipt only."""
    result = _edited(receipt, lambda pr: _secs(pr)["hashes"].update(engines=[{"spec": "reference:fast"}]))
    assert result["moved"] is True and result["only_base"] == result["only_pr"] == []
    assert [(c["section"], c["why"]) for c in result["not_comparable"]] == \
        [("hashes", "BASE ran on our engine, PR on engines under test")]
