"""The engine's features (quantized weights, fp8 KV caches, grouped routing, packed prefill) through the receipt's
hashes and streams sections and the reference engine: each planted fault (reused from the features' own tests) is
caught by the section, in the rows of that feature's control only, at the row and position a direct comparison
measures; the invariant set's feature rows all equal their oracles; bad settings are refused naming the value."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import exactness.cache as kvc
from exactness.analysis import hashes, streams
from exactness.analysis import bench_tables, streams_report
from exactness.config import get_preset
from exactness.exact import token_hash
from exactness.kernels import KERNEL_SETS, KernelSet, get_set
from exactness.kernels.router import router_invariant
from exactness.paths import Schedule, generate
from exactness.prompts import build_prompt
from exactness.params import HashesParams, ParamError, StreamsParams
from exactness.profiles import get_profile
from exactness.weights import synthetic_weights

import brute
from test_kv_dtype import _faulty_quantize
from test_packed_prefill import leaky_set
from test_quant_weights import _perturbed_prompt_dense

SMALL = dict(preset="tiny", device="cpu", dtype="bfloat16", prompts=["short", "code"], prompt_max_tokens=24,
             steps=[16], gen_tokens=3, deep_threshold=8, hash_rerun=False, hash_sweep_tokens=40,
             hash_features=True)
FEATURE_LABELS = set(hashes.FEATURES)


def register(monkeypatch, ks: KernelSet) -> str:
    monkeypatch.setitem(KERNEL_SETS, ks.name, ks)
    return ks.name


def differing(rows: list[dict], ks: str) -> list[dict]:
    """The rows of set ``ks`` that differ from their oracle in tokens, prompt-logit bytes or KV bytes."""
    return [r for r in rows if r["kernels"] == ks
            and not (r["equals_oracle"] and r["prompt_logits_equal"] and r["kv_equal"])]


def all_equal(rows: list[dict], ks: str = "invariant") -> None:
    bad = differing(rows, ks)
    assert bad == [], [(r.get("control"), r["prompt"], r["path"], r["step"]) for r in bad]


def sweep_ids():
    return build_prompt("code", 40).ids


# ----------------------------------------------------------------------------------------------------- hashes

def test_ci_sized_feature_rows_of_the_invariant_set_all_equal():
    """The ci profile's hash matrix (prompts cut to 300 tokens, steps 128 and 100) with hash_features, invariant
    set: every feature control and every packed row equals its oracle (tokens, prompt-logit and KV bytes)."""
    p = {**get_profile("ci").parameters(), "kernel_sets": ["invariant"], "hash_sweep_steps": [],
         "hash_fp32_control": False, "hash_rerun": False}
    assert p["hash_features"] is True
    rows = hashes.run_section(p)["rows"]
    labels = {r.get("control") for r in rows}
    assert labels == {None, "packed"} | FEATURE_LABELS
    packed = [r for r in rows if r.get("control") == "packed"]
    assert sorted(r["prompt"] for r in packed) == sorted(p["prompts"]) and all(r["path"] == "packed" for r in packed)
    for label in FEATURE_LABELS:
        feat = [r for r in rows if r.get("control") == label]
        assert {(r["path"], r["step"]) for r in feat} == {("decode", None), ("batched", 128), ("batched", 100),
                                                          ("deep", 128), ("deep", 100)}, label
    by = {r["control"]: r for r in rows if r.get("control") in FEATURE_LABELS}
    assert by["weights nvfp4"]["weights"] == "nvfp4" and by["kv fp8_e4m3_block"]["kv_dtype"] == "fp8_e4m3_block"
    assert by["grouped routing 4/1"]["routing_groups"] == (4, 1)
    all_equal(rows)


def _located(rows, ks, label, run, oracle):
    """The batched@16 row of control ``label`` agrees with a direct comparison of ``run`` with ``oracle``."""
    row = next(r for r in rows if r["kernels"] == ks and r.get("control") == label and r["path"] == "batched")
    assert row["first_differing_prompt_row"] == brute.first_row(run.prompt_logits, oracle.prompt_logits)
    assert row["kv_first_position"] == brute.first_kv_position(run.cache, oracle.cache)
    return row


def test_planted_scale_fault_is_caught_in_the_weights_controls(monkeypatch):
    """The prompt dense kernel halves one group's scale of quantized weights: bf16 weights never see it, so only
    the quantized-weights controls differ, at the row and position measured directly."""
    bad = register(monkeypatch, _perturbed_prompt_dense())
    rows = hashes.run_section({**SMALL, "kernel_sets": [bad]})["rows"]
    hit = differing(rows, bad)
    assert {r.get("control") for r in hit} == {"weights int4_g128", "weights nvfp4"}
    assert {r["path"] for r in hit} == {"batched", "deep"}
    for fmt in ("int4_g128", "nvfp4"):
        w = synthetic_weights(get_preset("tiny"), weights=fmt)
        run = generate(w, sweep_ids(), 3, bad, Schedule("batched", 16), keep_cache=True)
        oracle = generate(w, sweep_ids(), 3, bad, Schedule("decode"), keep_cache=True)
        row = _located(rows, bad, f"weights {fmt}", run, oracle)
        assert row["kv_first_position"] is not None and row["prompt"] == f"code[:40] weights {fmt}"


def test_planted_fp8_write_fault_is_caught_in_the_kv_controls(monkeypatch):
    """Prompt-path fp8 writes with row 1's scale one ULP up (calls of more than one row): only the fp8 KV
    controls' batched and deep rows differ, first at KV position 1."""
    monkeypatch.setattr(kvc, "quantize", _faulty_quantize("scale"))
    rows = hashes.run_section({**SMALL, "kernel_sets": ["invariant"]})["rows"]
    hit = differing(rows, "invariant")
    assert {r.get("control") for r in hit} == {"kv fp8_e4m3", "kv fp8_e4m3_block"}
    assert {r["path"] for r in hit} == {"batched", "deep"}
    assert all(r["kv_equal"] is False and r["kv_first_position"] == 1 for r in hit)
    w = synthetic_weights(get_preset("tiny"))
    for kv in ("fp8_e4m3", "fp8_e4m3_block"):   # the same comparison, measured by plain loops
        run = generate(w, sweep_ids(), 3, "invariant", Schedule("batched", 16), keep_cache=True, kv_dtype=kv)
        oracle = generate(w, sweep_ids(), 3, "invariant", Schedule("decode"), keep_cache=True, kv_dtype=kv)
        _located(rows, "invariant", f"kv {kv}", run, oracle)


