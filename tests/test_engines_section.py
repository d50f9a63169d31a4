"""The hash matrix on engines (analysis/engines.py) over our reference engine's adapter (engines/reference.py): each run
judged on tokens, prompt-logit, generated-logit and KV bytes against the engine's oracle; what an engine lacks named,
never counted as equal; planted faults caught; the receipt runner's ENGINE route; one section, one comparison for
our engine's matrix and the engines'."""
from __future__ import annotations

import json

import pytest
import torch

from exactness.analysis import engines as E
from exactness.analysis import hashes as H
from exactness.engines import open_engine, parse_spec
from exactness.engines.base import EngineError, NotAvailable
from exactness.run import Run
from exactness.engines.reference import ReferenceEngine
from exactness.params import HashesParams, ParamError
from exactness.weights import synthetic_weights
from exactness.config import get_preset
from faults import row0_rmsnorm_perturbed

GEN = 6


@pytest.fixture(scope="module")
def w():
    return synthetic_weights(get_preset("tiny"))


@pytest.fixture(scope="module")
def prompts():
    text = "def f(x):\n    return 2 * x + 1  # a line of code, then more\n"
    return {"p": ReferenceEngine(synthetic_weights(get_preset("tiny"))).encode(text)}


def test_invariant_reference_engine_equals_its_oracle_in_every_part(w, prompts):
    eng = ReferenceEngine(w, None, "invariant", steps=[16, 7], deep_threshold=8)
    rows = E.hash_rows(eng, prompts, GEN)
    assert [r["config"] for r in rows] == ["decode", "batched", "batched-16", "deep-16", "batched-7", "deep-7"]
    for r in rows:
        assert r["verdict"] == "equal", r
        assert r["prompt_logits_equal"] and r["gen_logits_equal"] and r["kv_equal"] and r["equals_oracle"]


def test_planted_fault_is_named_with_its_first_row(w, prompts):
    """RMSNorm perturbed on row 0 of every multi-row call: prompt rows through the batched path differ from the
    decode oracle from row 0 on (the decode path never makes a multi-row call, so the oracle is untouched)."""
    eng = ReferenceEngine(w, None, row0_rmsnorm_perturbed(), steps=[16], deep_threshold=8)
    rows = {r["config"]: r for r in E.hash_rows(eng, prompts, GEN)}
    assert rows["decode"]["verdict"] == "equal"
    bad = rows["batched-16"]
    assert bad["prompt_logits_equal"] is False and bad["first_differing_prompt_row"] == 0
    assert bad["kv_equal"] is False and bad["verdict"].startswith("differs:") and "prompt logits" in bad["verdict"]


def _gen(config, ids, logits=None, kv=None):
    return Run(config, torch.tensor(ids), prompt_logits=logits, kv=kv)


def test_compare_names_what_differs_and_what_was_not_exposed():
    a = torch.zeros(3, 5)
    b = a.clone()
    b[1, 2] = 1.0
    assert E.compare(_gen("x", [1, 2]), _gen("o", [1, 2]))["verdict"] == \
        "equal (not exposed: prompt logits, generated logits, KV)"
    r = E.compare(_gen("x", [1, 3], b), _gen("o", [1, 2], a))
    assert r["verdict"] == "differs: tokens, prompt logits" and r["first_divergence"] == 1
    assert r["first_differing_prompt_row"] == 1 and r["prompt_rows_differing"] == 1
    kv = [torch.zeros(2, 2, dtype=torch.bfloat16)]
    kv2 = [kv[0].clone()]
    kv2[0][1, 1] = 2 ** -20  # a subnormal-scale change that a tolerance would accept
    r = E.compare(Run("x", torch.tensor([1]), kv=kv2), Run("o", torch.tensor([1]), kv=kv))
    assert r["kv_equal"] is False and r["verdict"].startswith("differs: KV")


class _Partial:
    """A fake engine with one configuration pair, no drafted decoding and a failing concurrent mode."""

    kind, oracle = "fake", "a"
    capabilities = frozenset({"token_ids"})

    def identity(self):
        return {"kind": "fake", "version": "0"}

    def configurations(self):
        from exactness.engines.base import Configuration
        return [Configuration("a"), Configuration("b")]

    def encode(self, text):
        return [1, 2, 3]

    def generate(self, ids, gen, config):
        return _gen(config, [7] * gen)

    def drafted(self, *a):
        raise NotAvailable("no draft model configured")

    def resumed(self, *a):
        raise EngineError("fake: the server died")

    def concurrent(self, prompts, gen, config):
        return [self.generate(p, gen, config) for p in prompts]

    def close(self):
        pass


def test_missing_abilities_are_reasons_not_verdicts():
    with pytest.raises(EngineError, match="server died"):
        E.stream_rows(_Partial(), {"p": [1, 2, 3]}, 3, "b")
    eng = _Partial()
    eng.resumed = lambda *a: (_ for _ in ()).throw(NotAvailable("no prompt cache"))
    out = E.stream_rows(eng, {"p": [1, 2, 3]}, 3, "b")
    assert out["not_available"] == {"drafted": "not available from this engine: no draft model configured",
                                    "resumed": "not available from this engine: no prompt cache"}
    assert out["drafted"] == [] and [r["verdict"] for r in out["concurrent"]] == [
        "equal (not exposed: prompt logits, generated logits, KV)"]


