"""Sections computed in separate calls (one per kernel set, one per engine) joined into one: what the
parts' ``provenance`` records (where each part was computed) and ``fast_cuda`` records (what served the fast set's
CUDA kernels) become."""
from __future__ import annotations

PROVENANCE_FIELDS = ("computed_on", "commit", "command", "notes")


def join_provenance(parts: list[dict]) -> dict | None:
    """The ``provenance`` records of section parts computed in separate calls, joined field by field (" | " between
    distinct values, in part order); None when no part carries one. Used by the merges of per-call sections."""
    provs = [q["provenance"] for q in parts if isinstance(q.get("provenance"), dict)]
    if not provs:
        return None
    return {k: _join(p.get(k) for p in provs) for k in PROVENANCE_FIELDS}


def _join(values) -> str:
    """The distinct values that are not None, as strings in first-seen order, joined by " | "."""
    return " | ".join(dict.fromkeys(str(v) for v in values if v is not None))


def joined_records(parts: list[dict]) -> dict:
    """What a merged section carries of its parts' records: "provenance" (join_provenance) and "fast_cuda"
    (join_served), each only where a part has one."""
    out = {"provenance": join_provenance(parts), "fast_cuda": join_served(parts)}
    return {k: v for k, v in out.items() if v}


def join_served(parts: list[dict]) -> dict | None:
    """The parts' "fast_cuda" records (what served the fast set's CUDA kernels, receipt/sections.served_here)
    joined kernel by kernel (" | " between distinct values, in part order); None when no part carries one."""
    recs = [q["fast_cuda"] for q in parts if isinstance(q.get("fast_cuda"), dict)]
    if not recs:
        return None
    return {k: _join(r.get(k) for r in recs) for k in dict.fromkeys(k for r in recs for k in r)}