def _groupless_prompt_router() -> KernelSet:
    """The invariant set whose prompt router drops the routing groups (plain top-k): a prompt kernel that ignores
    the config's group limit, so prompt rows route where decode rows may not."""
    ks = get_set("invariant")

    def router(x, w, top_k, norm, groups=None):
        return router_invariant(x, w, top_k, norm)
    prompt = {**ks.prompt, "router": replace(ks.prompt["router"], fn=router)}
    return KernelSet("invariant+groupless-prompt-router", dict(ks.decode), prompt, False, "test-only fault")


def test_planted_groupless_router_is_caught_in_the_routing_control(monkeypatch):
    bad = register(monkeypatch, _groupless_prompt_router())
    rows = hashes.run_section({**SMALL, "kernel_sets": [bad]})["rows"]
    hit = differing(rows, bad)
    assert {r.get("control") for r in hit} == {"grouped routing 4/1"}
    w = synthetic_weights(get_preset("tiny").replace(n_groups=4, topk_groups=1))
    run = generate(w, sweep_ids(), 3, bad, Schedule("batched", 16), keep_cache=True)
    oracle = generate(w, sweep_ids(), 3, bad, Schedule("decode"), keep_cache=True)
    assert brute.first_row(run.prompt_logits, oracle.prompt_logits) is not None   # the fault acts here
    _located(rows, bad, "grouped routing 4/1", run, oracle)


