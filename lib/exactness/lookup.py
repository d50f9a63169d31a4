"""Named tables (profiles, kernel sets, kernel classes): a lookup that refuses an unknown name in one line."""
from __future__ import annotations

from collections.abc import Iterable, Mapping


def lookup(table: Mapping, name, what: str, known: Iterable[str] | None = None, known_as: str = "known"):
    """``table[name]``.

    Raises:
        ValueError: ``unknown <what> 'name'; <known_as>: a, b, ...``, listing ``known`` (default: the table's names,
            sorted).
    """
    try:
        return table[name]
    except KeyError:
        names = sorted(table) if known is None else known
        raise ValueError(f"unknown {what} {name!r}; {known_as}: {', '.join(names)}") from None
