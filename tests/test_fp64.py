"""FP64 per-class receipt: taps, references and their certification, metrics and verdicts (analysis/fp64*.py)."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from exactness.analysis.fp64 import section as fp64
from exactness.analysis.fp64 import cert as fp64_cert
from exactness.analysis.fp64 import ref as fp64_ref
from exactness.analysis.fp64 import report as fp64_report
from exactness.analysis.fp64 import synth
from exactness.analysis.taps import TapRecorder
from exactness.blocks import to_markdown
from exactness.analysis.ulp import round_to, step
from exactness.cache import dequantize
from exactness.config import get_preset
from exactness.exact import bytes_equal
from exactness.kernels import KERNEL_SETS, KernelSet, get_set
from exactness.model import tapping
from exactness.paths import Schedule, generate
from exactness.profiles import get_profile

ROOT = Path(__file__).resolve().parents[1]
CFG = get_preset("tiny")
POSITIONS = [0, 5, 33, 63, 64, 70, 79]   # both 64-row deep tiles
U = 2.0 ** -24


# ------------------------------------------------------------------------------------------------ exact sums

def test_exact_sum_known_cancellations():
    # left to right in doubles loses the 1.0 (the built-in sum compensates since Python 3.12: not used here)
    assert fp64_cert.exact_sum([1e16, 1.0, -1e16]) == 1.0 and (1e16 + 1.0) + -1e16 == 0.0
    # bf16-exact terms: 2^24 + 1 - 2^24 in fp32 gives 0, exactly it is 1
    t = torch.tensor([2.0 ** 24, 1.0, -2.0 ** 24], dtype=torch.bfloat16)
    f32 = [np.float32(v) for v in t.float().tolist()]
    assert (f32[0] + f32[1]) + f32[2] == 0.0                                   # fp32 left to right loses it
    assert fp64_cert.exact_sum([float(v) for v in t]) == 1.0
    # many bf16 products and their negations shuffled, plus a tiny term: exactly the tiny term
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(500, generator=g) * 1e3).bfloat16().double()
    terms = torch.cat([x, -x, torch.tensor([2.0 ** -60], dtype=torch.float64)])
    terms = terms[torch.randperm(terms.numel(), generator=g)].tolist()
    assert fp64_cert.exact_sum(terms) == 2.0 ** -60
    assert sum(fp64_cert.expansion([1e16, 1.0, 2.0 ** -80, -1e16])) == 1.0  # expansion keeps every bit
    assert fp64_cert.expansion([1e16, 1.0, 2.0 ** -80, -1e16]) == [1.0, 2.0 ** -80]


# ------------------------------------------------------------------------------------------------ synthetic

def _case_eval(cls, iset="normal", dtype=torch.bfloat16, K=None, M=64, kernels="invariant", path="decode"):
    case = synth.make_case(cls, iset, CFG, dtype, "cpu", M=M, K=K)
    ev = fp64_ref.evaluate(cls, synth.case_samples(case, synth.run_case(case, kernels, path), path), case.params,
                           case.kv)
    return case, ev


def _with_yhat(ev, yhat):
    return dataclasses.replace(ev, yhat=yhat.reshape(ev.yhat.shape).to(ev.yhat.dtype))


@pytest.mark.parametrize("cls", ["dense", "rmsnorm", "attention"])
def test_certification_accepts_fp64_and_rejects_wrong_references(cls):
    case, ev = _case_eval(cls, K=1024 if cls == "dense" else None, M=16)
    eta = fp64.error_stats(ev)["eta"]
    picks = fp64.pick_elements(ev, 8, 0, eta)
    good = fp64_cert.certify(ev, picks, case.params, case.kv)
    assert good["certified"] and good["ulps"] <= fp64_ref.CERT_MAX_ULPS, good
    # the same reference computed in fp32 (and one with a dropped term, for the GEMM) must be rejected
    wrong = {"fp32 rounding": ev.y.float().double(), "shifted by 2^-30·A": ev.y + ev.A * 2 ** -30}
    if cls == "dense":
        x = torch.stack([s.data["x"] for s in ev.samples]).float()
        w = case.params[(0, "syn")].float()
        wrong["fp32"] = (x @ w.T).double().reshape(-1)
        wrong["dropped term"] = ev.y - (x[:, :1].double() @ w[:, :1].double().T).reshape(-1)
    for name, y in wrong.items():
        res = fp64_cert.certify(dataclasses.replace(ev, y=y), picks, case.params, case.kv)
        assert not res["certified"] and res["ulps"] > fp64_ref.CERT_MAX_ULPS, (name, res)


def test_two_precision_check_detects_low_precision(monkeypatch):
    case, ev = _case_eval("rmsnorm", M=4)
    monkeypatch.setattr(fp64_cert, "CERT_PRECS", (16, 640))
    res = fp64_cert.certify(ev, [0, 1, 2], case.params, case.kv)
    assert not res["certified"] and "disagree" in res["failures"][0]


@pytest.mark.parametrize("n", [0, 1, 3])
def test_planted_error_of_n_ulps_is_reported(n):
    _, ev = _case_eval("dense", M=16)
    st = fp64.error_stats(_with_yhat(ev, step(round_to(ev.y, torch.bfloat16), n)))
    assert st["ulp_max"] == n and int(st["ulps"].min()) == n
    assert st["ulp0_pct"] == (100.0 if n == 0 else 0.0) and st["ulp1_pct"] == (100.0 if n == 1 else 0.0)


def _seq_sum(x, w, order, acc):
    """Sequential accumulation over k of x[m,k]·w[n,k] in ``order``; ``acc(s, p)`` does one step."""
    prods = x.double()[:, None, :] * w.double()[None, :, :]                          # [M, N, K] exact
    s = torch.zeros(prods.shape[:2], dtype=torch.float32)
    for k in order:
        s = acc(s, prods[..., k])
    return s


def _rz32(v: torch.Tensor) -> torch.Tensor:
    """fp64 -> fp32 rounding toward zero (clear the 29 low fraction bits; normal range)."""
    return (v.view(torch.int64) & ~((1 << 29) - 1)).view(torch.float64).float()


def test_planted_reordering_within_gamma_and_toward_zero_bias():
    case, ev = _case_eval("dense", "same_sign", torch.float32, K=2048, M=16)
    x, w = torch.stack([s.data["x"] for s in ev.samples]), case.params[(0, "syn")]
    rev = _seq_sum(x, w, range(x.shape[1] - 1, -1, -1), lambda s, p: (s.double() + p).float())
    rz = _seq_sum(x, w, range(x.shape[1]), lambda s, p: _rz32(s.double() + p))
    meta = {"class": "dense", "path": "decode", "set": "planted", "dtype": "float32", "input_set": "same_sign"}
    cert = {"method": "-", "certified": True, "ulps": 0.0, "failures": []}
    row_rev, st = fp64.make_row(_with_yhat(ev, rev), None, cert, meta)
    assert row_rev["eta_max_u"] > 1 and 0 < row_rev["eta_over_gamma"] <= 1, row_rev
    assert row_rev["verdict"] == "within bound"
    row_rz, _ = fp64.make_row(_with_yhat(ev, rz), None, cert, meta)
    assert row_rz["bias_u"] < -50 and row_rz["bias_u"] < -10 * abs(row_rev["bias_u"]), (row_rz["bias_u"],
                                                                                          row_rev["bias_u"])


def test_perturbed_kernels_are_caught():
    case, ev = _case_eval("dense", K=256, M=16)
    meta = {"class": "dense", "path": "batched", "set": "planted", "dtype": "bfloat16", "input_set": "normal"}
    cert = {"method": "-", "certified": True, "ulps": 0.0, "failures": []}
    # bf16 accumulation: far outside the fp32-accumulation bound
    x, w = torch.stack([s.data["x"] for s in ev.samples]), case.params[(0, "syn")]
    bf = _seq_sum(x, w, range(x.shape[1]), lambda s, p: (s.double() + p).bfloat16().float())
    row, _ = fp64.make_row(_with_yhat(ev, bf), ev, cert, meta)
    assert row["verdict"] == "outside bound" and row["bound_use"] > 10, row["bound_use"]
    # one output one ULP off the decode kernel's bytes: not exact, and outside the bound
    plant = ev.yhat.clone()
    plant[7] = step(plant[7:8], 1)[0]
    row, _ = fp64.make_row(_with_yhat(ev, plant), ev, cert, meta)
    assert row["verdict"] == "outside bound" and row["bitwise_equal_share"] < 1 and row["max_ulp_vs_decode"] == 1
    row, _ = fp64.make_row(ev, ev, cert, meta)
    assert row["verdict"] == "exact"


# ------------------------------------------------------------------------------------------------ taps

@pytest.fixture(scope="module")
def tapped(tiny_weights, code_prompt):
    ids = code_prompt.ids[:80]
    rec = TapRecorder(POSITIONS, tiny_weights)
    for path, step_, thr in (("decode", None, 512), ("batched", 48, 512), ("deep", None, 70)):
        with rec.run(path), tapping(rec):
            generate(tiny_weights, ids, 1, "invariant", Schedule(path, step_, thr))
    return rec


def test_taps_record_inside_a_run_only(tiny_weights, code_prompt):
    """A sample's data reaches the CPU when its run ends, so a recorder tapped outside ``run()`` refuses."""
    rec = TapRecorder(POSITIONS, tiny_weights)
    with pytest.raises(RuntimeError, match="inside `with recorder.run"), tapping(rec):
        generate(tiny_weights, code_prompt.ids[:8], 1, "invariant", Schedule("batched"))


