"""The ``dumps`` receipt section: the kernel contract and the FP64 per-class error of an engine's tensor dumps
(docs/dumps.md), for engines whose kernels the suite cannot call (C++, Zig, CUDA, other Python frameworks).

Both halves take the dump set as their source of kernel calls (contract/calls.py, fp64/calls.py).
``make receipts DUMPS=DIR`` (or ``--param dumps=DIR``) runs it; ``python -m exactness contract --dumps DIR`` and
``python -m exactness fp64 --dumps DIR`` compute each half alone.
"""
from __future__ import annotations

from ..blocks import Block, heading, text, to_markdown
from ..params import DumpsParams, ParamError
from .contract.calls import contract_of_calls
from .contract.report import render_calls_md as contract_md
from .fp64.calls import fp64_of_calls
from .fp64.report import render_calls_md as fp64_md

INTRO = ("The kernel contract (every prompt-role row against the decode-role row of the same sequence and position, "
         "as bytes) and the FP64 per-class error, computed from an engine's tensor dumps (`docs/dumps.md`). "
         "`make receipts DUMPS=DIR` runs this section.")


def run_section(params: DumpsParams | dict) -> dict:
    """{"section": "dumps", "folder", "contract": contract_of_calls(folder), "fp64": fp64_of_calls(folder) or None}.

    Raises:
        ParamError: no dump folder, or one without manifest.json; DumpError: an invalid dump set (one line).
    """
    p = DumpsParams.from_dict(params)
    if not p.dumps:
        raise ParamError("dumps: no dump set given; allowed: dumps=DIR, a folder holding manifest.json "
                         "(docs/dumps.md)")
    return {"section": "dumps", "folder": p.dumps, "contract": contract_of_calls(p.dumps),
            "fp64": fp64_of_calls(p.dumps) if p.dumps_fp64 else None}


def blocks(section: dict) -> list[Block]:
    """The section's view (blocks.py): intro and the dump set, the dump contract's tables, then the FP64 table."""
    out = [heading("Tensor dumps"), text(INTRO, f"Dump set: `{section.get('folder')}`."),
           text(contract_md(section["contract"]))]
    if section.get("fp64"):
        out.append(text(fp64_md(section["fp64"])))
    return out


def render_md(section: dict) -> str:
    """receipt.md's block of the section: its :func:`blocks` as markdown."""
    return to_markdown(blocks(section)) + "\n"
