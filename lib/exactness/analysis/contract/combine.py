"""Coverage of contract rows (every kernel class x set x dtype, and the quantized-weights classes per format) and
the merge of contract sections computed in separate calls."""
from __future__ import annotations

from ...kernels import KERNEL_CLASSES, KERNEL_SETS
from ..merge import joined_records
from .cases import ADAPTED
from ...kernels.registry import QUANT_CLASSES


def _format(r: dict) -> str:
    return r.get("weights_format") or "bf16"


def coverage(rows: list[dict], set_names, device: str, dtypes,
             weight_formats=("bf16",)) -> tuple[list[dict], list[dict]]:
    """Coverage table: one entry per class of KERNEL_CLASSES x set x dtype on bf16 weights, and per QUANT_CLASSES
    class x set x dtype for each quantized format of ``weight_formats``, from contract rows (``to_row``).

    Returns (coverage, uncovered): coverage entries carry class, set, prompt_kernel, decode_kernel, m_ranges,
    kv_lengths, sites (the call sites checked, comma-separated), dtype, device, cases, weights_format and status
    ("checked" or "uncovered"); uncovered lists those not checked.
    """
    have = {(r["class"], r["set"], r["dtype"], _format(r)): r for r in rows}
    cov, unc = [], []
    for fmt in dict.fromkeys(["bf16", *weight_formats]):
        if fmt != "bf16" and fmt not in weight_formats:
            continue
        classes = [c for c in KERNEL_CLASSES if fmt == "bf16" or c in QUANT_CLASSES]
        for s in set_names:
            ks = KERNEL_SETS.get(s)
            for d in dtypes:
                for c in classes:
                    _cover(cov, unc, have.get((c, s, d, fmt)), c, s, d, fmt, device, ks)
    return cov, unc


def _cover(cov: list, unc: list, r: dict | None, c: str, s: str, d: str, fmt: str, device: str, ks) -> None:
    """Append the coverage entry of (class c, set s, dtype d, format fmt): checked by row ``r``, or uncovered."""
    if r is None:
        why = ("no registered pair" if ks is None or c not in ks.prompt else
               "no input builder" if c not in ADAPTED else "not checked in this run")
        unc.append({"class": c, "set": s, "dtype": d, "device": device, "reason": why, "weights_format": fmt})
        cov.append({"class": c, "set": s, "prompt_kernel": None, "decode_kernel": None, "m_ranges": "",
                    "kv_lengths": "", "sites": "", "dtype": d, "device": device, "cases": 0,
                    "status": "uncovered", "weights_format": fmt})
        return
    cov.append({k: r[k] for k in ("class", "set", "prompt_kernel", "decode_kernel", "m_ranges",
                                  "kv_lengths", "dtype", "device", "cases")}
               | {"sites": r.get("sites", ""), "status": "checked", "weights_format": fmt})


MERGE_SAME = ("sweep", "control_sweep", "preset", "router_groups")


def merge_sections(parts: list[dict]) -> dict:
    """One contract section from sections computed in separate calls (e.g. ``--param 'kernel_sets=[invariant]'`` and
    ``[fast]``, or one dtype each, so that a device call's time limit cuts off at most one part): rows concatenated
    in the given order, coverage and uncovered recomputed over the union of the parts' sets and dtypes, provenance
    joined field by field. Every pair's check depends only on its own inputs (seeded pools), so the merge equals one
    run.

    Raises:
        ValueError: fewer than two parts, a part that is not a contract section, parts that differ in sweep,
            control_sweep, preset or device (names the field and both values), or a (class, set, dtype) present in
            two parts.
    """
    if len(parts) < 2 or any(not isinstance(q, dict) or q.get("section") != "contract" for q in parts):
        raise ValueError(f"merging needs two or more contract sections, got {len(parts)} part(s)")
    for q in parts[1:]:
        for key in MERGE_SAME:
            if q.get(key) != parts[0].get(key):
                raise ValueError(f"contract sections differ in {key}: {parts[0].get(key)!r} vs {q.get(key)!r}")
    devices = list(dict.fromkeys(c["device"] for q in parts for c in q["coverage"]))
    if len(devices) != 1:
        raise ValueError(f"contract sections differ in device: {devices}")
    rows = [r for q in parts for r in q["rows"]]
    off = [r for q in parts for r in q.get("offload_rows", [])]
    keys = [(r["class"], r["set"], r["dtype"], r.get("weights") or "resident", _format(r)) for r in rows + off]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        more = f" and {len(twice) - 3} more" if len(twice) > 3 else ""
        raise ValueError(f"contract sections overlap in (class, set, dtype, weights) and weights format "
                         f"{twice[:3]}{more}: each may come from one part only")
    sets = list(dict.fromkeys(c["set"] for q in parts for c in q["coverage"]))
    dtypes = list(dict.fromkeys(c["dtype"] for q in parts for c in q["coverage"]))
    formats = list(dict.fromkeys(f for q in parts for f in q.get("weights_formats") or ["bf16"]))
    cov, unc = coverage(rows, sets, devices[0], dtypes, formats)
    return {"section": "contract", **{k: parts[0].get(k) for k in MERGE_SAME if k != "router_groups"},
            "weights_formats": formats, "router_groups": parts[0].get("router_groups"), "rows": rows,
            "offload_rows": off, "coverage": cov, "uncovered": unc, **joined_records(parts)}
