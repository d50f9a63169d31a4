"""Bench figures in the receipt diff (diff.py): which moved by more than their run-to-run spread.

Each bench row keeps its repeats (analysis/bench.py). A figure of a row is judged from those repeats only:

    figure   the median of the row's repeats in each receipt
    spread   the larger of the two receipts' ranges (max - min) over their repeats
    moved    |median PR - median BASE| > spread

A figure with fewer than two repeats in either receipt (e.g. the warm repeats of ``plain`` under bench_reps=2: one
repeat) has no spread and is *not judged*; the diff says so and why, and neither counts it as moved nor as steady.
"""
from __future__ import annotations

import statistics

from .diff import match

# part -> (key fields, the repeats of a row, the figures judged, what the repeats are)
PARTS = {
    "plain": (("kernels", "prompt"), lambda r: (r.get("runs") or [])[1:],
              ("ttft_s", "prefill_tps", "decode_tps", "itl_mean_ms"), "warm repeats (rep 1..)"),
    "drafted": (("kernels", "prompt"), lambda r: (r.get("runs") or [])[1:],
                ("ttft_s", "prefill_tps", "decode_tps", "itl_mean_ms"), "warm repeats (rep 1..)"),
    "itl": (("kernels", "mode", "prompt"), lambda r: r.get("runs") or [],
            ("ttft_s", "decode_tps", "itl_mean_ms", "itl_p50_ms", "itl_p95_ms"), "ITL repetitions"),
    "cold": (("kernels", "requested"), lambda r: (r.get("runs") or []) if r.get("qualified") else [],
             ("ttft_s", "prefill_tps"), "qualified cold repeats"),
    "streams": (("kernels", "prompt", "streams"), lambda r: r.get("reps") or [],
                ("aggregate_tps", "per_stream_tps", "ttft_max_s", "end_to_end_tps"), "repeats"),
    "memory": (("kernels", "prompt"), lambda r: [r], ("batched_peak_bytes", "path_peak_bytes"),
               "measurements (one per receipt)"),
}
# Bench settings two receipts must share for their figures to be compared.
CONFIG_SAME = ("preset", "device", "device_name", "dtype", "path", "step", "deep_threshold", "gen_tokens", "offload",
               "mtp_k")


def judge(base: list[float], pr: list[float]) -> dict | None:
    """Median of each, the spread (larger range) and whether the medians are further apart than the spread; None
    when either side has fewer than two repeats (no spread)."""
    if len(base) < 2 or len(pr) < 2:
        return None
    mb, mp = statistics.median(base), statistics.median(pr)
    spread = max(max(base) - min(base), max(pr) - min(pr))
    return {"base": mb, "pr": mp, "spread": spread, "moved": abs(mp - mb) > spread}


def _values(reps: list, field: str) -> list[float]:
    return [float(x[field]) for x in reps if isinstance(x, dict) and isinstance(x.get(field), (int, float))
            and not isinstance(x.get(field), bool)]


def _figure(result: dict, part: str, what: str, field: str, vb: list, vp: list, kind: str) -> None:
    """Judge one figure of one matched row into ``result`` (changes, within_spread or not_judged)."""
    if not vb and not vp:
        return   # not measured in either (e.g. device memory on CPU): nothing to say
    verdict = judge(vb, vp)
    if verdict is None:
        counts = f"BASE has {len(vb)}, PR has {len(vp)} {kind}"
        result["not_judged"].append({"section": "bench", "what": f"{part} · {what}", "field": field,
                                     "why": f"no run-to-run spread: {counts}; a spread needs two or more each"})
    elif verdict["moved"]:
        result["changes"].append({"section": "bench", "what": f"{part} · {what}", "field": field, "kind": "figure",
                                  "base": verdict["base"], "pr": verdict["pr"], "spread": verdict["spread"],
                                  "spread_of": f"{kind}: {len(vb)} in BASE, {len(vp)} in PR"})
    else:
        result["within_spread"] += 1


def figures(result: dict, base: dict, pr: dict) -> None:
    """Judge every figure of every bench row both receipts hold (``base``/``pr``: the bench sections' data; rows in
    one receipt only are listed by diff.match)."""
    for part, (key, reps, fields, kind) in PARTS.items():
        rows_b, rows_p = base.get(part), pr.get(part)
        if not isinstance(rows_b, list) or not isinstance(rows_p, list):
            continue   # a part a receipt did not run (bench's not_run says why)

        def label(r, key=key):
            return " ".join(f"{f}={r.get(f)}" for f in key)
        for what, rb, rp in match(result, "bench", rows_b, rows_p, key, lambda r, label=label: f"{part} · {label(r)}"):
            for field in fields:
                _figure(result, part, what.split(" · ", 1)[1], field, _values(reps(rb), field),
                        _values(reps(rp), field), kind)


def diff_bench(result: dict, b: dict, p: dict, receipts: tuple[dict, dict]) -> None:
    """Bench figures beyond their run-to-run spread (:func:`figures`) of two bench section objects; a section timed
    on different devices (each of ``receipts``' env device) or under another bench configuration (CONFIG_SAME) is
    not compared, and says why."""
    devices = [(r.get("env") or {}).get("device") for r in receipts]
    bc, pc = (b.get("data") or {}).get("config") or {}, (p.get("data") or {}).get("config") or {}
    why = [f"{k} {bc.get(k)!r} vs {pc.get(k)!r}" for k in CONFIG_SAME if bc.get(k) != pc.get(k)]
    if devices[0] != devices[1]:
        why.insert(0, f"timed on different devices: {devices[0]!r} vs {devices[1]!r}")
    if why:
        result["not_comparable"].append({"section": "bench", "what": "every figure", "why": "; ".join(why)})
        return
    figures(result, b.get("data") or {}, p.get("data") or {})
