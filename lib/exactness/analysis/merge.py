"""Sections computed in separate calls (one per kernel set, one per engine) joined into one: what the
parts' ``provenance`` records (where each part was computed) become."""
from __future__ import annotations

PROVENANCE_FIELDS = ("computed_on", "commit", "command", "notes")


def join_provenance(parts: list[dict]) -> dict | None:
    """The ``provenance`` records of section parts computed in separate calls, joined field by field (" | " between
    distinct values, in part order); None when no part carries one. Used by the merges of per-call sections."""
    provs = [q["provenance"] for q in parts if isinstance(q.get("provenance"), dict)]
    if not provs:
        return None
    return {k: " | ".join(dict.fromkeys(str(p.get(k)) for p in provs if p.get(k) is not None))
            for k in PROVENANCE_FIELDS}
