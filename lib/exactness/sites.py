"""Call sites: the site and the forward rows of every kernel call a forward makes, for the recorders that observe
calls through ``model.tapping`` (analysis/taps.py: sampled rows for FP64; dumps/ours.py: tensor dumps).

A site names what a call computes at one place of the model: a weight (``L0.wq``, ``L1.e3``, ``L0.shared``,
``L0.q_norm``, ``final_norm``, ``lm_head``) or a use (``L0.router``, ``L0.combine``, ``L0.attn``, ``L0.rope_q``,
``L0.residual_attn``). The class record's ``rows`` (kernels/registry.py) says how a call's rows map to the forward's:
    forward    the forward's rows in order
    tiles      the forward's rows, consecutive calls of one site taking consecutive tiles (the deep plan)
    routed     a routed expert's rows are the forward rows that picked it in the layer's router call, ascending
               (model.moe_block's order), in tiles; the shared expert's are all rows
    previous   the rows of the call just before it (expert_down after expert_gate_up: Ops.expert chains them)
"""
from __future__ import annotations

import torch

from .kernels import class_record

NORM_TO_ROPE = {"q_norm": "rope_q", "k_norm": "rope_k"}   # a rope call is named by the norm just before it


def weight_names(w) -> dict[int, str]:
    """data_ptr -> layer-qualified name (``L0.wq``, ``L1.e3.gate``, ``L0.shared.up``, ``final_norm``) of every
    weight tensor of a ``Weights`` (expert slices included); {} for None."""
    if w is None:
        return {}
    names = {w.final_norm.data_ptr(): "final_norm", w.lm_head.data_ptr(): "lm_head"}
    for i, lw in enumerate(w.layers):
        for f in ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm", "router"):
            names[getattr(lw, f).data_ptr()] = f"L{i}.{f}"
        for f, part in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down")):
            for e in range(getattr(lw, f).shape[0]):
                names[getattr(lw, f)[e].data_ptr()] = f"L{i}.e{e}.{part}"
            if getattr(lw, "shared_" + part) is not None:
                names[getattr(lw, "shared_" + part).data_ptr()] = f"L{i}.shared.{part}"
    return names


class CallSites:
    """Maps each kernel call of a forward to (site, forward row of each call row).

    Args:
        weights: the model's ``Weights`` (names the weights; None: weights are named by address).
    Attributes:
        positions: the current forward's positions, a list of ints (forward row -> position).
    Raises (from :meth:`call`):
        ValueError: routed expert weights that are none of the model's tensors (staged copies: expert offload), or
            a call whose rows cannot be mapped.
    """

    def __init__(self, weights=None):
        self.names = weight_names(weights)
        self._fwd = None

    def _new_forward(self, positions: torch.Tensor) -> None:
        if positions is not self._fwd:
            self._fwd = positions       # held so that its id is not reused by a later forward
            self.positions = positions.cpu().tolist()
            self._off, self._idx, self._last_norm, self._occ, self._previous = {}, {}, None, {}, None

    def name(self, t: torch.Tensor) -> str:
        """A weight's name, or ``ptr<address>`` for a tensor that is none of the model's."""
        return self.names.get(t.data_ptr(), f"ptr{t.data_ptr():x}")

    def call(self, cls: str, layer: int, positions: torch.Tensor, args: tuple, out) -> tuple[str, list[int]]:
        """(site, forward row index of each of the call's M rows) of one kernel call (model.tapping's record)."""
        self._new_forward(positions)
        site = self._site(cls, layer, args)
        outs = out if isinstance(out, tuple) else (out,)
        if cls == "router":
            self._idx[layer] = outs[1].cpu()
        rows = self._rows(class_record(cls).rows, site, outs[0].shape[0], layer)
        if len(rows) != outs[0].shape[0]:
            raise ValueError(f"{cls} at {site}: {outs[0].shape[0]} call rows, {len(rows)} rows mapped")
        self._previous = rows
        return site, rows

    def _site(self, cls: str, layer: int, args) -> str:
        pre = f"L{layer}." if layer >= 0 else ""
        if cls in ("dense", "rmsnorm"):
            name = self.name(args[1])
            if cls == "rmsnorm":
                self._last_norm = name.rsplit(".", 1)[-1]
            return name
        if cls in ("expert_gate_up", "expert_down"):
            if args[1].data_ptr() not in self.names:
                raise ValueError(f"{cls}: its weights are none of the model's tensors (staged copies: expert "
                                 "offload); recording its rows needs resident experts")
            return self.names[args[1].data_ptr()].rsplit(".", 1)[0]
        if cls in ("rope", "residual"):
            n = self._occ[(layer, cls)] = self._occ.get((layer, cls), -1) + 1
            tag = NORM_TO_ROPE.get(self._last_norm, f"rope{n}") if cls == "rope" else \
                (("residual_attn", "residual_moe")[n] if n < 2 else f"residual{n}")
            return pre + tag
        return pre + {"moe_combine": "combine", "attention": "attn"}.get(cls, cls)

    def _rows(self, rule: str, site: str, M: int, layer: int) -> list[int]:
        """Forward row index of each of the call's M rows, by the class record's ``rows`` rule."""
        if rule == "previous":
            return self._previous
        if rule == "routed" and ".e" in site:
            e = int(site.rsplit(".e", 1)[1])
            pool = (self._idx[layer] == e).any(dim=1).nonzero().flatten().tolist()
        elif rule in ("tiles", "routed"):
            pool = list(range(len(self.positions)))
        else:
            return list(range(M))
        off = self._off.get(site, 0)      # the deep plan: consecutive tiles of the same site's rows
        self._off[site] = off + M
        return pool[off:off + M]