def test_engine_specs_are_checked_before_anything_runs(tmp_path):
    for bad, msg in (("vllm:http://x", "unknown engine kind 'vllm'"), ("", "non-empty"),
                     (str(tmp_path / "missing.yaml"), "does not exist")):
        with pytest.raises(ValueError, match=msg):
            parse_spec(bad)
    with pytest.raises(ParamError, match="unknown engine kind"):
        HashesParams.from_dict(dict(engine=["nope:x"], device="cpu", dtype="bfloat16", prompts=["short"],
                                     steps=[8], gen_tokens=4))
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: reference\nbogus: 1\n")
    with pytest.raises(ValueError, match="unknown option\\(s\\) bogus"):
        open_engine(str(bad), preset="tiny")
    eng = open_engine("reference", preset="tiny", kernel_sets=["invariant"], steps=[8])
    with pytest.raises(ValueError, match="no configuration 'chunk-9'.*decode, batched"):
        eng.generate([256, 1], 2, "chunk-9")


def test_receipt_runs_the_engines_section_only(tmp_path):
    from exactness.receipt.runner import ReceiptError, run_receipts
    with pytest.raises(ReceiptError, match="contract cannot run in this receipt"):
        run_receipts("ci", tmp_path / "r0", {"engine": ["reference"]}, sections=["contract"])
    res = run_receipts("ci", tmp_path / "r", {"engine": ["reference"], "prompts": ["short"], "gen_tokens": 4,
                                              "kernel_sets": ["invariant"]})
    data = json.loads((res.folder / "receipt.json").read_text())
    assert res.status == "ok" and list(data["sections"]) == ["hashes"]
    assert data["env"]["engines"] == ["reference"] and data["env"]["kernel_sets"] is None
    sec = data["sections"]["hashes"]
    assert {r["verdict"] for r in sec["rows"]} == {"equal"} and sec["not_available"]["contract"]
    assert "## Engines under test" in (res.folder / "receipt.md").read_text()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from exactness.engines.tiny import save_tiny_qwen3_moe
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("hf") / "tiny")


def test_transformers_engine_rows_agree_with_a_brute_force_comparison(tiny_folder):
    """The engines section over a transformers model saved from a config: every configuration gets a row, the
    oracle's is equal, and each row's verdict on prompt rows and KV agrees with a plain loop over Python bytes of
    the same runs (which rows differ depends on the CPU's kernels, so only the agreement is asserted)."""
    from brute import _raw, first_row
    eng = open_engine(f"transformers:{tiny_folder}", device="cpu", dtype="bfloat16", steps=[7, 16],
                      kernel_sets=["fast"], preset="tiny")
    ids = eng.encode("def f(x):\n    return 2 * x + 1  # a line of code, then more\n")[:48]
    rows = {r["config"]: r for r in E.hash_rows(eng, {"p": ids}, 8)}
    assert set(rows) == {c.name for c in eng.configurations()} and rows["token-by-token"]["verdict"] == "equal"
    oracle = eng.generate(ids, 8, "token-by-token")
    for name in ("one-forward", "chunk-7", "chunk-16"):
        run = eng.generate(ids, 8, name)
        assert rows[name]["first_differing_prompt_row"] == first_row(run.prompt_logits, oracle.prompt_logits)
        kv_same = all(_raw(a) == _raw(b) for a, b in zip(run.kv, oracle.kv)) and len(run.kv) == len(oracle.kv)
        assert rows[name]["kv_equal"] == kv_same, name
        print(f"transformers {name} vs token-by-token: {rows[name]['prompt_rows_differing']}/{len(ids)} prompt rows "
              f"differ; verdict {rows[name]['verdict']}")
    eng.close()


def test_openai_engine_on_exactness_serve_receives_the_in_process_hashes(tmp_path, w):
    """Two `python -m exactness serve` configurations launched by the openai adapter from a YAML engine file,
    over real HTTP on 127.0.0.1: the section's token hashes equal the in-process reference engine's."""
    import sys
    serve = f"{sys.executable} -m exactness serve --preset tiny --kernels invariant --port {{port}}"
    spec = tmp_path / "serve.yaml"
    spec.write_text(f"kind: openai\noracle: decode\nconfigurations:\n"
                    f"  - {{name: decode, launch: '{serve} --path decode'}}\n"
                    f"  - {{name: batched-16, launch: '{serve} --path batched --step 16'}}\n")
    sec = H.run_section(dict(engine=["reference", str(spec)], device="cpu", dtype="bfloat16", prompts=["short"],
                             prompt_max_tokens=40, steps=[16], gen_tokens=GEN, kernel_sets=["invariant"],
                             preset="tiny", deep_threshold=8, engine_streams=False))
    assert sec["errors"] == []
    ours = {r["config"]: r["hash"] for r in sec["rows"] if r["engine"] == "reference:invariant"}
    served = {r["config"]: r["hash"] for r in sec["rows"] if r["engine"] == str(spec)}
    assert served == {"decode": ours["decode"], "batched-16": ours["batched-16"]}
    assert all(c["tokens_equal"] for c in sec["cross"])
    assert all(r["verdict"].startswith("equal") for r in sec["rows"])


