"""Sharper verdicts: each analysis catches a planted fault that an earlier, coarser check let through, and names
where it acts; beside each, an identical copy of the kernel set (same kernels, another name) raises nothing.

- contract: a prompt kernel that misbehaves only for the k/v projections' operand shape, or only on kv-head rows,
  is caught at that call site (the q-shaped site alone keeps its bytes), with its call size and row;
- streams: a fault that changes only the verified rows' logits bytes (the tokens cannot change), or the KV bytes,
  fails drafted == plain and says which; a decode fault in batched rows fails concurrent == alone on KV bytes at
  the position where it acts;
- hashes: runs with the oracle's tokens but other prompt-logit or KV bytes are listed with the first differing row;
- fp64: a fault between the sampled positions leaves the rows `exact` (and the verdict names the positions
  judged); given the fault's position as an extra row, the verdict is no longer exact;
- importable sets: ``package.module:ATTR`` names a set defined in a helper module (tests/verdict_sets.py).

Tiny preset, CPU, short prompts, the quick contract sweep.
"""
from __future__ import annotations

import pytest
import torch

from exactness.analysis.contract import check as C
from exactness.analysis.contract import cases as cc
from exactness.analysis.contract import report as contract_report
from exactness.analysis import streams_report
from exactness.analysis.fp64 import report as fp64_report
from exactness.config import get_preset
from exactness.exact import as_int
from exactness.kernels import KERNEL_SETS, get_set, register_set

CFG = get_preset("tiny")
KV_WIDTH = CFG.n_kv_heads * CFG.head_dim   # out features of the k and v projections (q and o: Hq*D = H)


def variant_set(name: str, cls: str | None = None, fn=None) -> str:
    """Register (once) a claims-exact set equal to ``invariant`` except, when ``cls`` is given, its prompt kernel of
    ``cls`` (``fn``); with ``cls`` None an identical copy under another name (the control)."""
    if name not in KERNEL_SETS:
        table = {c: (s.fn, s.doc) for c, s in get_set("invariant").decode.items()}
        prompt = dict(table) if cls is None else {**table, cls: (fn, "planted fault")}
        register_set(name, decode=dict(table), prompt=prompt, claims_exact=True)
    return name


def one_ulp_up(out: torch.Tensor) -> torch.Tensor:
    """``out`` with element 0 of its first row one ULP up (a copy)."""
    out = out.clone()
    as_int(out).view(out.shape[0], -1)[0, 0] += 1
    return out


def dense_kv_shape_fault(x, w):
    """Fault: the invariant dense kernel, but calls of more than one row with the k/v projection's weight shape
    [Hkv*D, H] come out one ULP off on row 0."""
    out = get_set("invariant").fn("dense", "decode")(x, w)
    return one_ulp_up(out) if x.shape[0] > 1 and w.shape[0] == KV_WIDTH else out


def rmsnorm_kv_rows_fault(x, w, eps):
    """Fault: the invariant RMSNorm, but calls of more than one row on kv-head rows [M, Hkv, D] come out one ULP
    off on row 0."""
    out = get_set("invariant").fn("rmsnorm", "decode")(x, w, eps)
    kv_rows = x.dim() == 3 and x.shape[1] == CFG.n_kv_heads
    return one_ulp_up(out) if x.shape[0] > 1 and kv_rows else out


def check(set_name: str, cls: str, dtype: str = "float32") -> C.PairResult:
    p, d = next((p, d) for p, d in get_set(set_name).pairs() if p.cls == cls)
    return C.check_pair(p, d, "cpu", dtype, "quick")


def test_dense_fault_on_the_k_projection_shape_is_caught_and_the_site_named():
    res = check(variant_set("verdict_dense_kv_shape", "dense", dense_kv_shape_fault), "dense")
    fm = res.first_mismatch
    assert res.sites == "q,k,v,o" and fm is not None
    assert fm["site"] == "k" and fm["M"] == 2 and fm["row"] == 0 and fm["call_rows"] >= 2 and fm["ulp"] == 1, fm
    # the q-shaped site (the only one an operand-shape-blind check fed) keeps its bytes; k and v share the shape
    assert res.by_site["q"][1] == 0 and res.by_site["o"][1] == 0
    assert res.by_site["k"][1] > 0 and res.by_site["v"][1] > 0
    row = res.to_row()
    md = contract_report.render_md({"section": "contract", "sweep": "quick", "rows": [row], "coverage": [], "uncovered": []})
    line = [ln for ln in md.splitlines() if ln.startswith("| verdict_dense_kv_shape")][-1]   # the mismatch table
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[3:5] == ["dense", "k"] and cells[6] == "2" and cells[9] == str(fm["call_rows"]), cells
    n = res.by_site["q"][0]
    assert (f"dense (verdict_dense_kv_shape float32): q 0/{n}, k {res.by_site['k'][1]}/{n}, "
            f"v {res.by_site['v'][1]}/{n}, o 0/{n}") in md


