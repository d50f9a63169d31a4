"""engine_dumps (analysis/engines_dumps.py): from a differing hash-matrix row to the first op that broke, in the
engines section's run.

Asserted: the tiny GGUF at n_ubatch 1 vs 512 through run_section names the same first op (class, site, position,
element, ULPs, byte-equal inputs) as scripts/dump_llamacpp.py --check on the same tokens (which op depends on the
CPU: compared, never hard-coded); the oracle's own set has 0 differing rows; an identical pair (a one-token prompt)
reports no dumps needed and 0 rows; a planted ULP is named by the receipt line (negative control); prompts over the
limit are refused in one line; engines without dumps say so; a bad value is a one-line ParamError.
"""
import pytest
import torch

from exactness.analysis import engines as E
from exactness.analysis import hashes as H
from exactness.analysis import engines_md
from exactness.analysis import engines_dumps as ED
from exactness.params import ParamError
from exactness.params import HashesParams

P = 12


@pytest.fixture(autouse=True)
def _temp_under_tmp_path(tmp_path, monkeypatch):
    """``on-differ`` and ``always`` write under a new temporary folder: here, one the test owns."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install llama-cpp-python")
    from exactness.engines import gguf_export
    from exactness.engines.tiny import save_tiny_qwen3_moe
    root = tmp_path_factory.mktemp("engine_dumps")
    return str(gguf_export.export_gguf(save_tiny_qwen3_moe(root / "tiny", dtype="bfloat16"), root / "tiny.gguf",
                                       dtype="bf16"))


def _script():
    """scripts/dump_llamacpp.py as a module."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parents[1] / "scripts" / "dump_llamacpp.py"
    spec = importlib.util.spec_from_file_location("dump_llamacpp_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _section(gguf, tokens, mode, **kw):
    return H.run_section(dict(engine=[f"llamacpp:{gguf}"], device="cpu", dtype="bfloat16", prompts=["code"],
                              prompt_max_tokens=tokens, steps=[512], gen_tokens=2, engine_streams=False,
                              engine_dumps=mode, **kw))


def test_ubatch_512_names_the_op_the_script_names(gguf, capsys, tmp_path):
    """``always``: whether or not this CPU's n_ubatch 512 logits differ, the set is dumped and its first op that
    broke is the one scripts/dump_llamacpp.py --check prints on the same tokens."""
    from exactness.analysis.contract.calls import contract_of_calls
    from exactness.dumps.reader import read_dump
    sec = _section(gguf, P, "always")
    assert sec["errors"] == [] and sec["failures"] == []
    rec = sec["engine_dumps"][f"llamacpp:{gguf}"]
    _script().main([gguf, str(tmp_path / "script"), "--ubatch", "512", "--tokens", str(P), "--check"])
    printed = capsys.readouterr().out
    ref = contract_of_calls(tmp_path / "script", progress=False)
    (got,) = rec["configs"]
    assert got["config"] == "n_ubatch-512" and got["status"] == "dumped" and got["prompt_tokens"] == P
    tokens = lambda folder: [r[3] for c in read_dump(folder).calls if c.role == "prompt" for r in c.rows]  # noqa
    assert tokens(got["folder"]) == tokens(tmp_path / "script")   # the same input
    assert got["totals"] == ref["totals"] and got["first_origin"] == ED.compact(ref)["first_origin"]
    assert got["first_mismatch"] == ED.compact(ref)["first_mismatch"]
    o, md = got["first_origin"], engines_md.render_md(sec)
    if o is None:   # this CPU's kernels keep the contract at this call size
        assert ref["first_origin"] is None and "no op broke the contract" in md
    else:
        assert o["inputs_equal"] is True and o["call_rows"] == P
        assert f"| {o['site']} " in printed and f"| {o['class']} " in printed
        assert f"first op that broke: class `{o['class']}`, site `{o['site']}`" in md
    assert rec["oracle"]["config"] == "n_ubatch-1" and rec["oracle"]["totals"]["mismatches"] == 0
    assert rec["oracle"]["totals"]["paired"] > 0


def test_on_differ_dumps_the_differing_configuration(gguf, tmp_path):
    """A folder: on-differ, the sets written there; dumped exactly when the hash-matrix row differs."""
    sec = _section(gguf, 28, str(tmp_path / "ed"))
    assert sec["errors"] == []
    row = next(r for r in sec["rows"] if r["config"] == "n_ubatch-512")
    rec = sec["engine_dumps"][f"llamacpp:{gguf}"]
    if row["verdict"].startswith("differs"):
        (got,) = rec["configs"]
        assert got["status"] == "dumped" and got["folder"].startswith(str(tmp_path / "ed"))
        assert got["totals"]["mismatches"] > 0 and got["first_mismatch"] is not None
        assert rec["oracle"]["totals"]["mismatches"] == 0
    else:
        assert rec["configs"] == [] and rec["note"].startswith("no dumps needed")


def test_identical_pair_needs_no_dumps(gguf, tmp_path):
    """One prompt token: n_ubatch 512 runs the same one-row calls as n_ubatch 1."""
    sec = _section(gguf, 1, "on-differ")
    assert all(r["verdict"] == "equal" for r in sec["rows"]), [r["verdict"] for r in sec["rows"]]
    rec = sec["engine_dumps"][f"llamacpp:{gguf}"]
    assert rec["configs"] == [] and rec["oracle"] is None and rec["folder"] is None
    assert "no dumps needed: every configuration's runs equal the oracle's; 0 rows dumped" in engines_md.render_md(sec)
    sec = _section(gguf, 1, "always")
    (got,) = sec["engine_dumps"][f"llamacpp:{gguf}"]["configs"]
    assert got["status"] == "dumped" and got["totals"]["paired"] > 0 and got["totals"]["mismatches"] == 0
    assert got["first_mismatch"] is None and "no op broke the contract" in ED.line(got)


class _Planted:
    """A llamacpp engine whose dumps add one ULP to element 0 of node ``site`` at position ``pos`` (prompt role)."""

    def __init__(self, eng, site, pos):
        self.eng, self.site, self.pos, self.kind, self.oracle = eng, site, pos, eng.kind, eng.oracle

    def hook(self, role, s, y, positions):
        if role == "prompt" and s == self.site and self.pos in positions:
            idx = [0, 0, 0, 0]
            if len(positions) > 1:
                idx[next(a for a in range(4) if y.shape[a] == len(positions))] = positions.index(self.pos)
            y.view(torch.int32)[tuple(idx)] += 1

    def dump(self, ids, config, folder):
        return self.eng.dump(ids, config, folder, on_output=self.hook)


def test_planted_ulp_is_named(gguf, tmp_path):
    from exactness.engines import open_engine
    from exactness.prompts import build_prompt
    eng = open_engine(f"llamacpp:{gguf}", ubatch=[1, 4])
    try:
        ids = build_prompt("code", max_tokens=6).ids.tolist()
        rows = [{"config": "n_ubatch-4", "prompt": "code", "verdict": "equal"}]
        rec = ED.engine_dumps(_Planted(eng, "attn_norm-0", 2), "x", {"code": ids}, rows, "always")
    finally:
        eng.close()
    (got,) = rec["configs"]
    o = got["first_origin"]
    assert (o["site"], o["pos"], o["element"], o["ulp"], o["inputs_equal"]) == ("attn_norm-0", 2, 0, 1, True)
    assert "site `attn_norm-0`" in ED.line(got) and "(1 ULP)" in ED.line(got)


class _Fake:
    kind, oracle = "openai", "a"


def test_bounds_and_engines_without_dumps():
    class Dumper(_Fake):
        kind = "llamacpp"

        def dump(self, *a):
            raise AssertionError("a refused prompt must not be dumped")
    rows = [{"config": "b", "prompt": "long", "verdict": "differs: tokens"}]
    rec = ED.engine_dumps(Dumper(), "d", {"long": list(range(ED.MAX_TOKENS + 1))}, rows, "on-differ")
    assert [r["status"] for r in rec["configs"]] == ["refused"]
    assert "257 tokens" in ED.line(rec["configs"][0]) and "\n" not in ED.line(rec["configs"][0])
    assert ED.engine_dumps(Dumper(), "d", {}, [], "always")["note"].startswith("not run")
    rec = ED.engine_dumps(Dumper(), "d", {}, rows, "always")   # the differing prompt has no ids (chat messages)
    assert rec["configs"] == [] and "chat messages" in rec["note"]
    rec = ED.engine_dumps(_Fake(), "s", {"long": [1]}, rows, "on-differ")
    assert rec["not_available"] and rec["configs"] == []
    assert "not available from this engine" in ED.render_md({"s": rec})


@pytest.mark.parametrize("bad", ["", 3, "sometimes.txt", "./sometimes.txt", "on_differ"])
def test_bad_value_is_one_line(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sometimes.txt").write_text("a file")
    with pytest.raises(ParamError, match="engine_dumps=") as e:
        HashesParams.from_dict(dict(engine=["reference"], device="cpu", dtype="bfloat16", prompts=["short"],
                                     steps=[16], gen_tokens=4, engine_dumps=bad))
    assert "\n" not in str(e.value)


def test_transformers_one_forward_is_dumped_and_the_others_say_why(tmp_path):
    """``always`` on the tiny transformers model: one-forward's set gives the contract dump_hf_model gives on the
    same ids; the other configurations and the oracle are named as not dumpable, with the reason."""
    from exactness.analysis.contract.calls import contract_of_calls
    from exactness.dumps.hf_hooks import dump_hf_model
    from exactness.engines import open_engine
    from exactness.engines.tiny import save_tiny_qwen3_moe
    from exactness.prompts import build_prompt
    folder = save_tiny_qwen3_moe(tmp_path / "tiny", dtype="bfloat16")
    spec = f"transformers:{folder}"
    sec = H.run_section(dict(engine=[spec], device="cpu", dtype="bfloat16", prompts=["code"], prompt_max_tokens=P,
                             steps=[4], gen_tokens=2, engine_streams=False, engine_dumps="always"))
    assert sec["errors"] == []
    rec = sec["engine_dumps"][spec]
    by = {r["config"]: r for r in rec["configs"]}
    assert set(by) == {"one-forward", "chunk-4", "generate", "generate-chunk-4"}
    assert by["one-forward"]["status"] == "dumped" and by["one-forward"]["totals"]["paired"] > 0
    assert all(r["status"] == "not available" and r["reason"] for c, r in by.items() if c != "one-forward")
    assert rec["oracle"]["status"] == "not available"
    eng = open_engine(spec, device="cpu", dtype="bfloat16")
    try:
        ids = eng.encode(build_prompt("code").text.decode("utf-8"))[:P]
        calls = dump_hf_model(tmp_path / "ref", eng.model, torch.tensor(ids), weights=False)
        ref = ED.compact(contract_of_calls(calls, progress=False))
    finally:
        eng.close()
    got = by["one-forward"]
    assert (got["totals"], got["first_mismatch"], got["first_origin"]) == \
        (ref["totals"], ref["first_mismatch"], ref["first_origin"])
    md = engines_md.render_md(sec)
    assert "**chunk-4** (prompt `code`, 12 tokens): not available: only one-forward is dumped" in md
