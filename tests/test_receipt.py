"""The receipt runner: atomic run folders, failures, validation, markdown and HTML rendering.

Runs the fixture notebooks in tests/fixtures/ through papermill with the registered ``exactness`` kernel
(``make setup`` registers it), the same path ``make receipts`` takes.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest
from exactness.receipt import runner as receipt
from exactness.receipt import env as env_module
from exactness.receipt import page as page_module
from exactness.receipt import render
from exactness.receipt.cli import main
from exactness.receipt.overrides import parse_overrides
from exactness.params import BenchParams
from exactness.profiles import get_profile
from exactness.receipt.runfolder import ReceiptError
from exactness.receipt.runner import add_section, run_receipts
from exactness.receipt.sections import SECTIONS

FIXTURES = Path(__file__).parent / "fixtures"


def run(out: Path, notebooks: list[str], params: list[str] | None = None, **kw) -> receipt.ReceiptRun:
    return run_receipts("ci", out, params or [], notebooks_dir=FIXTURES, notebooks=notebooks, **kw)


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name]


@pytest.fixture(scope="module")
def ok_run(tmp_path_factory) -> receipt.ReceiptRun:
    return run(tmp_path_factory.mktemp("ok") / "run", ["ok"], ["gen_tokens=8", "n_prompts=2"])


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory) -> receipt.ReceiptRun:
    return run(tmp_path_factory.mktemp("failed") / "run", ["ok", "boom"])


# ----------------------------------------------------------------------------------------------- a complete run

def test_ok_run_writes_complete_folder(ok_run):
    folder = ok_run.folder
    assert ok_run.status == "ok"
    names = {p.name for p in folder.iterdir()}
    assert {"receipt.json", "receipt.md", "receipt.html", "ok.ipynb", "sections"} <= names
    assert "FAILED" not in names
    assert leftovers(folder.parent) == []


def test_receipt_json_schema(ok_run):
    data = json.loads((ok_run.folder / "receipt.json").read_text())
    assert data["schema"] == 2 and data["status"] == "ok" and data["profile"] == "ci"
    assert data["errors"] == []
    assert data["parameters"]["gen_tokens"] == 8 and data["parameters"]["n_prompts"] == 2
    env = data["env"]
    for key in ("git", "python", "torch", "cuda", "device", "compute_capability", "numerics", "kernel_sets"):
        assert key in env
    assert {"sha", "dirty"} <= set(env["git"])
    section = data["sections"]["hashes"]
    rows = section["rows"]
    assert len(rows) == 2 * 2 * 5  # prompts x kernel sets x (decode + 2 batched + 2 deep)
    assert {r["gen_tokens"] for r in rows} == {8}
    assert section["note"] == "fixture"   # stored exactly as the notebook computed it


def test_notebook_gets_only_declared_parameters(ok_run):
    (entry,) = ok_run.receipt["notebooks"]
    assert "out_json" in entry["parameters"] and "steps" in entry["parameters"]
    assert "preset" not in entry["parameters"]  # a profile field the fixture does not declare


def test_markdown(ok_run):
    md = (ok_run.folder / "receipt.md").read_text()
    assert len(md) < 65_536
    assert md.startswith("# Exactness receipt: ci — ok")
    assert "| prompt " in md and "batched@100" in md and "deep@128" in md
    assert "bbbbbbbbbbbb ≠" in md and "aaaaaaaaaaaa " in md
    assert "Runs that differ from the oracle" in md and "deep path served nothing" in md
    assert "data:" not in md and "<img" not in md


def test_html_is_self_contained_without_code(ok_run):
    html = (ok_run.folder / "receipt.html").read_text()
    assert not re.search(r"<script[^>]*src=[\"']?(https?:)?//", html, re.IGNORECASE)
    assert "https://cdn" not in html
    assert "data:image/png;base64," in html  # the fixture's plot, inlined
    assert "json.dump" not in html  # code cells are excluded
    assert "parameters:" in html  # outputs are kept


def test_written_in_hidden_temporary_folder_then_renamed(tmp_path, monkeypatch):
    out, seen = tmp_path / "run", []
    real = receipt._execute

    def spy(nb, src, tmp, params, kernel_name, position=""):
        seen.append((out.exists(), tmp.parent == tmp_path, tmp.name.startswith(".run.tmp-"),
                     Path(params["out_json"]).parent == tmp / "sections"))
        return real(nb, src, tmp, params, kernel_name, position)

    monkeypatch.setattr(receipt, "_execute", spy)
    result = run(out, ["boom"])
    assert seen == [(False, True, True, True)]
    assert result.folder == out and (out / "receipt.json").is_file() and leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------------ a failed run

def test_failed_run_is_marked_and_shows_the_error(failed_run):
    folder = failed_run.folder
    assert failed_run.status == "failed"
    data = json.loads((folder / "receipt.json").read_text())
    assert data["status"] == "failed"
    (err,) = data["errors"]
    assert err["notebook"] == "boom" and err["ename"] == "ValueError" and "boom on purpose" in err["evalue"]
    assert err["cell"] is not None and any("boom on purpose" in line for line in err["traceback"])
    assert "hashes" in data["sections"]  # the notebook that worked still reports
    md = (folder / "receipt.md").read_text()
    assert md.startswith("# Exactness receipt: ci — FAILED")
    assert md.index("boom on purpose") < md.index("## Token hashes")
    html = (folder / "receipt.html").read_text()
    assert "FAILED" in html and "boom on purpose" in html
    assert (folder / "FAILED").read_text().startswith("boom: ValueError")
    assert leftovers(folder.parent) == []


def test_failed_run_exit_code(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(receipt, "DEFAULT_NOTEBOOKS_DIR", FIXTURES)
    monkeypatch.setattr(receipt, "run_notebooks", lambda *a: ["boom"])
    out = tmp_path / "run"
    assert main(["receipts", "--profile", "ci", "--out", str(out), "--param", "gen_tokens=3"]) == 1
    assert json.loads((out / "receipt.json").read_text())["status"] == "failed"
    assert capsys.readouterr().out.strip() == str(out)


# ------------------------------------------------------------------------------------- bad input, nothing written

def test_refuses_to_overwrite(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ReceiptError, match="already exists"):
        run(out, ["ok"])
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert leftovers(tmp_path) == []


def test_refuses_existing_empty_folder(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(ReceiptError, match="never overwritten"):
        run(tmp_path / "run", ["ok"])
    assert list((tmp_path / "run").iterdir()) == []


def test_unknown_profile(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"unknown profile 'nope'.*ci.*full.*gpu"):
        run_receipts("nope", tmp_path / "run")
    assert main(["receipts", "--profile", "nope", "--out", str(tmp_path / "run")]) == 2
    assert "unknown profile 'nope'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_unknown_parameter_fails_before_running(tmp_path, monkeypatch):
    monkeypatch.setattr(receipt, "_execute", lambda *a, **k: pytest.fail("a notebook ran"))
    with pytest.raises(ReceiptError, match=r"unknown parameter 'bogus'.*allowed: .*gen_tokens"):
        run(tmp_path / "run", ["ok", "boom"], ["gen_tokens=2", "bogus=1"])
    with pytest.raises(ReceiptError, match="unknown parameter 'out_json'"):
        run(tmp_path / "run", ["ok"], ["out_json=/tmp/x.json"])
    assert list(tmp_path.iterdir()) == []


def test_cli_unknown_parameter(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(receipt, "DEFAULT_NOTEBOOKS_DIR", FIXTURES)
    monkeypatch.setattr(receipt, "run_notebooks", lambda *a: ["ok"])
    assert main(["receipts", "--profile", "ci", "--out", str(tmp_path / "r"), "--param", "gen_tokenz=2"]) == 2
    err = capsys.readouterr().err
    assert "unknown parameter 'gen_tokenz'" in err and "gen_tokens" in err
    assert list(tmp_path.iterdir()) == []


def test_missing_notebook_and_missing_out_json(tmp_path):
    with pytest.raises(ReceiptError, match="notebook 'absent' not found"):
        run(tmp_path / "run", ["absent"])
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]})])
    nbformat.write(nb, str(tmp_path / "nokernel.ipynb"))
    with pytest.raises(ReceiptError, match="'nokernel' cannot be inspected"):
        run_receipts("ci", tmp_path / "run", notebooks_dir=tmp_path, notebooks=["nokernel"])
    nb.metadata["kernelspec"] = {"name": "exactness", "display_name": "exactness", "language": "python"}
    nbformat.write(nb, str(tmp_path / "noout.ipynb"))
    with pytest.raises(ReceiptError, match="no 'out_json'"):
        run_receipts("ci", tmp_path / "run", notebooks_dir=tmp_path, notebooks=["noout"])
    assert not (tmp_path / "run").exists()


def test_missing_kernel(tmp_path):
    with pytest.raises(ReceiptError, match="kernel 'no-such-kernel' is not registered"):
        run(tmp_path / "run", ["ok"], kernel_name="no-such-kernel")
    assert list(tmp_path.iterdir()) == []


def test_parse_overrides():
    assert parse_overrides(["steps=[64, 100]", "prompt_max_tokens=null", "device=cpu", "gen_tokens=8"]) == {
        "steps": [64, 100], "prompt_max_tokens": None, "device": "cpu", "gen_tokens": 8}
    for bad in ("gen_tokens", "=3", "not a name=1"):
        with pytest.raises(ReceiptError, match="bad parameter"):
            parse_overrides([bad])


# ------------------------------------------------------------------------------------------- sections, rendering

def test_sections_are_stored_as_computed():
    r: dict = {}
    objs = [{"section": "hashes", "rows": [{"a": 1}], "note": "x"}, {"section": "streams", "data": {"k": [1, 2]}},
            {"section": "bench", "seconds": 1.5}]
    for obj in objs:
        add_section(r, obj, "nb")
    assert r == {o["section"]: o for o in objs}
    for bad in ({"rows": []}, {"section": "", "rows": []}, {"section": "hashes", "rows": []}, ["hashes"]):
        with pytest.raises(ValueError):
            add_section(r, bad, "nb")


def _huge_receipt(n: int) -> dict:
    rows = [{"prompt": f"prompt-{i}", "prompt_tokens": i, "prompt_sha256": "f" * 64, "path": path, "step": step,
             "kernels": "fast", "gen_tokens": 192, "hash": f"{i:012x}", "equals_oracle": path == "decode",
             "first_divergence": None if path == "decode" else 7, "oracle_margin": 0.5}
            for i in range(n) for path, step in (("decode", None), ("batched", 100), ("deep", 1000))]
    return {"schema": 2, "status": "ok", "profile": "ci", "parameters": {}, "env": {}, "errors": [], "notebooks": [],
            "sections": {"hashes": {"section": "hashes", "rows": rows},
                         "widgets": {"section": "widgets", "rows": [{"kernel": "k", "equal": True}] * 50}}}


def test_markdown_stays_under_github_limit():
    md = render.render_markdown(_huge_receipt(3000))
    assert len(md) < 65_536
    assert "not shown; see receipt.json" in md
    text = render.truncate("| a | b |\n" * 20_000)
    assert len(text) < 65_536 and text.endswith("see receipt.json._\n")
    assert "\n| a | b |\n\n_Receipt truncated" in text  # cut at a line boundary


def test_markdown_over_the_limit_compacts_its_tables_before_cutting():
    """Padded tables over the limit lose their padding (same cells, same rendering) instead of rows."""
    table = "| a      | bb     |\n|--------|--------|\n" + "| x      | y  z   |\n" * 5000
    assert len(table) >= 65_536
    text = render.truncate("## T\n\n" + table)
    assert len(text) < 65_536 and "truncated" not in text
    lines = text.split("\n")
    assert lines[2:5] == ["| a | bb |", "|---|---|", "| x | y z |"]
    assert len(lines) == len(("## T\n\n" + table).split("\n"))   # every row kept


def test_generic_renderer_and_registry(monkeypatch):
    md = render.render_markdown(_huge_receipt(2))
    assert "## widgets" in md and "| kernel " in md
    monkeypatch.setitem(render.RENDERERS, "widgets", lambda obj: f"## Widgets: {len(obj['rows'])} pairs")
    assert "## Widgets: 50 pairs" in render.render_markdown(_huge_receipt(2))


def test_markdown_escapes_pipes_and_newlines():
    md = render.render_generic([{"x": "a|b\nc"}])
    assert "a\\|b c" in md


def test_git_state_outside_a_repo(tmp_path, monkeypatch):
    state = env_module.git_state(tmp_path)
    assert state["sha"] is None and state["dirty"] is None and state["error"]
    # a tree copied without .git (the GPU machine): the commit stated by the caller, marked as stated
    monkeypatch.setenv("EXACTNESS_GIT_SHA", "ab" * 20)
    monkeypatch.setenv("EXACTNESS_GIT_DIRTY", "0")
    state = env_module.git_state(tmp_path)
    assert {k: state[k] for k in ("sha", "short", "dirty", "source")} == {
        "sha": "ab" * 20, "short": "ababab" + "a", "dirty": False, "source": "EXACTNESS_GIT_SHA"}
    assert state["git_said"]["sha"] is None and state["git_said"]["error"]
    monkeypatch.setenv("EXACTNESS_GIT_SHA", "not-a-sha")
    assert env_module.git_state(tmp_path)["sha"] is None


def test_a_stated_commit_that_the_record_cannot_hold_is_refused_before_the_run():
    """preflight.check_run refuses a short or malformed EXACTNESS_GIT_SHA and an EXACTNESS_GIT_DIRTY other than 0/1
    (git_state would pass over them for git's own view), naming the value; a full SHA, or none, passes."""
    from exactness.receipt.preflight import PreflightError, check_stated_commit
    check_stated_commit({})
    check_stated_commit({"EXACTNESS_GIT_SHA": "ab" * 20, "EXACTNESS_GIT_DIRTY": "1"})
    with pytest.raises(PreflightError, match=r"^EXACTNESS_GIT_SHA='d69a1af': the full commit is needed, 40 "):
        check_stated_commit({"EXACTNESS_GIT_SHA": "d69a1af"})
    with pytest.raises(PreflightError, match=r"^EXACTNESS_GIT_SHA='AB"):
        check_stated_commit({"EXACTNESS_GIT_SHA": "AB" * 20})
    with pytest.raises(PreflightError, match=r"^EXACTNESS_GIT_DIRTY='no': 0 .* or 1 .* is allowed$"):
        check_stated_commit({"EXACTNESS_GIT_SHA": "ab" * 20, "EXACTNESS_GIT_DIRTY": "no"})


def test_environment_record():
    env = receipt.environment()
    assert set(env["numerics"]) == {"cuda_matmul_allow_tf32", "cudnn_allow_tf32", "deterministic_algorithms",
                                    "float32_matmul_precision", "cpu_threads", "cpu_capability", "onednn_max_cpu_isa"}
    assert env["device"] and env["time_utc"].endswith("Z")


def test_summary_counts_runs_and_pairs_per_kernel_set():
    rows = [dict(prompt="p", kernels="fast", path="batched", step=8, hash="b", equals_oracle=False,
                 prompt_logits_equal=False, kv_equal=False),
            dict(prompt="p", kernels="invariant", path="batched", step=8, hash="a", equals_oracle=True,
                 prompt_logits_equal=True, kv_equal=True)]
    contract = [dict(set="fast", mismatches=3), dict(set="invariant", mismatches=0)]
    md = render.render_summary({"sections": {"hashes": {"section": "hashes", "rows": rows},
                                             "contract": {"section": "contract", "rows": contract}}})
    assert "| fast         | 0/1" in md and "| invariant    | 1/1" in md
    assert md.count("0/1") >= 2 and render.render_summary({}) == ""


def test_override_of_the_wrong_type_is_refused_before_anything_runs():
    declared = {"nb": {"gen_tokens", "steps", "prompt_max_tokens", "out_json"}}
    base = {"gen_tokens": 32, "steps": [128, 100], "prompt_max_tokens": None}
    with pytest.raises(receipt.ReceiptError, match="gen_tokens='abc' is of type str.*type int is expected"):
        receipt.plan_parameters(base, {"gen_tokens": "abc"}, declared)
    with pytest.raises(receipt.ReceiptError, match="steps=7 is of type int.*type list is expected"):
        receipt.plan_parameters(base, {"steps": 7}, declared)
    ok = receipt.plan_parameters(base, {"gen_tokens": 8, "prompt_max_tokens": 64}, declared)
    assert ok["nb"]["gen_tokens"] == 8 and ok["nb"]["prompt_max_tokens"] == 64


def test_precomputed_folder_points_each_notebook_at_its_section(tmp_path):
    per_nb = {"10_output_hashes": {"gen_tokens": 8}, "50_bench": {}}
    with pytest.raises(ReceiptError, match="lacks hashes.json, bench.json"):
        receipt.precomputed_parameters(tmp_path, {k: dict(v) for k, v in per_nb.items()}, {"host": "here"})
    for name in ("hashes", "bench"):
        (tmp_path / f"{name}.json").write_text(json.dumps({"section": name}))
    (tmp_path / "env.json").write_text(json.dumps({"device": "NVIDIA H200"}))
    env = receipt.precomputed_parameters(tmp_path, per_nb, {"host": "here"})
    assert env == {"device": "NVIDIA H200", "rendered_on": {"host": "here"}}
    assert per_nb["10_output_hashes"]["precomputed_json"] == str(tmp_path.absolute() / "hashes.json")
    assert per_nb["50_bench"]["precomputed_json"].endswith("bench.json")


def test_sections_command_runs_sections_in_one_process_and_records_failures(tmp_path, monkeypatch, capsys):
    """``python -m exactness sections`` writes env.json and one JSON per section; a failing section leaves its
    traceback in <section>.error.txt, the next still runs, and the exit code is 1. Bad input exits 2 at once."""
    from exactness.receipt import cli
    calls = []

    def fake(name, fail=False):
        def run_section(params):
            # each section gets its typed parameters (sections.Section.params_class), its own fields only
            assert isinstance(params, SECTIONS[name].params_class)
            calls.append((name, getattr(params, "hash_max_tokens", None), getattr(params, "contract_control_sweep",
                                                                                 None)))
            if fail:
                raise RuntimeError(f"{name} broke")
            return {"section": name, "ok": True}
        return run_section

    import exactness.analysis.contract.check as contract
    import exactness.analysis.hashes as hashes
    monkeypatch.setattr(hashes, "run_section", fake("hashes", fail=True))
    monkeypatch.setattr(contract, "run_section", fake("contract"))
    out = tmp_path / "gpu"
    rc = cli.main(["sections", "--profile", "gpu", "--out", str(out), "--sections", "hashes,contract",
                   "--param", "hash_max_tokens=12", "--param", "contract_control_sweep=full"])
    assert rc == 1
    assert calls == [("hashes", 12, None), ("contract", None, "full")]
    assert "hashes broke" in (out / "hashes.error.txt").read_text()
    assert not (out / "hashes.json").exists()
    written = json.loads((out / "contract.json").read_text())
    assert {k: written[k] for k in ("section", "ok")} == {"section": "contract", "ok": True}
    prov = written["provenance"]       # every section computed this way says where, at which commit, how
    assert prov["command"] == ("python -m exactness sections --profile gpu --sections contract "
                               "--param 'hash_max_tokens=12' --param 'contract_control_sweep=full'")
    assert set(prov) == {"computed_on", "commit", "command", "notes"} and prov["notes"].endswith(" s")
    assert "sha" in json.loads((out / "env.json").read_text())["git"]
    assert cli.main(["sections", "--profile", "gpu", "--out", str(out), "--sections", "hashes,nope"]) == 2
    assert "unknown sections ['nope']" in capsys.readouterr().err
    assert cli.main(["sections", "--profile", "gpu", "--out", str(out), "--param", "hash_max_tokenz=3"]) == 2
    assert "unknown parameter 'hash_max_tokenz'" in capsys.readouterr().err


def test_shared_synthetic_weights_are_the_same_bytes_and_never_aliased():
    """sharing_synthetic_weights derives every dtype/device from one draw: the same bytes as a fresh draw, and a
    caller that mutates its fp32 copy does not change what the next caller gets."""
    import torch
    from exactness.config import get_preset
    from exactness.exact import bytes_equal
    from exactness.weights import sharing_synthetic_weights, synthetic_weights
    cfg = get_preset("tiny")
    fresh16, fresh32 = synthetic_weights(cfg), synthetic_weights(cfg, torch.float32)
    with sharing_synthetic_weights():
        a32 = synthetic_weights(cfg, torch.float32)
        a32.layers[0].wq.add_(1.0)                              # a caller mutating its copy
        b16, b32 = synthetic_weights(cfg), synthetic_weights(cfg, torch.float32)
    assert bytes_equal(b16.layers[0].wq, fresh16.layers[0].wq)
    assert bytes_equal(b32.layers[0].wq, fresh32.layers[0].wq)
    assert not torch.equal(a32.layers[0].wq, b32.layers[0].wq)  # negative control: the mutation is seen


def test_shared_mtp_draw_is_drawn_once_same_bytes_and_never_aliased(monkeypatch):
    """The MTP head's synthetic weights share one draw too (nested blocks included): drawn once, the same bytes
    as a fresh draw, and an fp32 copy a caller mutates does not reach the next caller."""
    import torch
    from exactness import mtp
    from exactness.config import get_preset
    from exactness.exact import bytes_equal
    from exactness.weights import sharing_synthetic_weights
    cfg = get_preset("tiny")
    fresh = mtp.synthetic_mtp_weights(cfg, torch.float32)
    draws, draw = [], mtp._mtp_draw
    monkeypatch.setattr(mtp, "_mtp_draw", lambda c: draws.append(c) or draw(c))
    with sharing_synthetic_weights():
        a = mtp.synthetic_mtp_weights(cfg, torch.float32)
        a.proj.add_(1.0)
        with sharing_synthetic_weights():
            b, b16 = mtp.synthetic_mtp_weights(cfg, torch.float32), mtp.synthetic_mtp_weights(cfg)
    assert len(draws) == 1
    assert bytes_equal(b.proj, fresh.proj) and bytes_equal(b16.layer.wq, fresh.layer.wq.to(torch.bfloat16))
    assert not torch.equal(a.proj, b.proj)                      # negative control: the mutation is seen
    mtp.synthetic_mtp_weights(cfg)
    assert len(draws) == 2                                      # outside the block: a fresh draw


def test_sections_computed_elsewhere_show_their_provenance():
    """A section carrying a ``provenance`` record (a section computed on another machine) gets a row in receipt.md's
    provenance table; a receipt without one has no such table."""
    base = {"schema": 1, "status": "ok", "profile": "gpu", "parameters": {}, "env": {}, "errors": [],
            "notebooks": []}
    plain = render.render_markdown({**base, "sections": {"custom": {"section": "custom", "x": 1}}})
    assert "Where each section was computed" not in plain
    prov = {"computed_on": "NVIDIA H200", "commit": "abc1234", "command": "python -m exactness bench",
            "notes": "64 tokens"}
    md = render.render_markdown({**base, "sections": {"custom": {"section": "custom", "x": 1, "provenance": prov}}})
    assert "Where each section was computed" in md
    assert "- **custom**: NVIDIA H200; commit `abc1234`; `python -m exactness bench`. 64 tokens" in md


@pytest.mark.parametrize("override, message", [
    ("steps=[64, -1]", "steps=[64, -1] is not allowed; allowed: a non-empty list of positive ints"),
    ("device=gpu", "device='gpu' is not allowed; allowed: cpu, cuda, cuda:N"),
    ("kernel_sets=[fastest]", "kernel_sets=['fastest'] is not allowed; allowed: a non-empty list drawn from"),
    ("prompts=[]", "prompts=[] is not allowed"),
    ("gen_tokens=0", "gen_tokens=0 is not allowed; allowed: a positive int"),
    ("preset=huge", "preset='huge' is not allowed; allowed: "),
])
def test_bad_values_are_refused_before_anything_runs(tmp_path, override, message, capsys):
    """A value every section would refuse is refused by the runner up front (exit 2, nothing written), not after
    the notebooks ran."""
    out = tmp_path / "run"
    assert main(["receipts", "--profile", "ci", "--out", str(out), "--param", override]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and leftovers(tmp_path) == []
    assert main(["hashes", "--profile", "ci", "--param", override]) == 2      # the analysis CLI too
    assert message in capsys.readouterr().err


def test_precomputed_sections_of_another_profile_are_refused(tmp_path):
    """Rendering GPU sections under the CPU profile (or a CUDA profile over a CPU env.json) is refused."""
    def bench(profile, **over):   # the bench notebook's parameters as the runner plans them
        p = {**get_profile(profile).parameters(), **over}
        return {"50_bench": {"params": {k: v for k, v in p.items() if k in BenchParams.names()}}}
    (tmp_path / "bench.json").write_text(json.dumps(
        {"section": "bench", "data": {"config": {"preset": "small", "device": "cuda:0"}}}))
    with pytest.raises(ReceiptError, match="computed with preset 'small' on 'cuda', but this profile has preset "
                                           "'tiny' on 'cpu'"):
        receipt.precomputed_parameters(tmp_path, bench("ci"), {})
    assert receipt.precomputed_parameters(tmp_path, bench("gpu"), {"host": "here"}) == {"host": "here"}
    (tmp_path / "bench.json").write_text(json.dumps(
        {"section": "bench", "data": {"config": {"preset": "small", "device": "cuda:0", "gen_tokens": 64}}}))
    with pytest.raises(ReceiptError, match="computed with 64 generated tokens, but the parameters say 192; .*"
                                           "--param bench_gen_tokens=64"):
        receipt.precomputed_parameters(tmp_path, bench("gpu"), {})
    assert receipt.precomputed_parameters(tmp_path, bench("gpu", bench_gen_tokens=64), {}) == {}
    (tmp_path / "env.json").write_text(json.dumps({"cuda_available": False}))
    with pytest.raises(ReceiptError, match="without CUDA"):
        receipt.precomputed_parameters(tmp_path, bench("gpu", bench_gen_tokens=64), {})


def test_sections_command_with_no_sections(tmp_path, capsys):
    from exactness.receipt import cli
    assert cli.main(["sections", "--profile", "ci", "--out", str(tmp_path / "x"), "--sections", ""]) == 2
    assert "no sections given; allowed: hashes, contract" in capsys.readouterr().err


def test_malformed_yaml_value_gets_a_one_line_error():
    with pytest.raises(ReceiptError, match=r"bad value in parameter 'steps=\[1,2': not valid YAML \(.*\); no spaces "
                                           r"inside a value, e\.g\. steps=\[64,100\]") as e:
        receipt.parse_overrides(["steps=[1,2"])
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------ what a reviewer reads

def test_tables_show_dashes_words_and_integers_without_an_index():
    """Every table cell goes through tables.cell_text: None/NaN/pd.NA as a dash (with a footnote saying what it
    means), booleans as words, whole numbers as integers; the HTML hides the index."""
    import pandas as pd
    from exactness.tables import Table

    df = pd.DataFrame({"pos": [8, None], "margin": [0.5, float("nan")], "equal": [True, False],
                       "n": pd.array([3, pd.NA], dtype="Int64")})
    t = Table(df, {"pos": "first differing token", "margin": "margin (logit)", "equal": "tokens", "n": "rows"},
              words={"equal": ("equal", "differs")}, dash="no divergence")
    heads, body = t.cells()
    assert heads == ["first differing token", "margin (logit)", "tokens", "rows"]
    assert body == [["8", "0.5", "equal", "3"], ["–", "–", "differs", "–"]]
    md = t.to_markdown()
    assert "**differs**" in md and md.endswith("_– : no divergence._")
    html = t.to_html()
    for bad in ("NaN", "nan", "&lt;NA&gt;", "None", "8.0", "True", "False", "blank level0", "row_heading"):
        assert bad not in html, bad
    assert "– : no divergence." in html
    assert Table([{"a": 1}], dash="never shown").footnotes() == []  # no dash in the table: no footnote


def test_html_drops_stderr_but_the_executed_notebook_keeps_it(tmp_path):
    """Progress bars (stderr) stay in the executed .ipynb; receipt.html leaves every stderr stream out."""
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "exactness", "display_name": "x",
                                                           "language": "python"}})
    cell = nbformat.v4.new_code_cell("x = 1")
    cell.outputs = [nbformat.v4.new_output("stream", name="stderr", text="hash matrix:  50%|#####  | 1/2\n"),
                    nbformat.v4.new_output("stream", name="stdout", text="shown to the reviewer\n")]
    nb.cells = [cell]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    before = path.read_text()
    html = page_module.render_html({"status": "ok", "profile": "ci"}, [path])
    assert "shown to the reviewer" in html and "hash matrix" not in html
    assert 'data-mime-type="application/vnd.jupyter.stderr"' not in html
    assert path.read_text() == before
    assert "<style" in html and "/*" not in html and "://" not in html    # no CSS comment, no web address