def _recompute(s, rec, kv):
    fn = get_set("invariant").fn(s.cls, "decode")
    d, P = s.data, rec.params
    if s.cls in ("dense", "lm_head"):
        return fn(d["x"][None], P[(s.layer, s.tag)])[0].to(d["y"].dtype), d["y"]
    if s.cls == "router":
        return fn(d["x"][None], P[(s.layer, "router")], s.meta["top_k"], s.meta["norm"])[2][0], d["y"]
    if s.cls == "expert_gate_up":
        return fn(d["x"][None], P[(s.layer, s.tag + ".gate")], P[(s.layer, s.tag + ".up")])[0], d["y"]
    if s.cls == "expert_down":
        return fn(d["x"][None], P[(s.layer, s.tag + ".down")])[0], d["y"]
    if s.cls == "moe_combine":
        return fn(d["y"][None], d["g"][None], d["shared"][None])[0], d["out"]
    if s.cls == "attention":
        k, v = kv[s.layer]
        return fn(d["q"][None], k[None], v[None], torch.zeros(1, dtype=torch.int64), torch.tensor([s.pos]))[0], d["o"]
    if s.cls == "rmsnorm":
        return fn(d["x"][None], P[(s.layer, s.tag)], s.meta["eps"])[0], d["y"]
    if s.cls == "rope":
        return fn(d["x"][None], torch.tensor([s.pos]), s.meta["theta"])[0], d["y"]
    return fn(d["a"], d["b"]), d["y"]


