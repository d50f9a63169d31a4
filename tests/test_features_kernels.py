"""The kernel contract and the FP64 section on quantized weights (kernels/quant.py) and grouped routing
(kernels/router.py): quantized pools at every site, a planted scale fault located (class, site, call size, row,
weights format), the router's grouped site, FP64 references on dequantized weights with a planted wrong scale, and
grouped-router taps whose decision check applies the group mask."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from exactness.analysis.contract import cases as cc
from exactness.analysis.contract import check as C
from exactness.analysis.contract import combine, report as contract_report
from exactness.analysis.fp64 import cert as fp64_cert
from exactness.analysis.fp64 import ref as fp64_ref
from exactness.analysis.fp64 import report as fp64_report
from exactness.analysis.fp64 import section as fp64
from exactness.analysis.fp64 import synth
from exactness.analysis.taps import TapRecorder
from exactness.config import get_preset
from exactness.exact import bytes_equal, first_differing_row
from exactness.kernels import KernelSet, get_set, quant
from exactness.kernels.cuda import dense_invariant
from exactness.kernels.router import router_invariant
from exactness.model import tapping
from exactness.paths import Schedule, generate
from exactness.params import ContractParams, Fp64Params, ParamError
from exactness.weights import synthetic_weights

FORMATS = ("int4_g128", "nvfp4")
CFG = get_preset("tiny")
KV_ROWS = CFG.n_kv_heads * CFG.head_dim          # N of the k and v projections (q and o have Hq*D = H rows)
GROUPS = (4, 1)    # 8 experts in 4 groups of 2, one group kept: the top-2 is the kept group's pair


def _prompt_variant(name: str, cls: str, fn) -> KernelSet:
    """The invariant set with the prompt kernel of ``cls`` replaced by ``fn`` (not registered)."""
    ks = get_set("invariant")
    return KernelSet(name, dict(ks.decode), {**ks.prompt, cls: replace(ks.prompt[cls], fn=fn)}, False, "test only")


def _scale_fault(x, w):
    """dense_invariant, but a quantized k/v projection (N = Hkv*D) is read with the scale of (row 0, group 0)
    halved: output feature 0 of those sites is wrong, everything else is the invariant kernel's bytes."""
    if isinstance(w, quant.QuantWeight) and w.shape[0] == KV_ROWS:
        w = quant.with_scale(w, 0, 0, 0.5)
    return dense_invariant(x, w)


def _pair(ks: KernelSet, cls: str):
    return ks.prompt[cls], ks.decode[cls]


# --------------------------------------------------------------------------------------------- the contract

@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_dense_contract_identical_copy_clean_scale_fault_located(fmt):
    copy = _prompt_variant("invariant-copy", "dense", lambda x, w: dense_invariant(x, w))
    res = C.check_pair(*_pair(copy, "dense"), "cpu", "bfloat16", "quick", sources=("random",), weights=fmt)
    assert (res.mismatches, res.weights_format, res.sites) == (0, fmt, "q,k,v,o") and res.cases > 100_000
    assert set(res.by_site) == {"q", "k", "v", "o"}
    pool = cc.make_pool("dense", "random", torch.bfloat16, "cpu", "tiny", "k", fmt)
    assert isinstance(pool.fixed[0], quant.QuantWeight) and pool.fixed[0].fmt == fmt   # the pools hold the format

    fault = _prompt_variant("invariant+scale-fault", "dense", _scale_fault)
    res = C.check_pair(*_pair(fault, "dense"), "cpu", "bfloat16", "quick", sources=("random",), weights=fmt,
                       stop_at_first=True)
    fm = res.first_mismatch
    row = C.PairResult.to_row(res)
    assert row["weights_format"] == fmt and fm["weights_format"] == fmt
    # the first case of the plan (M = 1, one call of one row) at the first faulty site (q is clean)
    assert (fm["site"], fm["M"], fm["call_rows"], fm["row"], fm["output"], fm["element"]) == ("k", 1, 1, 0, "out", 0)
    assert res.by_site["q"] == [1, 0] and res.by_site["k"] == [1, 1]
    # independently: the decode kernel and the faulty prompt kernel on the pool's first tested row
    case = cc.plan("dense", "quick")[0]
    args = pool.args(torch.arange(case.start, case.start + 1))
    want, got = get_set("invariant").fn("dense", "decode")(*args), _scale_fault(*args)
    assert first_differing_row(want.reshape(-1), got.reshape(-1)) == 0
    assert bytes_equal(want[:, 1:], got[:, 1:])
    # the same fault on bf16 weights changes nothing: it is the format's scale that is caught
    res = C.check_pair(*_pair(fault, "dense"), "cpu", "bfloat16", "quick", sources=("random",), stop_at_first=True)
    assert res.mismatches == 0 and res.weights_format == "bf16"


