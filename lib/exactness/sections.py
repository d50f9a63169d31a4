"""Section JSON files: how a notebook (or the CLI) hands its results to the receipt runner.

Each analysis returns one JSON-ready object ``{"section": "<name>", ...}``; notebooks write it to the path the runner
passes as ``out_json`` and may render a section computed elsewhere (``precomputed_json``, e.g. on the GPU machine).
"""
from __future__ import annotations

import json
import os
import tempfile


def save_section(section: dict, path: str) -> None:
    """Write ``section`` as JSON to ``path`` atomically (temporary file + rename); "" writes nothing.

    Raises:
        ValueError: ``section`` lacks its "section" name.
    """
    if not path:
        return
    if not isinstance(section, dict) or "section" not in section:
        raise ValueError("a section object must be a dict with a 'section' name")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(section, fh, indent=1, allow_nan=True)
    os.replace(tmp, path)


def load_section(path: str, name: str) -> dict:
    """Read a section JSON written by save_section (or by ``python -m exactness <name> --out``).

    Raises:
        ValueError: the file holds another section than ``name``.
    """
    with open(path) as fh:
        section = json.load(fh)
    if section.get("section") != name:
        raise ValueError(f"{path} holds section {section.get('section')!r}, expected {name!r}")
    return section


PROVENANCE_FIELDS = ("computed_on", "commit", "command", "notes")


def join_provenance(parts: list[dict]) -> dict | None:
    """The ``provenance`` records of section parts computed in separate calls, joined field by field (" | " between
    distinct values, in part order); None when no part carries one. Used by the merges of per-call sections."""
    provs = [q["provenance"] for q in parts if isinstance(q.get("provenance"), dict)]
    if not provs:
        return None
    return {k: " | ".join(dict.fromkeys(str(p.get(k)) for p in provs if p.get(k) is not None))
            for k in PROVENANCE_FIELDS}