def test_tapped_rows_reproduce_the_kernel_outputs(tapped):
    """Each sample's stored output is what the (row-invariant) kernel gives on its stored inputs: rows were mapped
    to the right positions, also inside deep tiles and expert member lists."""
    bad, n = [], 0
    for (ks, path, cls), samples in tapped.samples.items():
        kv = {k[2]: v for k, v in tapped.kv.items() if k[:2] == (ks, path)}
        for s in samples:
            got, want = _recompute(s, tapped, kv)
            n += 1
            if not bytes_equal(got.reshape(-1), want.reshape(-1)):
                bad.append((path, cls, s.layer, s.tag, s.pos))
    assert n > 500 and not bad, f"{len(bad)} of {n} samples differ, first {bad[:3]}"


def test_taps_sample_every_class_at_the_same_positions_on_every_path(tapped):
    plans = {k[3] for k in tapped.calls if k[1] == "deep"}
    assert "deep" in plans, f"the deep run never ran the deep plan: {plans}"
    keys = {}
    for (ks, path, cls), samples in tapped.samples.items():
        assert {s.pos for s in samples} <= set(POSITIONS)
        keys.setdefault(cls, {})[path] = {s.key for s in samples}
    assert set(keys) == set(TapRecorder.CLASSES)
    for cls, by in keys.items():
        assert by["decode"] == by["batched"] == by["deep"], cls
        per = {}
        for layer, tag, pos in by["decode"]:
            per[(layer, tag)] = per.get((layer, tag), 0) + 1
        assert max(per.values()) <= len(POSITIONS)
    # every sampled position reaches top_k routed experts plus the shared one, in every layer
    gate = [k for k in keys["expert_gate_up"]["decode"]]
    assert len(gate) == CFG.n_layers * len(POSITIONS) * (CFG.top_k + 1)