def test_engine_bench_measures_each_configuration_and_refuses_a_cache_hit_as_cold(w, prompts):
    from exactness.analysis.engines_bench import bench_engine, cold_rows
    eng = ReferenceEngine(w, None, "invariant", steps=[16], deep_threshold=8)
    source = list(range(1, 200))
    b = bench_engine(eng, prompts, 4, [32, 500], source)
    configs = [c.name for c in eng.configurations()]
    assert [(r["config"], r["run"]) for r in b["runs"]] == [(c, k) for c in configs for k in ("cold", "warm")]
    assert all(r["ttft_s"] > 0 and r["generated"] == 4 for r in b["runs"])
    assert all([s["streams"] for s in b["streams"][c]] == [1, 2] and all(s["equal_to_alone"] for s in b["streams"][c])
               for c in configs)
    for c in configs:
        (ok, skipped) = b["cold"][c]
        assert ok["length"] == 32 and ok["cold"] is True and skipped["skipped"] == "the source prompt has 199 tokens"
    cached = _Partial()
    cached.generate = lambda ids, gen, config: Run(config, torch.tensor([1] * gen), ttft_s=0.1,
                                                   info={"usage": {"prompt_tokens_details":
                                                                   {"cached_tokens": 16}}})
    (row,) = cold_rows(cached, source, [32], 2, "a")
    assert row["cold"] is False and row["cached_tokens"] == 16


def test_engine_targets_are_checked_before_anything_runs(tmp_path, tiny_folder):
    """A model folder without config.json, a file that is not GGUF, a URL that is not http(s): refused with the
    spec named; our engine on a checkpoint runs once per kernel set, each labelled with its set."""
    not_gguf = tmp_path / "m.gguf"
    not_gguf.write_bytes(b"NOPE")
    for spec, msg in ((f"transformers:{tmp_path}", "is not a model folder"), ("transformers", "is not a model folder"),
                      (f"reference:{tmp_path / 'x'}", "is not a model folder"), (f"llamacpp:{not_gguf}",
                                                                                "is not a GGUF file"),
                      ("openai:localhost:8000", "is not a base URL")):
        with pytest.raises(ValueError, match=msg):
            parse_spec(spec)
    sec = H.run_section(dict(engine=[f"reference:{tiny_folder}"], device="cpu", dtype="bfloat16", prompts=["short"],
                             prompt_max_tokens=24, steps=[8], gen_tokens=2, kernel_sets=["fast", "invariant"],
                             preset="tiny", deep_threshold=8, engine_streams=False))
    assert [e["spec"] for e in sec["engines"]] == [f"reference:{tiny_folder}:fast", f"reference:{tiny_folder}:invariant"]
    assert {r["verdict"] for r in sec["rows"] if r["engine"].endswith(":invariant")} == {"equal"}


def test_one_section_one_comparison_for_our_matrix_and_the_engines():
    """hashes.run_section without ``engine`` is our engine's matrix, with it the engines'; both rows name engine,
    prompt and configuration and carry every field of the one comparison (engines.compare), render through the one
    table entry, and a planted fault shows in both as prompt rows differing."""
    from exactness.kernels import KERNEL_SETS
    from exactness.receipt.sections import SECTIONS

    params = dict(preset="tiny", device="cpu", dtype="bfloat16", prompts=["short"], prompt_max_tokens=12, steps=[5],
                  gen_tokens=4, deep_threshold=4, kernel_sets=["faulty"], hash_rerun=False, engine_streams=False)
    fields = set(E.compare(Run("a", torch.tensor([1])), Run("b", torch.tensor([1]))))
    KERNEL_SETS["faulty"] = row0_rmsnorm_perturbed()
    try:
        ours, theirs = H.run_section(params), H.run_section({**params, "engine": ["reference"]})
    finally:
        del KERNEL_SETS["faulty"]
    assert ours["section"] == theirs["section"] == "hashes" and "engines" not in ours
    assert {r["engine"] for r in ours["rows"]} == {"reference"} and theirs["engines"][0]["spec"] == "reference:faulty"
    for rows in (ours["rows"], theirs["rows"]):
        assert all(fields <= set(r) and r["prompt"] == "short" for r in rows)
        runs = [r for r in rows if r.get("config", r.get("path")) != "decode"]
        assert runs and all(r["prompt_logits_equal"] is False and r["gen_logits_equal"] is not None for r in runs)
    assert {r["config"] for r in theirs["rows"]} == {"decode", "batched", "batched-5", "deep-5"}
    assert {(r["path"], r["step"]) for r in ours["rows"]} == {("decode", None), ("batched", 5), ("deep", 5)}
    render = SECTIONS["hashes"].renderer()
    assert "## Engines under test" in render(theirs) and "## Engines under test" not in render(ours)