def test_quantized_expert_down_fault_caught_on_captured_rows():
    def fault(h, w):
        return experts_down(h, quant.with_scale(w, 0, 0, 0.5) if isinstance(w, quant.QuantWeight) else w)
    from exactness.kernels.cuda import down_any as experts_down
    ks = _prompt_variant("invariant+down-fault", "expert_down", fault)
    res = C.check_pair(*_pair(ks, "expert_down"), "cpu", "bfloat16", "quick", sources=("captured",),
                       weights="int4_g128", stop_at_first=True)
    fm = res.first_mismatch
    assert fm is not None and (fm["site"], fm["M"], fm["row"], fm["element"], fm["source"]) == \
        ("routed", 1, 0, 0, "captured")
    assert fm["weights_format"] == "int4_g128"
    with pytest.raises(ValueError, match="weights format 'nvfp4' is not allowed for class 'rmsnorm'"):
        cc.make_pool("rmsnorm", "random", torch.bfloat16, "cpu", weights="nvfp4")


def _outside_kept(idx: torch.Tensor, logits: torch.Tensor, groups) -> list[int]:
    """Rows whose picked experts leave the topk_groups groups of largest logit (brute force, ties included)."""
    G, Gk = groups
    bad = []
    for m in range(idx.shape[0]):
        best = [float(logits[m].view(G, -1)[g].float().max()) for g in range(G)]
        cut = sorted(best, reverse=True)[Gk - 1]
        if any(best[int(e) // (logits.shape[1] // G)] < cut for e in idx[m]):
            bad.append(m)
    return bad


def test_grouped_router_site_clean_and_a_groupless_prompt_router_caught():
    assert cc.class_sites("router") == ("",) and cc.class_sites("router", "tiny", GROUPS) == ("topk", "grouped")
    pool = cc.make_pool("router", "random", torch.bfloat16, "cpu", "tiny", "grouped", groups=GROUPS)
    x, w, k, norm, groups = pool.args(torch.arange(200))
    assert groups == GROUPS
    _, idx, logits = router_invariant(x, w, k, norm, groups)
    assert _outside_kept(idx, logits, GROUPS) == []
    _, plain, _ = router_invariant(x, w, k, norm)
    assert _outside_kept(plain, logits, GROUPS) != []               # the brute force can fail

    inv = get_set("invariant")
    res = C.check_pair(*_pair(inv, "router"), "cpu", "bfloat16", "quick", sources=("random",), groups=GROUPS)
    assert res.mismatches == 0 and res.sites == "topk,grouped" and res.to_row()["router_groups"] == list(GROUPS)
    groupless = _prompt_variant("invariant+groupless", "router", lambda x, w, k, n, *g: router_invariant(x, w, k, n))
    res = C.check_pair(*_pair(groupless, "router"), "cpu", "bfloat16", "quick", sources=("random",), groups=GROUPS)
    assert res.by_site["topk"][1] == 0 and res.by_site["grouped"][1] > 0
    assert res.first_mismatch["site"] == "grouped" and res.first_mismatch["output"] in ("weights", "idx")


def test_run_section_rows_name_their_weights_and_merge_per_format(monkeypatch):
    base = {"preset": "tiny", "device": "cpu", "dtype": "bfloat16", "kernel_sets": ["invariant"],
            "contract_sweep": "quick", "contract_classes": ["expert_down"], "contract_offload": False,
            "contract_dtypes": ["bfloat16"]}
    sec = C.run_section({**base, "contract_weights": ["bf16", "int4_g128"]})
    assert [(r["class"], r["weights_format"], r["mismatches"]) for r in sec["rows"]] == \
        [("expert_down", "bf16", 0), ("expert_down", "int4_g128", 0)]
    assert sec["weights_formats"] == ["bf16", "int4_g128"] and sec["router_groups"] is None
    quant_cov = [c for c in sec["coverage"] if c["weights_format"] == "int4_g128"]
    assert {c["class"]: c["status"] for c in quant_cov} == {"dense": "uncovered", "expert_gate_up": "uncovered",
                                                            "expert_down": "checked"}
    md = contract_report.render_md(sec)
    assert "Quantized weights" in md and "| invariant | bfloat16 | int4_g128 | expert_down" in md
    # one part per format merges into the one run
    done = {r["weights_format"]: r for r in sec["rows"]}

    def lookup(s, device, dtypes, sweep, offload=False, progress=None, weights="bf16", **kw):
        return [C.PairResult(cls=done[weights]["class"], **{k: v for k, v in done[weights].items() if k != "class"})]
    monkeypatch.setattr(C, "check_set", lookup)
    parts = [C.run_section({**base, "contract_weights": [f]}) for f in ("bf16", "int4_g128")]
    merged = combine.merge_sections(parts)
    assert {k: v for k, v in merged.items() if k != "provenance"} == sec
    with pytest.raises(ValueError, match="overlap"):
        combine.merge_sections([parts[1], parts[1]])


def test_contract_and_fp64_parameters_refused_with_what_is_allowed():
    with pytest.raises(ParamError, match="allowed: a non-empty list of distinct formats drawn from bf16, "
                                         "int4_g128, nvfp4"):
        ContractParams(contract_weights=["int3"])
    with pytest.raises(ParamError, match="multiple of n_groups=3"):
        ContractParams(contract_router_groups=[3, 1])
    with pytest.raises(ParamError, match=r"\[n_groups, topk_groups\]"):
        ContractParams(contract_router_groups=[4])
    assert ContractParams(contract_router_groups=[4, 2]).contract_weights == ["bf16"]
    common = dict(preset="tiny", device="cpu", dtype="bfloat16", prompts=["code"], steps=[64], deep_threshold=64,
                  kernel_sets=["invariant"])
    with pytest.raises(ParamError, match="fp64_weights=\\['fp8'\\] is not allowed"):
        Fp64Params(**common, fp64_weights=["fp8"])
    assert Fp64Params(**common, weights="nvfp4").weight_formats == ["nvfp4"]
    assert Fp64Params(**common, fp64_weights=["bf16", "int4_g128"]).weight_formats == ["bf16", "int4_g128"]


# ------------------------------------------------------------------------------------------------------ FP64

CERT = {"method": "-", "certified": True, "ulps": 0.0, "failures": []}


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp64_quantized_gemm_within_bound_and_wrong_scale_outside(fmt):
    case = synth.make_case("dense", "normal", CFG, torch.bfloat16, "cpu", M=16, weights=fmt)
    w = case.params[(0, "syn")]
    assert isinstance(w, quant.QuantWeight) and case.weights == fmt
    x = case.args[0]
    prods = x.double()[:, None, :] * w.dequantize().double()[None]                  # exact in fp64
    rounded = int((prods.float().double() != prods).sum())                          # products fp32 cannot hold
    assert (rounded > 0) == (fmt == "nvfp4"), rounded                               # ref.py's bound derivation
    evs = {}
    for path in ("decode", "batched"):
        samples = synth.case_samples(case, synth.run_case(case, "invariant", path), path)
        evs[path] = fp64_ref.evaluate("dense", samples, case.params, case.kv)
    assert torch.equal(evs["decode"].y.reshape(16, -1), x.double() @ w.dequantize().double().T)
    for path, ev in evs.items():
        cert = fp64_cert.certify(ev, range(0, ev.y.numel(), 97), case.params, case.kv)
        assert cert["certified"] and cert["ulps"] <= 1, cert
        meta = {"class": "dense", "path": path, "set": "invariant", "dtype": "bfloat16", "input_set": "normal"}
        row, _ = fp64.make_row(ev, evs["decode"], cert, meta)
        assert row["verdict"] in ("within bound", "exact") and row["bound_use"] <= 1, row["bound_use"]
    # planted: a dense kernel that reads group 0 of output row 0 with a wrong (halved) scale
    wrong = dense_invariant(x, quant.with_scale(w, 0, 0, 0.5))
    bad = replace(evs["decode"], yhat=wrong.reshape(-1))
    row, st = fp64.make_row(bad, None, CERT, {**meta, "path": "decode", "set": "planted"})
    assert row["verdict"] == "outside bound" and row["bound_use"] > 10, row["bound_use"]
    over = (st["use"] > 1).nonzero().flatten()
    assert over.numel() > 0 and set((over % w.shape[0]).tolist()) == {0}            # only output feature 0


def test_fp64_section_on_quantized_captured_runs():
    sec = fp64.run_section({"preset": "tiny", "device": "cpu", "dtype": "bfloat16", "prompts": ["code"],
                            "prompt_max_tokens": 80, "steps": [40], "gen_tokens": 1, "deep_threshold": 32,
                            "kernel_sets": ["invariant"], "fp64_rows": 4, "fp64_cert": 4, "fp64_synthetic": False,
                            "fp64_weights": ["nvfp4"]})
    rows = sec["rows"]
    assert {r["weights"] for r in rows} == {"nvfp4"} and sec["meta"]["weights"] == ["nvfp4"]
    gemm = [r for r in rows if r["class"] in ("dense", "expert_gate_up", "expert_down")]
    assert {r["class"] for r in gemm} == {"dense", "expert_gate_up", "expert_down"}
    bad = [(r["class"], r["path"], r["verdict"]) for r in rows if r["verdict"] not in ("within bound", "exact")]
    assert bad == [] and all(r["ref_certified"] for r in rows)
    assert "(nvfp4 weights)" in fp64_report.render_md(sec)


def test_grouped_router_taps_and_decisions_apply_the_group_mask(code_prompt):
    w = synthetic_weights(CFG.replace(n_groups=GROUPS[0], topk_groups=GROUPS[1]))
    rec = TapRecorder([0, 7, 19, 30, 39], w)
    with rec.run("batched"), tapping(rec):
        generate(w, code_prompt.ids[:40], 1, "invariant", Schedule("batched", 16))
    samples = rec.samples[("invariant", "batched", "router")]
    assert len(samples) == 5 * CFG.n_layers and all(s.meta["groups"] == GROUPS for s in samples)
    for s in samples:   # the kernel's choice from the stored inputs, with the groups the tap kept
        _, idx, _ = router_invariant(s.data["x"][None], rec.params[(s.layer, "router")], s.meta["top_k"],
                                     s.meta["norm"], s.meta["groups"])
        assert bytes_equal(idx[0], s.data["idx"])
    ev = fp64_ref.evaluate("router", samples, rec.params, {})
    decided = [d for d in ev.decisions if d[2] > 1e-3]
    assert decided and all(d[0] == d[1] for d in decided)        # clear decisions: the kernel's is the reference's
    # negative control: the same samples judged without the group mask flip where the best experts span groups
    plain = [replace(s, meta={k: v for k, v in s.meta.items() if k != "groups"}) for s in samples]
    flips = [d for d in fp64_ref.evaluate("router", plain, rec.params, {}).decisions if d[0] != d[1]]
    assert flips
    allowed, margin = fp64_ref.group_mask(torch.tensor([0.0, 3, 1, 1, 2, 2, 0, 0], dtype=torch.float64), (4, 1))
    assert allowed.tolist() == [True, True] + [False] * 6 and margin == 1.0


def test_synthetic_cases_per_weights_format_share_the_draws():
    p = Fp64Params(preset="tiny", device="cpu", dtype="bfloat16", prompts=["code"], steps=[64], deep_threshold=64,
                   kernel_sets=["invariant"], fp64_weights=["bf16", "nvfp4"])
    full, quantized = fp64.synthetic_cases(p, CFG), fp64.synthetic_cases(p, CFG, "nvfp4")
    assert {c[0] for c in quantized} == set(synth.QUANT_CLASSES) and set(quantized) < set(full)
    a = synth.make_case("expert_down", "outliers", CFG, torch.bfloat16, "cpu", M=8, seed=3)
    b = synth.make_case("expert_down", "outliers", CFG, torch.bfloat16, "cpu", M=8, seed=3, weights="nvfp4")
    assert bytes_equal(a.args[0], b.args[0])                                        # same draws, other weights
    q = quant.quantize(a.params[(0, "syn.down")], "nvfp4")
    assert bytes_equal(b.params[(0, "syn.down")].codes, q.codes)
    with pytest.raises(ValueError, match="weights 'nvfp4' not allowed for synthetic class 'attention'"):
        synth.make_case("attention", "normal", CFG, torch.bfloat16, "cpu", weights="nvfp4")