def test_captured_references_certified_and_invariant_paths_exact(tapped):
    memo = {}
    for cls in ("dense", "expert_gate_up", "attention", "lm_head"):
        evs = {}
        for path in ("decode", "batched", "deep"):
            kv = {k[2]: v for k, v in tapped.kv.items() if k[:2] == ("invariant", path)}
            ev = fp64_ref.evaluate(cls, tapped.samples[("invariant", path, cls)], tapped.params, kv)
            st = fp64.error_stats(ev)
            cert = fp64_cert.certify(ev, fp64.pick_elements(ev, 6, 0, st["eta"]), tapped.params, kv, memo)
            meta = {"class": cls, "path": path, "set": "invariant", "dtype": "bfloat16", "input_set": "captured"}
            row, _ = fp64.make_row(ev, evs.get("decode"), cert, meta, st)
            evs[path] = ev
            assert row["ref_certified"], (cls, path, cert)
            assert row["verdict"] == ("within bound" if path == "decode" else "exact"), (cls, path, row["verdict"])


# ------------------------------------------------------------------------------------------------ section

@pytest.fixture(scope="module")
def section():
    p = get_profile("ci").parameters()
    p.update(prompts=["short"], fp64_tokens=24, steps=[16], deep_threshold=16, fp64_rows=6, fp64_cert=4,
             fp64_synth_rows=64, fp64_k_max=1024, fp64_synth_classes=["dense", "attention"])
    return fp64.run_section(p)


def test_section_rows_cover_every_class_and_path(section):
    rows = section["rows"]
    cap = {(r["class"], r["path"], r["set"]) for r in rows if r["input_set"] == "captured"}
    assert cap == {(c, p, s) for c in fp64.CLASSES for p in ("decode", "batched", "deep")
                   for s in ("fast", "invariant")}
    need = {"class", "path", "set", "dtype", "input_set", "K", "ref_certified", "ref_cert_ulps", "eta_max_u",
            "eta_p99_u", "eta_over_gamma", "bias_u", "kappa_median", "kappa_max", "ulp0_pct", "ulp1_pct", "ulp_max",
            "rmse", "bitwise_equal_share", "max_ulp_vs_decode", "flips", "min_flip_margin", "verdict", "sampled"}
    for r in rows:
        assert need <= set(r), need - set(r)
        assert r["ref_certified"], r
        assert r["verdict"] in ("exact", "within bound", "outside bound")
    inv = [r for r in rows if r["set"] == "invariant" and r["path"] != "decode" and r["input_set"] == "captured"]
    assert all(r["verdict"] == "exact" for r in inv)
    assert {r["input_set"] for r in rows} == {"captured", "normal", "outliers", "same_sign"}
    assert any(r["dtype"] == "float32" for r in rows)
    json.dumps(section)