def test_planted_packed_leak_is_caught_in_the_packed_rows(monkeypatch):
    """Attention that leaks the previous sequence's last key into the next one of the same call: only packed
    prompts after the first differ, from prompt row 0 and KV position 0 on."""
    bad = register(monkeypatch, leaky_set())
    rows = hashes.run_section({**SMALL, "kernel_sets": [bad]})["rows"]
    hit = differing(rows, bad)
    assert [(r.get("control"), r["prompt"]) for r in hit] == [("packed", "code")]
    assert (hit[0]["first_differing_prompt_row"], hit[0]["kv_first_position"]) == (0, 0)
    assert hit[0]["packed_prompts"] == ["short", "code"]


def test_bad_feature_settings_are_refused():
    base = {**SMALL, "kernel_sets": ["invariant"]}
    with pytest.raises(ParamError, match=r"weights='int3' is not allowed; allowed: bf16, int4_g128, nvfp4"):
        HashesParams.from_dict({**base, "weights": "int3"})
    with pytest.raises(ParamError, match=r"kv_dtype='fp8' is not allowed; allowed: bf16, fp8_e4m3, fp8_e4m3_block"):
        StreamsParams.from_dict({**base, "kv_dtype": "fp8", "hash_features": True})
    with pytest.raises(ParamError, match="hash_features must be true or false, got 'yes'"):
        HashesParams.from_dict({**base, "hash_features": "yes"})


def test_profile_weights_and_kv_dtype_reach_every_run():
    rows = hashes.run_section({**SMALL, "prompts": ["short"], "kernel_sets": ["invariant"], "hash_features": False,
                               "weights": "int4_g128", "kv_dtype": "fp8_e4m3_block"})["rows"]
    assert {(r["weights"], r["kv_dtype"]) for r in rows} == {("int4_g128", "fp8_e4m3_block")}
    all_equal(rows)
    w = synthetic_weights(get_preset("tiny"), weights="int4_g128")
    ref = generate(w, build_prompt("short", 24).ids, 3, "invariant", kv_dtype="fp8_e4m3_block")
    assert rows[0]["hash"] == token_hash(ref.gen_ids)


# ---------------------------------------------------------------------------------------------------- streams

STREAMS = {"profile": "test", "preset": "tiny", "device": "cpu", "dtype": "bfloat16", "prompts": ["short", "code"],
           "prompt_max_tokens": 24, "steps": [16], "gen_tokens": 3, "deep_threshold": 512, "stream_counts": [1, 2],
           "drafts": ["mtp", "self"], "prompt_cache_gib": 1.0}


def test_streams_packed_equals_alone_and_a_leak_is_named(monkeypatch):
    bad = register(monkeypatch, leaky_set())
    sec = streams.run_section({**STREAMS, "kernel_sets": ["invariant", bad], "kv_dtype": "fp8_e4m3_block"})
    packed = {r["set"]: r for r in sec["data"]["packed"]}
    assert set(packed) == {"invariant", bad} and all(r["streams"] == 2 for r in packed.values())
    good, leak = packed["invariant"], packed[bad]
    assert good["equal"] and good["failed"] == [] and good["reruns_equal"] and good["kv_dtype"] == "fp8_e4m3_block"
    assert good["equal_to_alone"] == {"eq": 4, "neq": 0, "fail": 0}
    assert leak["equal"] is False and "kv" in leak["failed"] and "logits" in leak["failed"]
    assert leak["first_prompt_row_diff_alone"] == [None, 0] and leak["first_kv_diff_alone"] == [None, 0]
    assert leak["equal_to_alone"]["neq"] == 2
    others = [r for part in ("drafted", "resumed", "concurrent") for r in sec["data"][part] if r["set"] == "invariant"]
    assert len(others) == 10 and all(r["equal"] for r in others)   # every stream part on the fp8 cache
    md = streams_report.render_md(sec)
    assert "### packed == alone" in md and "packed == alone" in streams_report.verdict_md(sec["data"])
    assert sec["data"]["settings"]["kv_dtype"] == "fp8_e4m3_block"


