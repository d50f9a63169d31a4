"""The forwards of one stream that meets a few row counts again and again (a drafted run: mtp.generate_drafted),
each shape replayed from its own graphs.GraphForward once met twice.
"""
from __future__ import annotations

import torch

from .cache import KVCache
from .expert_providers import ExpertProvider
from .graphs import GraphForward, Head
from .kernels import KernelSet, get_set
from .model import BATCHED, DECODE, ForwardOut, Plan, forward
from .weights import Weights

ONCE = "met once: not captured"   # StreamForwards.info()'s reason for a shape that ran one eager forward


class StreamForwards:
    """The forwards of one stream (slot 0) of a run that meets a few row counts again and again (a drafted run's
    verify of k+1 rows, its plain decode steps, its MTP head's rows), each shape (model, rows, plan) with its own
    GraphForward when ``graphs`` is asked for: captured at the shape's second call (which runs eagerly, as a
    GraphForward's first call does), replayed from its third; a shape met once runs one eager forward and captures
    nothing. Forwards of more than ``max_rows`` rows, and every forward without ``graphs``,
    run eagerly (model.forward, MTPHead.forward).

    Args:
        w, cache, kernels, experts: the main model's weights, KV cache, kernel set and expert provider;
        head: an mtp.MTPHead (its own cache) or None; graphs: capture; max_rows: the most rows a captured shape has.
    """

    def __init__(self, w: Weights, cache: KVCache, kernels: KernelSet | str, experts: ExpertProvider | None,
                 head: Head | None, graphs: bool, max_rows: int):
        self.w, self.cache, self.ks, self.experts, self.head = w, cache, get_set(kernels), experts, head
        self.graphs, self.max_rows = graphs, max_rows
        self.captured: dict[str, GraphForward] = {}
        self.once: set[str] = set()             # shapes met once so far: their eager forward

    def main(self, tokens: torch.Tensor, first: int, plan: Plan) -> ForwardOut:
        """The main model over tokens [n] int64 (device) at positions first..first+n-1 -> ForwardOut(logits [n, V]
        fp32, hidden [n, H])."""
        n = tokens.numel()
        g = self._graph(f"main {n} {plan.kind}", n, lambda: GraphForward(
            self.w, self.cache, self.ks, rows=n, plan=plan, experts=self.experts))
        if g is not None:
            return g.run(tokens, range(first, first + n), [0] * n)
        pos = torch.arange(first, first + n, device=self.w.device)
        return forward(self.w, tokens, pos, self.cache, self.ks, plan, experts=self.experts)

    def head_rows(self, tokens: torch.Tensor, hidden: torch.Tensor, first: int) -> ForwardOut:
        """The MTP head over (tokens [n] int64, hidden [n, H]) at positions first..first+n-1 (decode plan for one
        row, batched for more) -> ForwardOut(logits [n, V] fp32 of the drafts, hidden [n, H] for chaining)."""
        n = tokens.numel()
        plan = DECODE if n == 1 else BATCHED
        g = self._graph(f"head {n} {plan.kind}", n, lambda: GraphForward(
            self.w, self.head.cache, self.ks, rows=n, plan=plan, head=self.head))
        if g is not None:
            return g.run(tokens, range(first, first + n), [0] * n, hidden)
        pos = torch.arange(first, first + n, device=self.w.device)
        return self.head.forward(tokens, hidden, pos, self.ks, plan)

    def _graph(self, key: str, n: int, make) -> GraphForward | None:
        """The shape's GraphForward, made on its second call; None: run this call eagerly."""
        if not self.graphs or n > self.max_rows:
            return None
        if key not in self.captured and key not in self.once:
            self.once.add(key)
            return None
        if key not in self.captured:
            self.once.discard(key)
            self.captured[key] = make()
        return self.captured[key]

    def info(self) -> dict:
        """{} when graphs were not asked for; else {"<model> <rows> <plan>": GraphForward.info()} per shape met,
        its ``eager_steps`` counting the shape's first (eager) call too; a shape met once: no replay, one eager
        step, reason ONCE."""
        if not self.graphs:
            return {}
        info = {}
        for k, g in self.captured.items():
            d = g.info()
            info[k] = {**d, "eager_steps": d["eager_steps"] + 1}
        for k in self.once:
            info[k] = {"served": False, "replays": 0, "eager_steps": 1, "pieces": 0, "reason": ONCE}
        return info