def test_render_md_is_compact(section):
    md = fp64_report.render_md(section)
    assert "| class" in md and "### Captured activations" in md and len(md) < 20_000
    with pytest.raises(ValueError, match="no rows"):
        fp64_report.render_md({"rows": []})


def test_render_md_is_the_notebook_view(section):
    """receipt.md is the blocks the notebook shows: its tables, plot captions and certification line; the
    receipt's list of rows gives the same view without plots."""
    view = fp64_report.blocks(section)
    md = fp64_report.render_md(section)
    assert md == to_markdown(view) + "\n"
    assert sum(b.plot is not None for b in view) >= 3 and md.count("_Plot: ") == sum(b.plot is not None for b in view)
    assert f"All {len(section['rows'])} rows have a certified reference." in md
    rows_only = fp64_report.render_md(section["rows"])
    assert "_Plot: " not in rows_only and "### Captured activations" in rows_only


def test_certification_line_names_an_uncertified_reference(section):
    """Negative control: one planted uncertified row turns the certification line into a failure."""
    rows = [dict(r) for r in section["rows"]]
    rows[3].update(ref_certified=False, verdict="uncertified", cert_failures=["element 0: planted"])
    md = fp64_report.render_md({**section, "rows": rows})
    assert f"1 of {len(rows)} rows have an uncertified reference: the receipt fails." in md
    assert "rows have a certified reference" not in md


def test_bad_parameters():
    p = get_profile("ci").parameters()
    with pytest.raises(ValueError, match="dtype"):
        fp64.run_section({**p, "dtype": "float16"})
    with pytest.raises(ValueError, match="fp64_rows"):
        fp64.run_section({**p, "fp64_rows": 0})
    with pytest.raises(ValueError, match="input set"):
        synth.make_case("dense", "uniform", CFG, torch.bfloat16, "cpu")


def test_notebook_renders_a_precomputed_section(section, tmp_path):
    import papermill
    pre, out = tmp_path / "fp64.json", tmp_path / "out.json"
    pre.write_text(json.dumps(section))
    nb = papermill.execute_notebook(str(ROOT / "notebooks" / "30_fp64_per_class.ipynb"), str(tmp_path / "30.ipynb"),
                                    parameters={"precomputed_json": str(pre), "out_json": str(out)},
                                    kernel_name="exactness", progress_bar=False)
    assert json.loads(out.read_text())["rows"] == section["rows"]
    text = json.dumps([c.get("outputs", []) for c in nb.cells])
    assert "verdict (decode / batched / deep)" in text and "image/png" in text  # the captured table, the plots
    assert "rows have a certified reference" in text and "_Plot: " not in text  # one view: plots drawn, not named
    assert math.isfinite(section["rows"][0]["eta_max_u"])


def test_uncertified_reference_fails_the_receipt(section):
    assert fp64.check_certified(section) == len(section["rows"])
    rows = [dict(r) for r in section["rows"]]
    rows[3].update(ref_certified=False, verdict="uncertified", cert_failures=["element 0: planted"])
    with pytest.raises(RuntimeError, match="1 of .* uncertified"):
        fp64.check_certified({"rows": rows})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_asked_for_without_cuda_is_a_clear_error():
    """device='cuda' where torch sees none: the same clear ValueError as the other sections, before any work."""
    from exactness.analysis.fp64 import section as fp64
    from exactness.profiles import get_profile
    with pytest.raises(ValueError, match="sees no CUDA device; allowed here: 'cpu'"):
        fp64.run_section({**get_profile("ci").parameters(), "device": "cuda"})


# ------------------------------------------------------------------------------------------------ fp8 KV cache

FP8_FAULT = "fp8_attention_ulp_fault"
FP8_RUN = dict(prompts=["short"], fp64_tokens=24, steps=[16], deep_threshold=16, fp64_rows=4, fp64_cert=3,
               fp64_synth_rows=16, fp64_synth_classes=["attention"], fp64_fp32_sweep=False)


