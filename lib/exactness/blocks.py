"""Display blocks: what a section shows, described once. A section's ``blocks(section) -> list[Block]`` is rendered
by :func:`to_markdown` for receipt.md and by :func:`show` in its notebook (receipt.html is the executed notebooks), so
the three read the same headings, texts, tables and plots.

A block is markdown text (a heading, a paragraph, a list), a table (tables.Table: HTML in the notebook, a GitHub
table in receipt.md; or a markdown table already written) or a plot (drawn in the notebook; receipt.md names it
and says where it is).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .tables import Table


@dataclass(frozen=True)
class Block:
    """One piece of a section's view.

    Attributes:
        text: markdown (a heading, a paragraph, a list), or a markdown table when ``table`` is None and ``plot`` is.
        table: a tables.Table, or None.
        plot: () -> a matplotlib Figure, drawn in the notebook; ``text`` is its caption.
    """

    text: str = ""
    table: Table | None = None
    plot: Callable | None = None


def heading(title: str, level: int = 2) -> Block:
    """A markdown heading block (``level`` 2: the section's own, 3: a part of it)."""
    return Block("#" * level + " " + title)


def text(*lines: str) -> Block:
    """A markdown block of ``lines`` joined by blank lines (empty lines dropped)."""
    return Block("\n\n".join(line for line in lines if line))


def table(t: Table) -> Block:
    """A table block."""
    return Block(table=t)


def plot(draw: Callable, caption: str) -> Block:
    """A plot block: ``draw() -> Figure`` in the notebook; receipt.md shows ``caption`` and where the plot is."""
    return Block(caption, plot=draw)


def to_markdown(blocks: list[Block]) -> str:
    """receipt.md's text of ``blocks``: texts as they are, tables as GitHub tables, plots as their caption."""
    parts = []
    for b in blocks:
        if b.plot is not None:
            parts.append(f"_Plot: {b.text} (in receipt.html and the notebook)._")
        elif b.table is not None:
            parts.append(b.table.to_markdown())
        elif b.text:
            parts.append(b.text)
    return "\n\n".join(parts)


def show(blocks: list[Block]) -> None:
    """Display ``blocks`` in a notebook: texts as Markdown, tables as HTML, plots drawn (and closed, so that the
    cell shows each figure once)."""
    from IPython.display import Markdown, display

    for b in blocks:
        if b.plot is not None:
            import matplotlib.pyplot as plt

            fig = b.plot()
            if fig is not None:
                display(fig)
                plt.close(fig)
        elif b.table is not None:
            display(b.table)
        elif b.text:
            display(Markdown(b.text))