def test_css_comments_are_stripped_from_style_blocks_only():
    page = "<style>a { color: red; } /* from https://x */\nb {}</style><p>/* text */</p><STYLE a=1>/*\n*/c{}</STYLE>"
    want = "<style>a { color: red; } \nb {}</style><p>/* text */</p><STYLE a=1>c{}</STYLE>"
    assert page_module.strip_css_comments(page) == want


def test_header_states_the_git_state_and_never_null():
    base = {"schema": 1, "status": "ok", "profile": "ci", "parameters": {"prompt_max_tokens": None,
            "checkpoint": ""}, "errors": [], "notebooks": []}
    for dirty, word in ((False, "(clean)"), (True, "(dirty: uncommitted changes)"), (None, "(state unknown)")):
        md = render.render_markdown({**base, "env": {"git": {"sha": "ab" * 20, "dirty": dirty}}})
        assert f"{'ab' * 20} {word}" in md
    assert "full prompts" in md and "synthetic weights" in md
    assert not re.search(r"\bNone\b|\bnull\b", md)


def test_section_extras_add_no_meta_lines():
    rec = _huge_receipt(2)
    rec["sections"]["hashes"].update(curves=[1, 2], note="fixture")
    md = render.render_markdown(rec)
    assert "(in receipt.json)" not in md and "## hashes: further values" in md and "| note" in md