def _fp8_attention_bumped() -> KernelSet:
    """The invariant set with every attention output one ULP up when the kernel reads an fp8 (uint8) cache, decode
    and prompt kernels alike; a bf16 cache gives the invariant bytes. Not registered."""
    ks = get_set("invariant")

    def wrap(fn):
        def attention(q, k_cache, v_cache, slots, positions):
            out = fn(q, k_cache, v_cache, slots, positions)
            return step(out, 1) if k_cache.dtype == torch.uint8 else out
        return attention
    tab = {r: {c: dataclasses.replace(s, fn=wrap(s.fn)) if c == "attention" else s
               for c, s in getattr(ks, r).items()} for r in ("decode", "prompt")}
    return KernelSet(FP8_FAULT, tab["decode"], tab["prompt"], False, "test-only: fp8-cache attention 1 ULP up")


@pytest.fixture(scope="module")
def fp8_runs():
    """kv_dtype -> (section, the recorder of its captured runs): fp8_e4m3_block on the invariant set and the fault
    set, bf16 on the fault set."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(KERNEL_SETS, FP8_FAULT, _fp8_attention_bumped())
        recs, capture = [], fp64.capture
        mp.setattr(fp64, "capture", lambda *a, **k: recs.append(capture(*a, **k)) or recs[-1])
        for kv, sets in (("fp8_e4m3_block", ["invariant", FP8_FAULT]), ("bf16", [FP8_FAULT])):
            p = {**get_profile("ci").parameters(), **FP8_RUN, "kernel_sets": sets, "kv_dtype": kv}
            out[kv] = (fp64.run_section(p), recs[-1][0])
    return out


def _attention_rows(section, ks, captured=True):
    return [r for r in section["rows"] if r["class"] == "attention" and r["set"] == ks
            and (r["input_set"] == "captured") == captured]


def test_fp8_attention_rows_read_the_fp8_cache_and_are_within_bound(fp8_runs):
    """kv_dtype fp8_e4m3_block: the captured attention calls were fed a uint8 cache (codes and scales, D + 4 bytes a
    row), the invariant set's attention rows (captured and synthetic) are within bound against that cache's values
    and name the format; the markdown says it."""
    section, rec = fp8_runs["fp8_e4m3_block"]
    fed = {k: tuple(t.dtype for t in v) + (v[0].shape[-1],) for k, v in rec.kv.items()}
    assert fed and set(fed.values()) == {(torch.uint8, torch.uint8, CFG.head_dim + 4)}, fed
    assert {k[:2] for k in fed} == {(ks, p) for ks in ("invariant", FP8_FAULT) for p in fp64.PATHS}
    for captured in (True, False):
        rows = _attention_rows(section, "invariant", captured)
        assert rows and all(r["kv_dtype"] == "fp8_e4m3_block" and r["ref_certified"] for r in rows)
        assert all(r["bound_use"] <= 1 and r["verdict"] in ("within bound", "exact") for r in rows), \
            [(r["path"], r["input_set"], r["verdict"], r["bound_use"]) for r in rows]
    assert not any("kv_dtype" in r for r in section["rows"] if r["class"] != "attention")
    md = fp64_report.render_md(section)
    assert "attention (fp8_e4m3_block KV cache)" in md and "KV cache: fp8_e4m3_block" in md


def test_fp8_only_attention_fault_is_flagged_with_an_fp8_cache_only(fp8_runs):
    """Negative control: attention one ULP up only when it reads an fp8 cache is outside bound on every path under
    kv_dtype fp8 (captured and synthetic rows), and clean under kv_dtype bf16, whose rows carry no KV format."""
    fp8, bf16 = fp8_runs["fp8_e4m3_block"][0], fp8_runs["bf16"][0]
    for captured in (True, False):
        bad = _attention_rows(fp8, FP8_FAULT, captured)
        assert bad and all(r["bound_use"] > 1 for r in bad), [(r["path"], r["bound_use"]) for r in bad]
        assert all(r["verdict"] == "outside bound" for r in bad if r["path"] == "decode")
        ok = _attention_rows(bf16, FP8_FAULT, captured)
        assert ok and all(r["bound_use"] <= 1 and r["verdict"] in ("within bound", "exact") for r in ok), \
            [(r["path"], r["verdict"], r["bound_use"]) for r in ok]
    assert not any("kv_dtype" in r for r in bf16["rows"]) and "kv_dtype" not in bf16["meta"]
    assert "fp8_e4m3_block KV cache" in "".join(fp64_report.notes_md(fp8))


def test_fp8_reference_reads_the_stored_values_not_the_unquantized_ones():
    """The reference over a packed fp8 cache is the one over its dequantized fp32 values (bitwise); judged
    against the unquantized draws instead, the invariant kernel's output would carry the quantization error."""
    fp8 = synth.make_case("attention", "normal", CFG, torch.bfloat16, "cpu", M=8, seed=3, kv_dtype="fp8_e4m3_block")
    raw = synth.make_case("attention", "normal", CFG, torch.bfloat16, "cpu", M=8, seed=3)
    assert fp8.args[1].dtype == torch.uint8 and bytes_equal(fp8.args[0], raw.args[0])
    samples = synth.case_samples(fp8, synth.run_case(fp8, "invariant", "batched"), "batched")
    ev = fp64_ref.evaluate("attention", samples, {}, fp8.kv)
    deq = fp64_ref.evaluate("attention", samples, {}, {0: tuple(dequantize(t) for t in fp8.kv[0])})
    assert bytes_equal(ev.y, deq.y)
    assert fp64.error_stats(ev)["bound_use"] <= 1
    assert fp64.error_stats(fp64_ref.evaluate("attention", samples, {}, raw.kv))["bound_use"] > 1
    with pytest.raises(ValueError, match="kv_dtype 'fp8_e4m3' not allowed for synthetic class 'dense'"):
        synth.make_case("dense", "normal", CFG, torch.bfloat16, "cpu", kv_dtype="fp8_e4m3")