def test_rmsnorm_fault_on_kv_head_rows_is_caught_and_the_site_named():
    res = check(variant_set("verdict_rmsnorm_kv_rows", "rmsnorm", rmsnorm_kv_rows_fault), "rmsnorm", "bfloat16")
    fm = res.first_mismatch
    assert fm is not None and fm["site"] == "k_norm" and fm["row"] == 0, fm
    assert {s for s, (_, bad) in res.by_site.items() if bad} == {"k_norm"}, res.by_site


@pytest.mark.parametrize("cls", ["dense", "rmsnorm", "expert_down"])
def test_identical_copy_raises_nothing_at_any_site(cls):
    res = check(variant_set("verdict_copy"), cls)
    assert res.mismatches == 0 and res.first_mismatch is None
    assert set(res.by_site) == set(cc.class_sites(cls)) and all(n > 0 for n, _ in res.by_site.values())


# ------------------------------------------------------------------------------------------------- streams

STREAMS = {"profile": "test", "preset": "tiny", "device": "cpu", "dtype": "bfloat16", "prompts": ["short"],
           "prompt_max_tokens": 24, "steps": [16], "gen_tokens": 5, "deep_threshold": 512, "mtp_k": 2,
           "drafts": ["self"], "stream_counts": [2], "stream_prompt_tokens": 20}


def lm_head_lower_min(x, w):
    """Fault: the invariant lm_head, but in calls of more than one row each row's smallest logit goes one ULP
    down: the argmax (the token) cannot change, the logits bytes do."""
    out = get_set("invariant").fn("lm_head", "decode")(x, w)
    if x.shape[0] > 1:
        out = out.clone()
        i = out.argmin(dim=1, keepdim=True)
        out.scatter_(1, i, torch.nextafter(out.gather(1, i), torch.tensor(float("-inf"))))
    return out


def rope_kv_rows_fault(x, positions, theta):
    """Fault: the invariant RoPE, but calls of more than one row on kv-head rows come out one ULP off on row 0:
    the key written to the KV cache at that row's position changes."""
    out = get_set("invariant").fn("rope", "decode")(x, positions, theta)
    return one_ulp_up(out) if x.shape[0] > 1 and x.shape[1] == CFG.n_kv_heads else out


def decode_fault_set(name: str, cls: str, fn) -> str:
    """Register (once) a claims-exact set equal to ``invariant`` except its decode kernel of ``cls``."""
    if name not in KERNEL_SETS:
        table = {c: (s.fn, s.doc) for c, s in get_set("invariant").decode.items()}
        register_set(name, decode={**table, cls: (fn, "planted fault")}, prompt=dict(table), claims_exact=True)
    return name


def drafted_row(weights, ks: str) -> tuple[dict, int]:
    """The drafted row (self drafts, k = 2) of set ``ks`` on the short prompt, and the prompt's length P."""
    from exactness.analysis import streams as S
    from exactness.prompts import build_prompt

    p = S.section_params({**STREAMS, "kernel_sets": [ks]})
    pr = build_prompt("short", p.prompt_max_tokens)
    step = S.prompt_step(p.steps[0], pr.n_tokens)
    plain = S.plain_runs(weights, pr, ks, p, step)
    return S.drafted_rows(weights, pr, ks, plain, p, step)[0], pr.n_tokens


def test_drafted_logits_fault_with_equal_tokens_is_caught(tiny_weights):
    row, P = drafted_row(tiny_weights, variant_set("verdict_lm_head_min", "lm_head", lm_head_lower_min))
    assert row["first_divergence"] is None and row["drafted_hash"] == row["plain_hash"]   # the tokens agree
    assert row["equal"] is False and row["failed"] == ["logits"] and row["compared"] == ["tokens", "logits", "kv"]
    assert row["first_logits_row_diff"] == 1 and row["proposed"] > 0   # row 0 comes from the shared prefill
    from exactness.analysis import streams as S
    md = streams_report.render_md({"drafted": [row], "resumed": [], "concurrent": [], "settings": {}})
    assert "| logits " in md.split("### drafted == plain")[1].split("###")[0]


def test_drafted_kv_fault_is_caught_at_the_first_verified_position(tiny_weights):
    row, P = drafted_row(tiny_weights, variant_set("verdict_rope_kv", "rope", rope_kv_rows_fault))
    assert row["equal"] is False and "kv" in row["failed"] and row["first_kv_position_diff"] == P, row
    assert ("tokens" in row["failed"]) == (row["first_divergence"] is not None)


