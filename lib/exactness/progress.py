"""Progress lines for long work: one tqdm bar on stderr, whether or not stderr is a terminal.

Inside a notebook kernel stderr is not a terminal, so tqdm's default (``disable=None``) would print nothing; the
receipt runner forwards the kernel's stderr to its own terminal (papermill ``stderr_file``) and the HTML receipt
leaves stderr out, so the bar is always on and written as plain text.
"""
from __future__ import annotations

import sys

from tqdm import tqdm

MIN_INTERVAL_S = 2.0  # at most one refresh every 2 s: a forwarded line per refresh, not per token


def bar(total: int, desc: str, unit: str) -> tqdm:
    """A tqdm bar over ``total`` units of work (``unit``: "token", "pair", "run", ...) written to stderr, with a
    rate and an ETA; use it as a context manager and call ``update(n)``."""
    # ncols/nrows fixed: tqdm hides a bar whose terminal reports 0 rows (a pseudo-terminal never sized), and a
    # forwarded line has no terminal width to measure.
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=False, mininterval=MIN_INTERVAL_S,
                ascii=True, ncols=100, nrows=50)
