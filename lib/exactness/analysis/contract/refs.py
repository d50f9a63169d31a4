"""Decode references of the kernel contract: the decode kernel called on each tested row alone (M = 1), computed once
per pool row on first use.

On CUDA a pool whose fixed arguments stay put (no offload staging) computes its rows by replaying a CUDA graph of
GRAPH_ROWS one-row calls, the i-th call reading its row's index from lane i of a device buffer: the launches of
GRAPH_ROWS eager one-row calls (the decode path replays its one-row forwards the same way, graphs.py), without a host
launch per kernel per row. The rows of one ``get`` are computed in runs of consecutive rows; the lanes past a run's
end repeat its last row, whose bytes they write again. Eager one-row calls serve off CUDA, for offloaded weights
(one synchronous fetch per ``get``, as decode fetches an expert per step), for an attention kernel whose
``captures(k_cache, 1)`` is false or absent, and where capture raises (``route`` says which and why).
"""
from __future__ import annotations

import torch

from ...graphs import Capture, attention_in_graph
from .cases import N_REAL

GRAPH_ROWS = 32   # one-row calls per graph replay


def outputs(out) -> tuple:
    """A kernel's outputs as a tuple (one tensor or a tuple/list of them)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _eager_reason(fn, pool) -> str | None:
    """Why the references of ``pool`` run as eager calls (None: a CUDA graph is tried)."""
    if pool.rows[0].device.type != "cuda":
        return "eager: not on CUDA"
    if pool.stage is not None:
        return "eager: the weights are fetched per get (offload)"
    if pool.cls == "attention" and not attention_in_graph(fn, pool.fixed[0], 1):
        return "eager: the attention kernel reads this cache's slots or positions on the host"
    return None


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Ascending rows as runs [a, b) of consecutive ones."""
    out: list[tuple[int, int]] = []
    for i in rows:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


class DecodeRefs:
    """Decode references of a pool's rows (module docstring). ``get(start, M)`` returns one tensor [M, ...] per
    output for pool rows start..start+M-1; ``route`` is "graph", or "eager: <why>"."""

    def __init__(self, fn, pool, kw: dict | None = None):
        self.fn, self.pool, self.kw = fn, pool, kw or {}
        self.done = [False] * N_REAL
        self.refs: list[torch.Tensor] | None = None
        dev = pool.rows[0].device
        self.idx = torch.arange(N_REAL, device=dev)   # row indices made once, not per row
        self.route = _eager_reason(fn, pool) or "graph"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.lanes = torch.arange(GRAPH_ROWS, device=dev)
        self.gidx = torch.zeros(GRAPH_ROWS, dtype=torch.int64, device=dev)   # the rows of the next replay

    def _call(self, i: torch.Tensor, fixed: tuple) -> None:
        """The decode kernel on pool row i [1] int64 (device), its outputs written to the references' row i."""
        outs = outputs(self.fn(*self.pool.args(i, fixed=fixed), **self.kw))
        if self.refs is None:   # a row never computed reads as NaN (-1 in integer outputs), never as stale memory
            self.refs = [torch.full((N_REAL, *o.shape[1:]), float("nan") if o.is_floating_point() else -1,
                                    dtype=o.dtype, device=o.device) for o in outs]
        for r, o in zip(self.refs, outs):
            r.index_copy_(0, i, o)

    def _aim(self, c: int, b: int) -> None:
        """Point the lanes at rows c, c+1, ..., the ones past b - 1 at b - 1."""
        torch.clamp(self.lanes + c, max=b - 1, out=self.gidx)

    def _lanes(self, fixed: tuple) -> None:
        for j in range(GRAPH_ROWS):
            self._call(self.gidx[j:j + 1], fixed)

    def _capture(self, fixed: tuple) -> None:
        """Warm the lanes up (every lane on a done row) and capture them on a side stream, as graphs.py does."""
        dev = self.idx.device
        self.gidx.fill_(self.done.index(True))
        main, side = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)
        side.wait_stream(main)
        cap = Capture()
        with torch.cuda.stream(side):
            self._lanes(fixed)
            torch.cuda.synchronize(dev)
            try:
                cap.begin()
                self._lanes(fixed)
                cap.end()
                self.graph = cap.pieces[0]
            except Exception as e:  # whatever a kernel raises under capture: eager calls serve instead
                cap.abort()
                self.route = f"eager: capture failed: {type(e).__name__}"
                torch.cuda.synchronize(dev)
        main.wait_stream(side)

    def _rows(self, a: int, b: int, fixed: tuple) -> None:
        """References of rows a..b-1."""
        if self.refs is None or self.route != "graph":
            self._call(self.idx[a:a + 1], fixed)
            self.done[a] = True
            a += 1
        if a < b and self.route == "graph" and self.graph is None:
            self._capture(fixed)
        for c in range(a, b, GRAPH_ROWS if self.route == "graph" else 1):
            if self.route == "graph":
                self._aim(c, b)
                self.graph.replay()
            else:
                self._call(self.idx[c:c + 1], fixed)
        self.done[a:b] = [True] * (b - a)

    def get(self, start: int, M: int) -> list[torch.Tensor]:
        todo = [i for i in range(start, start + M) if not self.done[i]]
        if todo:
            fixed = self.pool.fetch("sync")
            for a, b in _runs(todo):
                self._rows(a, b, fixed)
        return [r[start:start + M] for r in self.refs]
