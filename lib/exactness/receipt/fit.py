"""A markdown text of a header and section blocks under a character limit (GitHub's comment cap), every block kept.

The header (title, summary, environment, errors, parameters) is kept whole; the room left is shared among the
section blocks: a block shorter than its share keeps all of it and leaves the rest to the others, a longer one is
cut at a line boundary to its share, with a note naming the section and where its whole content is (receipt.html
and receipt.json). Each block's opening (what was compared, its verdict) comes first, so a cut keeps it.
"""
from __future__ import annotations

SEP = "\n\n"
NOTE = ("\n\n_{name}: cut to {kept:,} of its {total:,} characters to keep receipt.md under GitHub's comment limit; "
        "the whole section is in receipt.html and receipt.json._")
SLACK = 64   # characters kept free for the closing fences and tags a cut may add


def join(header: str, blocks: list[tuple[str, str]]) -> str:
    """``header`` and the non-empty blocks' texts, separated by a blank line, ending with a newline."""
    return SEP.join([header, *(text for _, text in blocks if text)]) + "\n"


def shares(sizes: list[int], room: int) -> list[int]:
    """Characters each block may keep: ``room`` shared equally, a block needing less than its share keeping only
    what it needs and its surplus going to the larger ones. Sizes and room in characters; the result has sum
    ``<= room`` (``<= sum(sizes)``) and the order of ``sizes``."""
    out = [0] * len(sizes)
    left = max(room, 0)
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    for k, i in enumerate(order):
        out[i] = min(sizes[i], left // (len(sizes) - k))
        left -= out[i]
    return out


def cut_block(name: str, text: str, budget: int) -> str:
    """``text`` in about ``budget`` characters: whole when it fits, else its first lines and NOTE, with a code
    fence or ``<details>`` left open by the cut closed. At least its first line is kept."""
    if len(text) <= budget:
        return text
    room = budget - len(NOTE.format(name=name, kept=budget, total=len(text))) - SLACK
    cut = text.rfind("\n", 0, max(room, 0))
    kept = text[:cut] if cut > 0 else text.split("\n", 1)[0]
    if kept.count("```") % 2:
        kept += "\n```"
    kept += "\n</details>" * max(kept.count("<details") - kept.count("</details>"), 0)
    return kept + NOTE.format(name=name, kept=len(kept), total=len(text))


def fit_blocks(header: str, blocks: list[tuple[str, str]], limit: int) -> str:
    """:func:`join` of ``header`` and ``blocks`` (name, markdown), under ``limit`` characters where the header
    leaves room: as is when it fits, else each block over its share (:func:`shares`) cut by :func:`cut_block`."""
    text = join(header, blocks)
    if len(text) < limit:
        return text
    blocks = [(name, b) for name, b in blocks if b]
    room = limit - len(header) - len(SEP) * len(blocks) - 1 - SLACK
    budget = shares([len(b) for _, b in blocks], room)
    return join(header, [(name, cut_block(name, b, n)) for (name, b), n in zip(blocks, budget)])
