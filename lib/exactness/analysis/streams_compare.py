"""The streams section's equalities, each through exact.compare: a Verdict read as the section's quantities
(tokens, logits, kv), the rerun check, the row fields of per-quantity results, and the KV of a concurrent stream's
cache slot (CacheTap), so that a stream compares like any other run.
"""
from __future__ import annotations

import dataclasses

import torch

from ..exact import Verdict, compare
from ..run import Run

QUANTITIES = ("tokens", "logits", "kv")


def quantities(v: Verdict, prompt: bool = True) -> dict[str, bool]:
    """QUANTITIES -> equal, from a Verdict (exact.compare): ``logits`` is the generated rows, and the prompt rows
    too when ``prompt`` (a drafted run's verdict rests on the verified rows alone). A part not exposed is not
    equal."""
    rows = v.gen_rows.equal is True and (v.prompt_rows.equal is True or not prompt)
    return {"tokens": v.tokens.equal is True, "logits": rows, "kv": v.kv.equal is True}


def same_run(a: Run, b: Run, prompt: bool = True) -> bool:
    """A rerun check: tokens and logits (as ``quantities``) byte-equal; KV not compared."""
    ok = quantities(compare(a, b), prompt)
    return ok["tokens"] and ok["logits"]


def kv_position(v: Verdict) -> int | None:
    """The first differing KV position of a Verdict (-1: different numbers of positions), None when equal."""
    return v.kv.first["position"] if v.kv.first else None


def outcome(ok: dict[str, bool], strict: bool = True) -> dict:
    """Row fields from per-quantity results ``ok`` (QUANTITIES -> equal in every repetition): ``compared`` (all
    QUANTITIES when ``strict``, else tokens only), ``equal`` (every compared quantity equal) and ``failed`` (every
    quantity that differed, compared or not, in QUANTITIES order)."""
    compared = list(QUANTITIES) if strict else ["tokens"]
    return {"equal": all(ok[q] for q in compared), "failed": [q for q in QUANTITIES if not ok[q]],
            "compared": compared}


class CacheTap:
    """Tap recorder (model.tapping) keeping, per layer, the KV tensors the attention kernels read (KVCache.k/v
    [S, T, Hkv, D], written in place): after the run they hold its cache, for runs that do not hand it back."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def record(self, cls, layer, args, **_):
        if cls == "attention":
            self.k[layer], self.v[layer] = args[1], args[2]

    def stream(self, run: Run, slot: int, ref: Run) -> Run:
        """``run`` (a stream of a concurrent run) with Run.kv read from its cache ``slot``, over ``ref``'s
        positions."""
        n, layers = ref.kv[0].shape[0], sorted(self.k)
        kv = [self.k[i][slot, :n] for i in layers] + [self.v[i][slot, :n] for i in layers]
        return dataclasses.replace(run, kv=kv)