def test_drafted_identical_copy_is_equal(tiny_weights):
    row, _ = drafted_row(tiny_weights, variant_set("verdict_copy"))
    assert row["equal"] is True and row["failed"] == [] and row["first_kv_position_diff"] is None


def concurrent_row(weights, ks: str) -> tuple[dict, list[int]]:
    from exactness.analysis import streams as S
    from exactness.prompts import build_prompt

    p = S.section_params({**STREAMS, "kernel_sets": [ks], "prompts": ["code", "docs"]})
    prompts = [build_prompt(n, p.prompt_max_tokens) for n in p.prompts]
    lengths = [int(ids.numel()) for _, ids in S.stream_prompts(prompts, 2, p.stream_prompt_tokens)]
    return S.concurrent_rows(weights, prompts, ks, p)[0], lengths


def test_concurrent_kv_fault_is_caught_where_it_acts(tiny_weights):
    """Decode RoPE of kv-head rows one ULP off on row 0 of calls of more than one row: stream 0 decodes alone for
    steps 0-1 and stream 1 joins at step 2, so the key stream 0 writes at position P0 + 2 (its token 2, fed at step
    2 in a two-row forward) is the first to differ; stream 1 sits in row 1 and keeps its KV bytes."""
    row, (p0, _) = concurrent_row(tiny_weights, decode_fault_set("verdict_decode_rope_kv", "rope",
                                                                 rope_kv_rows_fault))
    assert row["equal"] is False and "kv" in row["failed"] and "kv" in row["failed_vs"]["alone"]
    assert row["first_kv_diff_alone"] == [p0 + 2, None], row["first_kv_diff_alone"]


def test_concurrent_identical_copy_is_equal(tiny_weights):
    row, _ = concurrent_row(tiny_weights, variant_set("verdict_copy"))
    assert row["equal"] is True and row["failed"] == [] and row["first_kv_diff_alone"] == [None, None]


# -------------------------------------------------------------------------------------------------- hashes

def hash_rows(weights, ks: str) -> list[dict]:
    from exactness.analysis import hashes as H
    from exactness.prompts import build_prompt

    return H.run_prompt(weights, build_prompt("short", 24), [ks], [16], 5, 512)


def differ_section(md: str) -> str:
    return md.split("### Runs that differ from the oracle")[1].split("###")[0]


def test_runs_with_equal_tokens_but_other_prompt_logits_are_listed(tiny_weights):
    from exactness.analysis import hashes_report as HR

    rows = hash_rows(tiny_weights, variant_set("verdict_lm_head_min", "lm_head", lm_head_lower_min))
    batched = next(r for r in rows if r["path"] == "batched")
    assert batched["equals_oracle"] is True and batched["prompt_logits_equal"] is False   # the planted fault
    assert batched["first_differing_prompt_row"] == 0 and batched["kv_equal"] is True
    part = differ_section(HR.render_md({"rows": rows}))
    line = next(ln for ln in part.splitlines() if "| batched@16 " in ln)
    assert "| prompt logits " in line and "prompt row 0" in line and "token" not in line, line


def test_runs_whose_kv_bytes_differ_are_listed_with_position_and_layer_when_recorded(tiny_weights):
    from exactness.analysis import hashes_report as HR

    rows = hash_rows(tiny_weights, variant_set("verdict_rope_kv", "rope", rope_kv_rows_fault))
    batched = next(r for r in rows if r["path"] == "batched")
    assert batched["kv_equal"] is False
    line = next(ln for ln in differ_section(HR.render_md({"rows": rows})).splitlines() if "| batched@16 " in ln)
    assert "KV" in line, line
    # hashes.py records no KV position or layer yet: they are rendered when a row carries them
    rows = [dict(r, kv_first_position=0, kv_first_layer=1) if r is batched else r for r in rows]
    line = next(ln for ln in differ_section(HR.render_md({"rows": rows})).splitlines() if "| batched@16 " in ln)
    assert "KV position 0 layer 1" in line, line


def test_hashes_identical_copy_lists_no_run(tiny_weights):
    from exactness.analysis import hashes_report as HR

    rows = hash_rows(tiny_weights, variant_set("verdict_copy"))
    assert "_Every run equals its oracle._" in differ_section(HR.render_md({"rows": rows}))


# ---------------------------------------------------------------------------------------------------- fp64

FP64_FAULT_ROW = 9   # a call row index: position 9 of a 16-row first chunk; the 8-row tail chunk has no row 9