def test_distinct_and_by_sample_equal_the_sorting_forms():
    from exactness.analysis.fp64 import stats
    from exactness.analysis.fp64.ref import Eval
    from exactness.analysis.taps import Sample
    g = torch.Generator().manual_seed(5)
    for x in (torch.randint(-1, 5, (1000,), generator=g), torch.randint(1, 16385, (300,), generator=g),
              torch.zeros(0, dtype=torch.int64)):
        assert torch.equal(stats.distinct(x), torch.unique(x))

    def by_sort(sid, n):
        order = torch.argsort(sid, stable=True)
        counts = torch.bincount(sid, minlength=n)
        starts = torch.cumsum(counts, 0) - counts
        return [order[int(starts[i]):int(starts[i] + counts[i])] for i in range(n)]

    runs = torch.tensor([2, 2, 2, 0, 0, 3, 3, 3, 3])              # one run per sample (sample 1 has none)
    split = torch.tensor([2, 2, 0, 0, 2, 3, 3, 0, 3])             # samples split over several runs
    for sid in (runs, split):
        samples = [Sample("dense", 0, "wq", p, "decode", {}) for p in range(4)]
        z = torch.zeros(sid.numel(), dtype=torch.float64)
        ev = Eval("dense", samples, z, z.bfloat16(), z, z, sid, sid, torch.arange(sid.numel()))
        got = stats._by_sample(ev)
        assert [s.key for s in samples] == list(got)
        assert all(torch.equal(a, b) for a, b in zip(got.values(), by_sort(sid, 4)))
    assert stats._by_sample(ev)[samples[0].key].tolist() == [2, 3, 7]   # split: its three elements, not a slice
