"""The kernel-contract checker (analysis/contract/check.py): ULP arithmetic, planted faults it must catch and locate, the
fast set's real mismatches, the invariant set's zero mismatches, coverage and rendering.

Each planted fault is a kernel set registered under a test-only name whose prompt kernel of one class is perturbed
(decode kernels and the other classes are the invariant set's). Locations are checked two ways: against what the
fault and the public plan predict, and against ``brute_first``, an independent row-by-row re-derivation.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
import pytest

from exactness.analysis.contract import check as C
from exactness.analysis.contract import cases as cc
from exactness.analysis.contract import combine, report as contract_report
from exactness.analysis.contract.inputs import KV_SITES
from exactness.exact import as_int
from exactness.kernels import KERNEL_CLASSES, KERNEL_SETS, attention, dense, get_set, norm, register_set

ROOT = Path(__file__).resolve().parents[1]
CHEAP = tuple(c for c in KERNEL_CLASSES if c != "attention")
INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32}  # brute_first's own: it shares no code with exact.py


# ------------------------------------------------------------------------------------------------- ULP distance

def test_value_ulps_neighbours_and_zero():
    one_bf = torch.tensor(1.0, dtype=torch.bfloat16)
    nxt_bf = (as_int(one_bf) + 1).view(torch.bfloat16)
    assert C.value_ulps(1.0, nxt_bf.item(), torch.bfloat16) == 1
    nxt32 = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    assert C.value_ulps(1.0, nxt32, torch.float32) == 1
    assert C.value_ulps(0.0, -0.0, torch.float32) == 0
    tiny = torch.tensor(1, dtype=torch.int32).view(torch.float32).item()   # smallest subnormal
    assert C.value_ulps(tiny, -tiny, torch.float32) == 2
    assert C.value_ulps(1.0, 2.0, torch.bfloat16) == 128                    # 7 stored fraction bits
    assert C.value_ulps(float("nan"), 1.0, torch.float32) is None
    assert C.value_ulps(1, 2, torch.int64) is None
    # lm_head's fp32 logits of a bf16 run are widened bf16 values: their ULPs are counted in bf16
    assert C._ulp_format(torch.float32, torch.bfloat16, 1.0, nxt_bf.item()) == torch.bfloat16
    assert C._ulp_format(torch.float32, torch.float32, 1.0, nxt32) == torch.float32
    assert C._ulp_format(torch.int64, torch.bfloat16, 1, 2) is None


# -------------------------------------------------------------------------------------------- planted faults

def fault_set(name: str, cls: str, fn) -> str:
    """Register (once) a set equal to ``invariant`` except for the prompt kernel of ``cls``."""
    if name not in KERNEL_SETS:
        inv = get_set("invariant")
        table = {c: (s.fn, s.doc) for c, s in inv.decode.items()}
        register_set(name, decode=dict(table), prompt={**table, cls: (fn, "planted fault")}, claims_exact=True)
    return name


SPLIT_K_ABOVE = 37


def dense_split_k(x, w):
    """Fault: with more than SPLIT_K_ABOVE rows in the call, reduce K in two halves in fp32 and add them."""
    if x.shape[0] <= SPLIT_K_ABOVE:
        return dense.tile_linear(x, w)
    h = x.shape[1] // 2
    return (F.linear(x[:, :h].float(), w[:, :h].float()) + F.linear(x[:, h:].float(), w[:, h:].float())).to(x.dtype)


FLIP_CALL_ROWS, FLIP_ROW, FLIP_ELEMENT = 45, 3, 5


def rmsnorm_flip(x, w, eps):
    """Fault: in calls of exactly FLIP_CALL_ROWS rows, one ULP up on element FLIP_ELEMENT of call row FLIP_ROW."""
    out = norm.rmsnorm_invariant(x, w, eps)
    if x.shape[0] == FLIP_CALL_ROWS:
        out = out.clone()
        as_int(out)[FLIP_ROW].view(-1)[FLIP_ELEMENT] += 1
    return out


def attention_kv128(q, k_cache, v_cache, slots, positions):
    """Fault: online softmax over 128-key blocks instead of the decode kernel's KV_BLOCK = 256."""
    old = attention.KV_BLOCK
    attention.KV_BLOCK = 128
    try:
        return attention.attention_invariant(q, k_cache, v_cache, slots, positions)
    finally:
        attention.KV_BLOCK = old