# ----------------------------------------------------------------------------------------------------- engines

def test_reference_engine_and_serve_take_the_feature_options():
    from exactness.engines.reference import ReferenceEngine
    from exactness.engines.serve import build_parser, load_served
    eng = ReferenceEngine.from_spec("", {"kernels": "invariant", "weights": "nvfp4", "kv_dtype": "fp8_e4m3_block"})
    ident = eng.identity()
    assert (ident["weights"], ident["kv_dtype"]) == ("nvfp4", "fp8_e4m3_block")
    ids = build_prompt("short", 16).ids
    g = eng.generate(ids.tolist(), 3, "batched")
    ref = generate(synthetic_weights(get_preset("tiny"), weights="nvfp4"), ids, 3, "invariant", Schedule("batched"),
                   keep_cache=True, kv_dtype="fp8_e4m3_block")
    assert torch.equal(g.gen_ids, ref.gen_ids) and g.kv[0].dtype == torch.uint8
    with pytest.raises(ValueError, match="unknown kv_dtype 'fp4'"):
        ReferenceEngine.from_spec("", {"kv_dtype": "fp4"})
    args = build_parser().parse_args(["--weights", "int4_g128", "--kv-dtype", "fp8_e4m3"])
    m = load_served("tiny", "", "invariant", Schedule("batched"), "cpu", "bfloat16", "", args.weights, args.kv_dtype)
    assert m.fingerprint.endswith(":int4_g128:fp8_e4m3")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-dtype", "fp4"])


# ------------------------------------------------------------------------------------------------------- bench

def test_bench_runs_on_the_profile_weights_and_kv_dtype(monkeypatch):
    """Every bench request runs the configured model: each paths.generate call gets int4_g128 weights and an fp8
    block-scaled cache, and the plain and drafted hashes equal paths.generate's on that model."""
    from exactness.analysis import bench
    from exactness.engines import reference
    from exactness.weights import weights_format
    seen = []

    def spy(w, *args, **kw):
        seen.append((weights_format(w), kw.get("kv_dtype")))
        return generate(w, *args, **kw)
    monkeypatch.setattr(reference, "generate", spy)   # the module whose requests call it
    params = dict(preset="tiny", device="cpu", dtype="bfloat16", prompts=["short"], prompt_max_tokens=16,
                  gen_tokens=3, deep_threshold=8, kernel_sets=["invariant"], bench_path="deep", bench_step=8,
                  bench_reps=1, bench_itl_reps=1, bench_cold_lengths=[16], weights="int4_g128",
                  kv_dtype="fp8_e4m3_block")
    data = bench.run_section(params)["data"]
    assert seen and set(seen) == {("int4_g128", "fp8_e4m3_block")}
    assert (data["config"]["weights"], data["config"]["kv_dtype"]) == ("int4_g128", "fp8_e4m3_block")
    ids = build_prompt("short", 16).ids
    want = token_hash(generate(synthetic_weights(get_preset("tiny"), weights="int4_g128"), ids, 3, "invariant",
                               Schedule("deep", 8, 8), kv_dtype="fp8_e4m3_block").gen_ids)
    assert {run["hash"] for part in ("plain", "drafted") for row in data[part] for run in row["runs"]} == {want}
    assert "weights int4_g128, KV cache fp8_e4m3_block" in bench_tables.config_line(data)


def test_offload_with_quantized_weights_is_refused():
    from exactness.params import BenchParams
    base = {**SMALL, "kernel_sets": ["invariant"], "weights": "nvfp4"}
    with pytest.raises(ParamError, match="hash_offload with weights='nvfp4' is not allowed.*allowed: weights='bf16'"):
        HashesParams.from_dict({**base, "hash_offload": [False, True]})
    with pytest.raises(ParamError, match="offload with weights='nvfp4' is not allowed"):
        BenchParams.from_dict({**base, "offload": True})