def lm_head_row9_fault(x, w):
    """Fault: the invariant lm_head, but calls of more than FP64_FAULT_ROW rows scale row FP64_FAULT_ROW by
    1 + 2^-6 (a few bf16 ULPs: the taps keep logits rounded to the storage dtype); logits feed nothing else in a
    prefill, so the fault stays at its position."""
    out = get_set("invariant").fn("lm_head", "decode")(x, w)
    if x.shape[0] > FP64_FAULT_ROW:
        out = out.clone()
        out[FP64_FAULT_ROW] *= 1 + 2 ** -6
    return out


def fp64_rows(ks: str, extra=()) -> tuple[list[dict], str]:
    from exactness.analysis.fp64 import section as fp64
    from exactness.profiles import get_profile

    p = get_profile("ci").parameters()
    p.update(prompts=["short"], fp64_tokens=24, steps=[16], deep_threshold=16, fp64_rows=4, fp64_cert=2,
             fp64_synthetic=False, kernel_sets=[ks])
    sec = fp64.run_section(p, extra_positions=extra)
    rows = [r for r in sec["rows"] if r["class"] == "lm_head" and r["path"] != "decode"]
    return rows, fp64_report.verdict_md(sec["rows"])


def test_fp64_judges_the_extra_positions_it_is_given():
    ks = variant_set("verdict_lm_head_row9", "lm_head", lm_head_row9_fault)
    blind, md = fp64_rows(ks)
    assert [r["sampled"]["position_list"] for r in blind] == [[0, 8, 15, 23]] * 2
    assert [r["verdict"] for r in blind] == ["exact", "exact"]   # the fault sits between the sampled rows
    assert "positions 0, 8, 15, 23 only" in md
    rows, md = fp64_rows(ks, extra=[FP64_FAULT_ROW])
    assert [r["sampled"]["position_list"] for r in rows] == [[0, 8, 9, 15, 23]] * 2
    assert all(r["verdict"] != "exact" and r["bitwise_equal_share"] < 1.0 for r in rows), rows
    assert "extra positions asked for: 9" in md


def test_fp64_identical_copy_is_exact_at_the_extra_positions():
    rows, _ = fp64_rows(variant_set("verdict_copy"), extra=[FP64_FAULT_ROW])
    assert [r["verdict"] for r in rows] == ["exact", "exact"]


def test_fp64_extra_position_outside_the_prompt_is_refused():
    with pytest.raises(ValueError, match=r"extra fp64 positions \[24\] are not ints in 0\.\.23"):
        fp64_rows("invariant", extra=[24])


# ----------------------------------------------------------------------------------------- importable sets

def test_importable_sets_resolve_and_are_validated():
    from exactness.params import ContractParams, ParamError, check_common

    assert get_set("verdict_sets:COPY").name == "helper_copy"
    assert get_set("verdict_sets:dense_row0_fault") is get_set("verdict_sets:dense_row0_fault")   # resolved once
    check_common({"kernel_sets": ["invariant", "verdict_sets:COPY", "verdict_sets:dense_row0_fault"]})
    for ref, why in (("verdict_sets:MISSING", "has no attribute 'MISSING'"),
                     ("no_such_module_xyz:SET", "cannot import module 'no_such_module_xyz'"),
                     ("verdict_sets:NOT_A_SET", "gives a int, not a KernelSet"),
                     ("verdict_sets:not_a_set", "gives a str, not a KernelSet")):
        with pytest.raises(ParamError, match=f"kernel_sets: '{ref}' is not allowed: .*{why}"):
            check_common({"kernel_sets": ["invariant", ref]})
        with pytest.raises(ParamError, match=ref):
            ContractParams.from_dict({"kernel_sets": [ref]})
    with pytest.raises(ParamError, match="package.module:ATTR"):
        check_common({"kernel_sets": ["fastest"]})


def test_importable_sets_run_in_the_contract_section():
    """The planted fault of a set defined in a helper module is caught and named; its identical copy is clean."""
    sec = C.run_section({"preset": "tiny", "device": "cpu", "dtype": "float32", "contract_dtypes": ["float32"],
                         "kernel_sets": ["verdict_sets:dense_row0_fault", "verdict_sets:COPY"],
                         "contract_classes": ["dense"], "contract_sweep": "quick", "contract_offload": False})
    rows = {r["set"]: r for r in sec["rows"]}
    assert set(rows) == {"helper_dense_row0", "helper_copy"}
    fm = rows["helper_dense_row0"]["first_mismatch"]
    assert fm["site"] == "q" and fm["M"] == 2 and fm["row"] == 0 and fm["element"] == 0 and fm["ulp"] == 1, fm
    assert rows["helper_copy"]["mismatches"] == 0
    assert {c["set"] for c in sec["coverage"] if c["status"] == "checked"} == set(rows)