def brute_walk(cls: str, sweep: str):
    """(role, case, site, source, kv_dtype) in the checker's documented order (check.py, cases.py): the plan's cases
    with the prompt kernel, then those of M in DECODE_M with the decode kernel; per case every call site
    (class_sites order), per site every input source (SOURCES order), leaving out RANDOM_ONLY pairs and, in the quick
    sweep, cases past the site's QUICK_BOUNDS; a site with several KV formats feeds format (M + T // 2) mod their
    count."""
    cases = cc.plan(cls, sweep)
    runs = [("prompt", c) for c in cases] + [("decode", c) for c in cases if c.M in cc.DECODE_M]
    for role, case in runs:
        for site in cc.class_sites(cls):
            bound = cc.QUICK_BOUNDS.get(site) if sweep == "quick" else None   # (Case field, largest value)
            if bound and (getattr(case, bound[0]) or 0) > bound[1]:
                continue
            formats = KV_SITES[site] if cls == "attention" else (None,)
            kv_dtype = formats[(case.M + (case.kv_len or 0) // 2) % len(formats)]
            for source in (s for s in cc.SOURCES if (site, s) not in C.RANDOM_ONLY):
                yield role, case, site, source, kv_dtype


def brute_first(ks_name: str, cls: str, dtype: str, sweep: str) -> dict | None:
    """Independent re-derivation of the first mismatch: walk the plan as brute_walk orders it, call the kernel of
    the role per segment and the decode kernel per row, compare each row's outputs as integers, element by
    element."""
    ks, dt = get_set(ks_name), getattr(torch, dtype)
    fns = {role: ks.fn(cls, role) for role in ("prompt", "decode")}
    d_fn = fns["decode"]
    as_tuple = lambda o: tuple(o) if isinstance(o, tuple) else (o,)  # noqa: E731
    as_int = lambda t: t.view(INT[t.dtype]) if t.dtype in INT else t  # noqa: E731
    for role, case, site, source, kv_dtype in brute_walk(cls, sweep):
        pool, row0 = cc.make_pool(cls, source, dt, "cpu", "tiny", site, kv_dtype=kv_dtype), 0
        for j in range(len(case.variant.segments)):
            lead, real, tail = C.call_layout(case, j)
            outs = as_tuple(fns[role](*pool.args(torch.tensor(lead + real + tail))))
            for r, i in enumerate(real):
                decs = as_tuple(d_fn(*pool.args(torch.tensor([i]))))
                for k, (o, d) in enumerate(zip(outs, decs)):
                    ne = (as_int(o[len(lead) + r].reshape(-1)) != as_int(d[0].reshape(-1))).nonzero()
                    if ne.numel():
                        return {"site": site, "M": case.M, "kv_len": case.kv_len, "role": role,
                                "segmentation": case.variant.label(), "kv_dtype": kv_dtype,
                                "source": source, "row": row0 + r, "output_index": k, "element": int(ne[0])}
            row0 += len(real)
    return None


def same_location(fm: dict, brute: dict, cls: str) -> None:
    names = C.OUTPUT_NAMES.get(cls, ("out",) * 3)
    keys = ("site", "M", "kv_len", "segmentation", "source", "row", "element", "role")
    got = {k: fm.get(k) for k in keys + (("kv_dtype",) if cls == "attention" else ())}
    want = {k: brute[k] for k in got}
    assert got == want and fm["output"] == names[brute["output_index"]], (fm, brute)


def first_call(cls: str, sweep: str, pred):
    """First (case, segment, lead count, segment start) of the plan, in checking order, whose call (lead mates,
    tested pool rows, tail mates; lists of pool row indices) satisfies ``pred(lead, real, tail)``."""
    for case in cc.plan(cls, sweep):
        for j in range(len(case.variant.segments)):
            lead, real, tail = C.call_layout(case, j)
            if pred(lead, real, tail):
                return case, j, len(lead), sum(case.variant.segments[:j])
    raise AssertionError("no call of the plan satisfies the predicate")


def calls_where(cls: str, sweep: str, pred) -> int:
    """Number of calls of the plan satisfying ``pred(lead, real, tail)``."""
    return sum(1 for c in cc.plan(cls, sweep) for j in range(len(c.variant.segments)) if pred(*C.call_layout(c, j)))


def test_planted_split_k_is_caught_at_the_first_call_past_37_rows():
    ks = fault_set("test_fault_dense_split_k", "dense", dense_split_k)
    p, d = get_set(ks).pairs()[KERNEL_CLASSES.index("dense")]
    res = C.check_pair(p, d, "cpu", "float32", "quick", stop_at_first=True)
    fm = res.first_mismatch
    assert res.mismatches > 0 and fm is not None
    case, seg, lead, seg_start = first_call("dense", "quick", lambda a, m, b: len(a + m + b) > SPLIT_K_ABOVE)
    assert (fm["M"], fm["segmentation"], fm["segment"], fm["row"]) == (case.M, case.variant.label(), seg, seg_start)
    assert fm["call_rows"] > SPLIT_K_ABOVE and fm["ulp"] >= 1 and fm["prompt"] != fm["decode"]
    same_location(fm, brute_first(ks, "dense", "float32", "quick"), "dense")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_planted_one_ulp_flip_is_caught_exactly(dtype):
    ks = fault_set("test_fault_rmsnorm_flip", "rmsnorm", rmsnorm_flip)
    p, d = get_set(ks).pairs()[KERNEL_CLASSES.index("rmsnorm")]
    res = C.check_pair(p, d, "cpu", dtype, "quick")
    fm = res.first_mismatch
    flipped = lambda a, m, b: len(a + m + b) == FLIP_CALL_ROWS and len(a) <= FLIP_ROW < len(a + m)  # noqa: E731
    case, seg, lead, seg_start = first_call("rmsnorm", "quick", flipped)
    assert fm["M"] == case.M and fm["segmentation"] == case.variant.label() and fm["source"] == "random"
    assert (fm["row"], fm["element"], fm["ulp"]) == (seg_start + FLIP_ROW - lead, FLIP_ELEMENT, 1)
    assert fm["site"] == cc.class_sites("rmsnorm")[0] and fm["call_rows"] == FLIP_CALL_ROWS
    # every such call flips one element of one tested row, at every call site, in both input sources, and nothing
    # else differs
    n_sites = len(cc.class_sites("rmsnorm"))
    assert n_sites == 5 and res.mismatches == 2 * n_sites * calls_where("rmsnorm", "quick", flipped) > 0
    assert all(bad == 2 * calls_where("rmsnorm", "quick", flipped) for _, bad in res.by_site.values())
    assert res.decode_rows[0] > 0 and res.decode_rows[1] == 0      # the decode kernel at M > 1: clean


def test_planted_kv_block_change_is_caught():
    ks = fault_set("test_fault_attention_kv128", "attention", attention_kv128)
    p, d = get_set(ks).pairs()[KERNEL_CLASSES.index("attention")]
    res = C.check_pair(p, d, "cpu", "float32", "quick", stop_at_first=True)
    fm = res.first_mismatch
    assert fm is not None
    # rows at positions < 128 see one block either way and keep their bytes; the first row at position >= 128
    # (whose keys now span two 128-key blocks) is where the bytes change first
    case, seg, lead, seg_start = first_call("attention", "quick", lambda a, m, b: max(m) >= 128)
    assert (fm["M"], fm["kv_len"], fm["segmentation"]) == (case.M, case.kv_len, case.variant.label())
    assert fm["position"] == max(128, case.start) and fm["row"] == fm["position"] - case.start, fm
    same_location(fm, brute_first(ks, "attention", "float32", "quick"), "attention")


# ------------------------------------------------------------------------------------------------- fast set

@pytest.mark.parametrize("cls", ["dense", "attention"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fast_set_mismatches_are_found_and_located(cls, dtype):
    """The fast set's real mismatches, where this CPU's kernels produce them: whether a prompt row differs from its
    decode row depends on the instruction set torch's kernels use, so the independent walk (brute_first) measures
    first, and the checker must agree with it either way: the same first mismatch, or none. (That the checker can
    fail is shown by the planted faults above, on every machine.)"""
    p, d = get_set("fast").pairs()[KERNEL_CLASSES.index(cls)]
    res = C.check_pair(p, d, "cpu", dtype, "quick", stop_at_first=True)
    brute = brute_first("fast", cls, dtype, "quick")
    if brute is None:
        assert res.mismatches == 0 and res.first_mismatch is None, res.first_mismatch
        return
    assert res.mismatches > 0 and res.first_mismatch is not None
    assert res.first_mismatch["prompt"] != res.first_mismatch["decode"]
    same_location(res.first_mismatch, brute, cls)


# --------------------------------------------------------------------------------------------- invariant set

@pytest.fixture(scope="module")
def invariant_rows():
    """The invariant set's contract rows on CPU, bf16 and fp32, random and captured inputs.

    Reduced to keep CI short: the ten classes other than attention run the ``full`` sweep
    (every M of 1-130, 255-257, 511-513, 1024, 4097 with all segmentations, tile offsets and batch mates);
    attention runs the ``quick`` sweep: two segmentations per M (whole block; a random split with random lead/tail
    mates per call), M and KV length capped at 1026 (KV lengths b-1..b+2 around every 64-row tile boundary up to
    256 and every 256-key block boundary up to 1024). The full attention sweep runs in the receipts
    (``contract_sweep="full"``).
    """
    rows = [r.to_row() for r in C.check_set("invariant", "cpu", ("bfloat16", "float32"), "full", CHEAP)]
    rows += [r.to_row() for r in C.check_set("invariant", "cpu", ("bfloat16", "float32"), "quick", ["attention"])]
    return rows


def test_invariant_set_has_zero_mismatches(invariant_rows):
    assert len(invariant_rows) == 2 * len(KERNEL_CLASSES)
    bad = [(r["class"], r["dtype"], r["mismatches"], r["first_mismatch"]) for r in invariant_rows if r["mismatches"]]
    assert bad == []
    for r in invariant_rows:
        assert r["cases"] > 30_000 and r["inputs"] == "random,captured"
        want = "1-130,255-257,511-513,1024" + ("" if r["class"] == "attention" else ",4097")
        assert r["m_ranges"] == want, r


def test_coverage_lists_every_class_and_marks_missing_ones_uncovered(invariant_rows):
    cov, unc = combine.coverage(invariant_rows, ["invariant"], "cpu", ["bfloat16", "float32"])
    assert {c["class"] for c in cov} == set(KERNEL_CLASSES) and unc == []
    assert all(c["status"] == "checked" and c["cases"] > 0 for c in cov)
    partial = [r for r in invariant_rows if r["class"] != "rope"]
    cov, unc = combine.coverage(partial, ["invariant"], "cpu", ["bfloat16", "float32"])
    assert {c["class"] for c in cov} == set(KERNEL_CLASSES)
    assert [(u["class"], u["dtype"]) for u in unc] == [("rope", "bfloat16"), ("rope", "float32")]
    assert [c["status"] for c in cov if c["class"] == "rope"] == ["uncovered", "uncovered"]


def md_part(md: str, title: str) -> str:
    """The text under the ``### title`` heading of ``md``, up to the next heading."""
    return md.split(f"### {title}\n", 1)[1].split("\n#", 1)[0]


def test_render_md_shows_summary_matrix_and_mismatches(invariant_rows):
    fast = C.check_pair(*get_set("fast").pairs()[0], "cpu", "float32", "quick", stop_at_first=True).to_row()
    rows = invariant_rows + [fast]
    cov, unc = combine.coverage(rows, ["invariant", "fast"], "cpu", ["bfloat16", "float32"])
    md = contract_report.render_md({"section": "contract", "sweep": "quick", "rows": rows, "coverage": cov, "uncovered": unc})
    summary = [ln.replace(" ", "") for ln in md_part(md, "Summary per set").splitlines()
               if ln.startswith("| invariant") or ln.startswith("| fast ")]
    assert "|fast|cpu|float32|bf16|1|" in summary[0] and summary[1].startswith("|invariant|cpu|bfloat16|bf16|11|")
    assert summary[1].endswith("|0|0|") and summary[2].endswith("|0|0|")
    matrix = {ln.split("|")[1].strip(): ln for ln in md_part(md, "Mismatches per class").splitlines()
              if ln.startswith("| ") and ln.split("|")[1].strip() in KERNEL_CLASSES}
    assert set(matrix) == set(KERNEL_CLASSES) and "uncovered" in matrix["router"]  # fast: only dense was checked
    assert "router (fast bfloat16, fast float32: not checked in this run)" in md
    fm = fast["first_mismatch"]
    mismatch = [ln.replace(" ", "") for ln in md_part(md, "First mismatch of each pair").splitlines()
                if ln.startswith("| fast ") and "| dense " in ln]
    assert mismatch == [f"|fast|float32|bf16|dense|{fm['site']}|{fast['mismatches']:,}of{fast['cases']:,}|"
                        f"{fm['M']}|–|{fm['segmentation'].replace(' ', '')}|{fm['call_rows']}|{fm['row']}|out|"
                        f"{fm['element']}|{fm['ulp']}|{fm['prompt']:.9g}|{fm['decode']:.9g}|"]
    assert re.search(r"\| site +\|", md) and re.search(r"\| call rows +\|", md)
    assert len(md) < 14_000   # the section's share of receipt.md (GitHub's 65,536-character comment)


def test_check_set_rejects_unknown_set_and_class():
    with pytest.raises(ValueError, match="known sets: .*fast.*invariant"):
        C.check_set("nonexistent")
    with pytest.raises(ValueError, match="known: dense, router"):
        C.check_set("invariant", classes=["densee"])
    with pytest.raises(ValueError, match="unknown sweep"):
        C.check_set("invariant", sweep="medium")


# ------------------------------------------------------------------------------------ section and notebook

REQUIRED_ROW_KEYS = {"class", "prompt_kernel", "decode_kernel", "set", "device", "dtype", "cases", "mismatches",
                     "first_mismatch", "m_ranges"}


def rows_lookup(rows, seen=None):
    """A stand-in for C.check_set that returns the given contract rows of the set and dtypes asked for (no
    offloaded rows), recording each resident call's (set, device, dtypes, sweep, preset) in ``seen``."""
    def lookup(set_name, device, dtypes, sweep, preset="tiny", classes=None, progress=False, offload=False):
        if offload:
            return []
        if seen is not None:
            seen.append((set_name, device, list(dtypes), sweep, preset))
        return [C.PairResult(cls=r["class"], **{k: v for k, v in r.items() if k != "class"})
                for r in rows if r["set"] == set_name and r["dtype"] in dtypes]
    return lookup


@pytest.fixture
def section(invariant_rows, monkeypatch):
    """run_section over the invariant rows computed above (check_set replaced by a lookup of those rows)."""
    seen = []
    monkeypatch.setattr(C, "check_set", rows_lookup(invariant_rows, seen))
    sec = C.run_section({"profile": "ci", "preset": "tiny", "device": "cpu", "dtype": "float32",
                         "kernel_sets": ["invariant"], "contract_sweep": "quick"})
    assert seen == [("invariant", "cpu", ["float32", "bfloat16"], "quick", "tiny")]  # profile dtype first
    return sec


def test_run_section_rows_and_coverage(section):
    assert section["section"] == "contract" and section["sweep"] == "quick"
    assert len(section["rows"]) == 2 * len(KERNEL_CLASSES)
    assert all(REQUIRED_ROW_KEYS <= set(r) and isinstance(r["mismatches"], int) for r in section["rows"])
    assert len(section["coverage"]) == 2 * len(KERNEL_CLASSES) and section["uncovered"] == []
    assert json.loads(json.dumps(section)) == section


def test_notebook_renders_a_precomputed_section(section, tmp_path):
    papermill = pytest.importorskip("papermill")
    fast = C.check_pair(*get_set("fast").pairs()[0], "cpu", "float32", "quick", stop_at_first=True).to_row()
    section = dict(section, rows=section["rows"] + [fast])
    src, out = tmp_path / "in.json", tmp_path / "out.json"
    src.write_text(json.dumps(section))
    nb = papermill.execute_notebook(str(ROOT / "notebooks" / "20_kernel_contract.ipynb"), str(tmp_path / "20.ipynb"),
                                    parameters={"precomputed_json": str(src), "out_json": str(out)},
                                    kernel_name="exactness", progress_bar=False)
    assert json.loads(out.read_text()) == section
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    texts = "".join(o.get("text", "") + o.get("data", {}).get("text/markdown", "") for o in outs)
    assert "**Parameters:**" in texts and f"rendered from `{src}`" in texts
    assert sum("image/png" in o.get("data", {}) for o in outs) == 1   # the fast set's heatmap


def test_control_sweep_applies_to_sets_that_claim_no_exactness(monkeypatch):
    """contract_control_sweep picks the sweep of the negative-control sets (fast); exact sets keep contract_sweep."""
    seen = []
    monkeypatch.setattr(C, "check_set", lambda s, device, dtypes, sweep, offload=False, **kw:
                        [] if offload else seen.append((s, sweep)) or [])
    sec = C.run_section({"preset": "tiny", "device": "cpu", "dtype": "bfloat16", "kernel_sets": ["fast", "invariant"],
                         "contract_sweep": "full", "contract_control_sweep": "quick"})
    assert seen == [("fast", "quick"), ("invariant", "full")]
    assert sec["sweep"] == "full" and sec["control_sweep"] == "quick"
    assert "sets that claim no exactness: `quick`" in contract_report.render_md(sec)
    with pytest.raises(ValueError):
        C.run_section({"kernel_sets": ["fast"], "contract_control_sweep": "most"})


def test_merge_sections_equals_one_run_and_refuses_overlap(section, invariant_rows, monkeypatch):
    """Contract sections computed per dtype (one device call each) merge into the section of one run over both;
    a (class, set, dtype) in two parts, or parts of another sweep, are refused."""
    monkeypatch.setattr(C, "check_set", rows_lookup(invariant_rows))
    base = {"preset": "tiny", "device": "cpu", "kernel_sets": ["invariant"], "contract_sweep": "quick"}
    parts = [dict(C.run_section({**base, "contract_dtypes": [d]}), provenance={"computed_on": "H200", "command": c})
             for d, c in (("float32", "a"), ("bfloat16", "b"))]
    merged = combine.merge_sections(parts)
    key = lambda r: (r["dtype"], r["class"])  # noqa: E731
    assert sorted(merged.pop("rows"), key=key) == sorted(section["rows"], key=key)
    assert {k: v for k, v in merged.items() if k != "provenance"} == {k: v for k, v in section.items() if k != "rows"}
    assert merged["provenance"]["command"] == "a | b" and merged["provenance"]["computed_on"] == "H200"
    with pytest.raises(ValueError, match="overlap"):
        combine.merge_sections([parts[0], parts[0]])
    with pytest.raises(ValueError, match="sweep"):
        combine.merge_sections([parts[0], dict(parts[1], sweep="full")])
    with pytest.raises(ValueError, match="two or more"):
        combine.merge_sections([parts[0]])


def test_merge_command_joins_contract_parts_and_refuses_mixed_kinds(invariant_rows, monkeypatch, tmp_path, capsys):
    from exactness.receipt.cli import main
    monkeypatch.setattr(C, "check_set", rows_lookup(invariant_rows))
    files = []
    for d in ("float32", "bfloat16"):
        files.append(tmp_path / f"{d}.json")
        files[-1].write_text(json.dumps(C.run_section({"preset": "tiny", "device": "cpu", "kernel_sets": ["invariant"],
                                                       "contract_sweep": "quick", "contract_dtypes": [d]})))
    out = tmp_path / "contract.json"
    assert main(["merge", "--out", str(out), *map(str, files)]) == 0
    assert json.loads(out.read_text()) == combine.merge_sections([json.loads(f.read_text()) for f in files])
    (tmp_path / "bench.json").write_text(json.dumps({"section": "bench", "data": {}}))
    assert main(["merge", "--out", str(tmp_path / "x.json"), str(files[0]), str(tmp_path / "bench.json")]) == 2
    assert "one section" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
    merged = json.loads(out.read_text())
    merged["offload_rows"] = [dict(merged["rows"][0], weights="offloaded")]   # rows with and without weights
    (tmp_path / "m.json").write_text(json.dumps(merged))
    assert main(["merge", "--out", str(tmp_path / "x.json"), str(tmp_path / "m.json"), str(tmp_path / "m.json")]) == 2
    assert "overlap in (class, set, dtype, weights)" in capsys.readouterr().err
    assert main(["merge", "--out", str(tmp_path / "x.json"), str(files[0]), str(tmp_path / "missing.json")]) == 2
    assert "cannot read section part" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


# ------------------------------------------------------------------------------------- offloaded expert weights

@pytest.mark.parametrize("cls", cc.OFFLOAD_CLASSES)
def test_offloaded_expert_weights_keep_the_contract(cls):
    """Prompt calls with weights from the expert ring (behind a decoy) equal decode references fetched
    synchronously, for the invariant set; the ring really served every prompt call."""
    p, d = get_set("invariant").pairs()[KERNEL_CLASSES.index(cls)]
    res = C.check_pair(p, d, "cpu", "bfloat16", "quick", offload=True)
    assert res.weights == "offloaded" and res.mismatches == 0, res
    fed = [c for c in cc.plan(cls, "quick") if cc.fed(c, res.sites, "quick", offload=True)]   # the quick sweep's cut
    assert fed and len(fed) < len(cc.plan(cls, "quick"))
    assert_every_row_compared(res, fed)
    short = copy.deepcopy(res)                  # control: one row of the last bucket left uncompared
    short.buckets[list(short.buckets)[-1]][0] -= 1
    short.cases -= 1
    with pytest.raises(AssertionError):
        assert_every_row_compared(short, fed)


def assert_every_row_compared(res, plan) -> None:
    """Every row of every planned case (and of the decode plan's) was compared once per (call site, input source), in
    every call-size bucket the plan reaches: the property a case count stands for, whatever the sweep holds."""
    per_case = len(res.sites.split(",")) * len(res.inputs.split(","))
    want: dict[str, int] = {}
    for c in plan + [c for c in plan if c.M in cc.DECODE_M]:
        want[cc.bucket(c.M)] = want.get(cc.bucket(c.M), 0) + c.M * per_case
    assert {b: n for b, (n, _) in res.buckets.items()} == want and res.cases == sum(want.values()) > 0, res
    assert sum(n for n, _ in res.by_site.values()) == res.cases and res.m_ranges == cc.ranges(c.M for c in plan)


def _ring_hands_out(monkeypatch, which: str):
    """Plant a ring fault in ring.StagedWeights: ``decoy`` -- the weights' copy never lands, so the kernel
    reads the decoy left in the slot; ``flip`` -- the staged copy has one element one ULP off."""
    from exactness import ring
    original = ring.StagedWeights.__init__

    def planted(self, tensors, more=()):
        original(self, tensors, more)
        if which == "decoy":
            self.ring.source = lambda key: self.decoys[key[2]]
        else:
            bad = [tuple(t.clone() for t in unit) for unit in self.units]
            for unit in bad:
                as_int(unit[0]).view(-1)[5] += 1
            self.ring.source = lambda key: self.decoys[key[2]] if key[1] == "decoy" else bad[key[2]]
    monkeypatch.setattr(ring.StagedWeights, "__init__", planted)


@pytest.mark.parametrize("which", ["decoy", "flip"])
def test_offload_check_catches_a_faulty_ring(monkeypatch, which):
    _ring_hands_out(monkeypatch, which)
    p, d = get_set("invariant").pairs()[KERNEL_CLASSES.index("expert_down")]
    res = C.check_pair(p, d, "cpu", "float32", "quick", stop_at_first=True, offload=True)
    fm = res.first_mismatch
    assert res.mismatches > 0 and fm is not None and fm["prompt"] != fm["decode"], fm
    if which == "decoy":  # negated weights: the very first prompt call differs
        assert (fm["M"], fm["row"]) == (1, 0)
    else:   # w_down [H, I] element 5 feeds output element 0 only (and moves its rounding only for some rows)
        assert fm["element"] == 0 and fm["ulp"] >= 1


def test_offload_is_refused_for_classes_whose_weights_stay(monkeypatch):
    p, d = get_set("invariant").pairs()[KERNEL_CLASSES.index("dense")]
    with pytest.raises(ValueError, match="offload moves the weights of expert_gate_up, expert_down only"):
        C.check_pair(p, d, "cpu", "float32", "quick", offload=True)
    rows = [r.to_row() for r in C.check_set("invariant", "cpu", ("float32",), "quick", ["dense", "expert_down"],
                                             offload=True)]
    assert [(r["class"], r["weights"]) for r in rows] == [("expert_down", "offloaded")]


def test_section_carries_offload_rows_and_renders_them(monkeypatch):
    def fake(s, device, dtypes, sweep, offload=False, **kw):
        cls = ("expert_down",) if offload else ("dense",)
        return [C.PairResult(c, "p", "d", s, device, dt, cases=3, mismatches=int(offload),
                             weights="offloaded" if offload else "resident") for c in cls for dt in dtypes]
    monkeypatch.setattr(C, "check_set", fake)
    sec = C.run_section({"preset": "tiny", "device": "cpu", "dtype": "float32", "kernel_sets": ["invariant"],
                         "contract_dtypes": ["float32"]})
    assert [r["weights"] for r in sec["rows"]] == ["resident"] and len(sec["offload_rows"]) == 1
    md = re.sub(" +", " ", contract_report.render_md(sec))
    assert "| invariant | float32 | expert_down | 1 of 3 |" in md_part(md, "Expert weights offloaded")
    off = C.run_section({"preset": "tiny", "device": "cpu", "dtype": "float32", "kernel_sets": ["invariant"],
                         "contract_dtypes": ["float32"], "contract_offload": False})
    off_md = re.sub(" +", " ", contract_report.render_md(off))
    assert off["offload_rows"] == [] and "1 of 3" not in off_md
    assert md_part(off_md, "Expert weights offloaded").strip() == "_Not checked in this run (contract_offload is off)._"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.dtype]) if t.dtype in INT else t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("set_name", ["invariant", "fast"])
def test_gpu_decode_refs_replayed_from_graphs_equal_eager_calls(set_name, monkeypatch):
    """Each class's decode references replayed from a CUDA graph of one-row calls (contract/refs.py) equal eager
    one-row calls byte for byte (runs of one row, of more rows than a replay holds, and a partial replay); every
    invariant class replays. Negative control: lanes left pointing at old rows leave the new rows uncomputed."""
    from exactness.analysis.contract import refs as R
    pairs = [(p, d) for p, d in get_set(set_name).pairs() if p.cls in cc.ADAPTED]
    routes = {}
    for p, d in pairs:
        pool = cc.make_pool(p.cls, "random", torch.bfloat16, "cuda", "tiny")
        graph, eager = R.DecodeRefs(d.fn, pool), R.DecodeRefs(d.fn, pool)
        eager.route = "eager: the test's reference"
        for start, M in ((5, 1), (7, 70), (100, 33)):
            for g, e in zip(graph.get(start, M), eager.get(start, M)):
                assert torch.equal(_bits(g), _bits(e)), (p.cls, start, M, graph.route)
        routes[p.cls] = graph.route
    print(set_name, routes)
    if set_name == "invariant":
        assert set(routes.values()) == {"graph"}, routes
    replayed = [(p, d) for p, d in pairs if routes[p.cls] == "graph"]
    assert replayed
    monkeypatch.setattr(R.DecodeRefs, "_aim", lambda self, c, b: None)   # the planted fault: stale lanes
    p, d = replayed[0]
    pool = cc.make_pool(p.cls, "random", torch.bfloat16, "cuda", "tiny")
    stale, eager = R.DecodeRefs(d.fn, pool), R.DecodeRefs(d.fn, pool)
    eager.route = "eager: the test's reference"
    assert not all(torch.equal(_bits(g), _bits(e)) for g, e in zip(stale.get(7, 70), eager.get(7, 70)))


def test_decode_refs_fetch_once_per_get_and_call_each_row_once_alone():
    """DecodeRefs (contract/refs.py), off CUDA: one fetch of the pool's fixed args per ``get``, each row's reference
    from one call of one row, the same bytes as references of a fresh DecodeRefs; a row never computed reads NaN."""
    from exactness.analysis.contract import refs as R
    pool = cc.make_pool("rmsnorm", "random", torch.bfloat16, "cpu", "tiny")
    fetches, rows = [], []
    staged = dataclasses.replace(pool, stage=lambda route: fetches.append(route) or pool.fixed)
    dec = next(d for p, d in get_set("invariant").pairs() if p.cls == "rmsnorm")
    refs = R.DecodeRefs(lambda *a, **k: rows.append(a[0].shape[0]) or dec.fn(*a, **k), staged)
    assert refs.route == "eager: not on CUDA"
    refs.get(3, 5)
    got = refs.get(5, 6)                                   # rows 5..10: 8..10 are new
    assert fetches == ["sync", "sync"] and rows == [1] * 8
    fresh = R.DecodeRefs(dec.fn, pool).get(3, 8)
    assert torch.equal(got[0].view(torch.int16), fresh[0][2:].view(torch.int16))
    assert torch.isnan(refs.refs[0][11:].float()).all() and not torch.isnan(got[0].float()).any()
    assert R._runs([1, 2, 3, 7, 9, 10]) == [(1, 4), (7, 8), (9, 11)]


def test_host_copies_are_shared_within_a_run_only():
    """alternatives.offloaded: within sharing_host_copies (run_section) the sets share one host copy of a site's
    pools; outside it every call makes its own, so a fault planted in ring.StagedWeights reaches the next check."""
    from exactness.analysis.contract import alternatives as A
    pools = A.alternatives("expert_down", "random", torch.bfloat16, "cpu", "tiny", "routed", experts=True)
    copies = lambda: A.offloaded(pools)[0].stage.func.__self__          # the ring.StagedWeights behind the pools
    with A.sharing_host_copies():
        assert copies() is copies()
    assert copies() is not copies()


# ------------------------------------------------------------------------------- invariant attention: tiles per call

def test_invariant_attention_tiles_sharing_a_call_give_each_row_its_own_call_bytes(monkeypatch):
    """attention_invariant attends runs of tiles that need as many key blocks in one call (_tile_groups): every
    row's bytes equal those of the same call run one tile at a time (no sharing); the run did share calls. Control:
    a grouping that gives every tile the first tile's block count (a run across block counts) is caught."""
    torch.manual_seed(0)
    P, Hkv, g, D = 600, 2, 2, 16                                                # 75 tiles over 1, 2 and 3 blocks
    kc, vc = torch.randn(2, 1, P, Hkv, D).bfloat16()                          # [S=1, T, Hkv, D] each
    q = torch.randn(P, Hkv * g, D).bfloat16()
    slots, pos = torch.zeros(P, dtype=torch.int64), torch.arange(P)
    calls = []
    real = attention._attend_tiles
    monkeypatch.setattr(attention, "_attend_tiles", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    shared = attention.attention_invariant(q, kc, vc, slots, pos)
    assert len(calls) < P // attention.ATT_ROWS and sum(calls) == P
    monkeypatch.setattr(attention, "ATT_BATCH_BYTES", 0)                      # one tile per call
    alone = attention.attention_invariant(q, kc, vc, slots, pos)
    assert torch.equal(as_int(shared), as_int(alone))
    monkeypatch.setattr(attention, "_tile_groups", lambda p, *_: iter([(0, p.numel(), 1)]))
    fault = attention.attention_invariant(q, kc, vc, slots, pos)
    differ = (as_int(fault) != as_int(alone)).flatten(1).any(dim=1)
    assert not differ[:attention.KV_BLOCK].any() and differ[attention.KV_BLOCK:].all()