def test_summary_is_stored_and_a_rendering_failure_fails_the_receipt(tmp_path, monkeypatch):
    rec = {**_huge_receipt(2), "errors": []}
    receipt._write_outputs(rec, tmp_path, [])
    data = json.loads((tmp_path / "receipt.json").read_text())
    assert data["status"] == "ok" and data["summary"] == render.render_summary(rec) != ""
    assert (tmp_path / "receipt.md").read_text().count(data["summary"]) == 1

    def boom(*a, **k):
        raise RuntimeError("renderer broke")
    monkeypatch.setattr(page_module, "render_html", boom)
    rec = {**_huge_receipt(2), "errors": []}
    receipt._write_outputs(rec, tmp_path, [])
    data = json.loads((tmp_path / "receipt.json").read_text())
    assert data["status"] == "failed" and data["errors"][0]["notebook"] == "receipt.html"
    assert "renderer broke" in (tmp_path / "receipt.html").read_text()
    monkeypatch.setattr(render, "render_summary", boom)
    rec = {**_huge_receipt(2), "errors": []}
    receipt._write_outputs(rec, tmp_path, [])
    assert json.loads((tmp_path / "receipt.json").read_text())["status"] == "failed"


def test_what_served_the_fast_sets_cuda_kernels_is_saved_merged_and_shown(monkeypatch, tmp_path):
    """A section saved in a process where the fast set made CUDA calls carries fast_cuda.served() (a failed kernel
    names why its fallback served); one where it made none carries nothing, as does one saved after forget_served
    (what `sections` calls before each section); merged parts join it kernel by kernel; the receipt's header lists
    it per section."""
    from exactness.analysis.merge import join_served
    from exactness.kernels import fast_cuda
    from exactness.receipt.sections import forget_served, load_section, save_section
    for k in fast_cuda.STATUS:
        monkeypatch.setitem(fast_cuda.STATUS, k, "untried")
    save_section({"section": "bench", "data": {}}, str(tmp_path / "none.json"))
    assert "fast_cuda" not in load_section(str(tmp_path / "none.json"), "bench")
    monkeypatch.setitem(fast_cuda.STATUS, "flash", "ok")
    monkeypatch.setitem(fast_cuda.STATUS, "inductor", "RuntimeError: no compiler")
    save_section({"section": "bench", "data": {}}, str(tmp_path / "ran.json"))
    ran = load_section(str(tmp_path / "ran.json"), "bench")
    assert ran["fast_cuda"] == {"flash": "ok", "inductor": "RuntimeError: no compiler"}
    elsewhere = {"section": "bench", "data": {}, "fast_cuda": {"flash": "ok"}}   # a precomputed section keeps its own
    save_section(elsewhere, str(tmp_path / "kept.json"))
    assert load_section(str(tmp_path / "kept.json"), "bench")["fast_cuda"] == {"flash": "ok"}
    assert join_served([ran, {"fast_cuda": {"flash": "ok", "grouped_mm": "ok"}}, {}]) == {
        "flash": "ok", "inductor": "RuntimeError: no compiler", "grouped_mm": "ok"}
    assert join_served([{}, {}]) is None
    forget_served()                                           # the next section's record is of its own calls
    save_section({"section": "bench", "data": {}}, str(tmp_path / "next.json"))
    assert "fast_cuda" not in load_section(str(tmp_path / "next.json"), "bench")
    r = {"schema": 2, "status": "ok", "profile": "gpu", "parameters": {}, "env": {}, "errors": [], "notebooks": [],
         "sections": {"bench": ran, "hashes": {"section": "hashes", "rows": []}}}
    head = render.render_header(r)
    assert "- **bench**: flash ok; inductor RuntimeError: no compiler" in head and "**hashes**:" not in head
