"""The ``dumps`` receipt section: the kernel contract and the FP64 per-class error of an engine's tensor dumps
(docs/dumps.md), for engines whose kernels the suite cannot call (C++, Zig, CUDA, other Python frameworks).

``make receipts DUMPS=DIR`` (or ``--param dumps=DIR``) runs it; ``python -m exactness contract --dumps DIR`` and
``python -m exactness fp64 --dumps DIR`` compute each half alone.
"""
from __future__ import annotations

from ..receipt.params import DumpsParams, ParamError
from .contract import dump_contract
from .fp64 import dump_fp64, render_fp64_md
from .render import render_md as contract_md


def run_section(params: DumpsParams | dict) -> dict:
    """{"section": "dumps", "folder", "contract": dump_contract(folder), "fp64": dump_fp64(folder) or None}.

    Raises:
        ParamError: no dump folder, or one without manifest.json; DumpError: an invalid dump set (one line).
    """
    p = DumpsParams.from_dict(params)
    if not p.dumps:
        raise ParamError("dumps: no dump set given; allowed: dumps=DIR, a folder holding manifest.json "
                         "(docs/dumps.md)")
    return {"section": "dumps", "folder": p.dumps, "contract": dump_contract(p.dumps),
            "fp64": dump_fp64(p.dumps) if p.dumps_fp64 else None}


def render_md(section: dict) -> str:
    """receipt.md's block: the dump contract's tables, then the FP64 table."""
    parts = ["## Tensor dumps", "", f"Dump set: `{section.get('folder')}`.", "", contract_md(section["contract"])]
    if section.get("fp64"):
        parts += ["", render_fp64_md(section["fp64"])]
    return "\n".join(parts)
