"""The tap recorder: a bounded sample of the exact inputs and outputs of every kernel call, copied to the CPU.

Use with ``model.tapping(recorder)`` (model.py): inside the block every kernel call reports
``record(cls, role, plan, kernels, layer, positions, args, out)``. The recorder keeps only the rows whose prompt
position is in a fixed set ``positions`` (the same set on every path, so the same rows can be compared between the
decode oracle and the batched/deep runs), at most one sample per (layer, class, weight, position) and run: that
bounds memory by ``len(positions)`` per (layer, class, weight).

Mapping a call's rows to positions:
    dense                rows are the forward's rows in order; on the deep plan the model calls the kernel on
                         consecutive ``tile_rows`` tiles, so a per-(layer, weight) row offset is kept per forward
    router, moe_combine, attention, rmsnorm, rope, residual, lm_head
                         rows are the forward's rows
    expert_gate_up       rows are some of the router's input rows (expert members): matched by content (a hash of
                         the bits, then an exact compare) to the router input rows sampled in the same layer
    expert_down          the rows of the expert_gate_up call just before it (Ops.expert chains the two per tile)
A quantized weight (kernels/quant.QuantWeight) is kept and named like a tensor (by its codes' address).
Weights are named from the model's tensors (``wq``, ``e3.gate``, ``shared.up``, ``final_norm``, ...) when
``weights`` is given; otherwise by address. Attention samples keep the query row and output; the keys/values up to
the largest sampled position are copied once per (run, layer) when the run ends (:meth:`TapRecorder.run`).
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..exact import as_int
from ..kernels.registry import ClassNames

NORM_TO_ROPE = {"q_norm": "q", "k_norm": "k"}


@dataclass
class Sample:
    """One sampled row of one kernel call.

    Attributes:
        cls: kernel class; layer: decoder layer (-1 = head); tag: which weight / which call (``wq``, ``e3``, ...).
        pos: prompt position of the row; plan: the plan that actually ran it (decode/batched/deep).
        data: CPU tensors in the stored dtype (class-specific names: x, y, q, o, a, b, logits, idx, g, shared);
            empty until the recorder's run (TapRecorder.run) that kept the sample ends.
        meta: python scalars (eps, theta, top_k, slot; router: groups = (n_groups, topk_groups) when it routes in
            groups).
    """

    cls: str
    layer: int
    tag: str
    pos: int
    plan: str
    data: dict
    meta: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        """(layer, tag, pos): the identity of this row across paths."""
        return (self.layer, self.tag, self.pos)


def weight_names(weights) -> dict[int, str]:
    """data_ptr -> name of every weight tensor (and of every expert's slice) of a ``Weights``."""
    names = {}
    if weights is None:
        return names
    names[weights.final_norm.data_ptr()] = "final_norm"
    names[weights.lm_head.data_ptr()] = "lm_head"
    for lw in weights.layers:
        for f in ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm", "router"):
            names[getattr(lw, f).data_ptr()] = f
        for f, part in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down")):
            for e in range(getattr(lw, f).shape[0]):
                names[getattr(lw, f)[e].data_ptr()] = f"e{e}.{part}"
            shared = getattr(lw, "shared_" + part)
            if shared is not None:
                names[shared.data_ptr()] = f"shared.{part}"
    return names


def _row_hash(x: torch.Tensor) -> torch.Tensor:
    """[n, ...] -> [n] int64 hash of each row's bits (wrapping arithmetic; equal rows give equal hashes)."""
    flat = x.reshape(x.shape[0], -1).contiguous()
    ints = as_int(flat).to(torch.int64)
    coef = torch.arange(1, flat.shape[1] + 1, device=x.device, dtype=torch.int64) * 0x9E3779B1 + 0x7F4A7C15
    return (ints * coef).sum(dim=1)


class TapRecorder:
    """Keeps sampled rows of every kernel call (see module docstring); a sample's data reaches the CPU when its
    run (:meth:`run`) ends.

    Args:
        positions: prompt positions to keep (ints >= 0).
        weights: the model's ``Weights`` (optional; names the weights and experts).
        classes: kernel classes to record (default CLASSES: those with an FP64 evaluator, i.e. all but argmax).
    Attributes:
        samples: (kernels, path, cls) -> list[Sample].
        params: (layer, tag) -> the weight tensor a sample's tag refers to (a reference, not a copy).
        kv: (kernels, path, layer) -> (k [T, Hkv, D], v [T, Hkv, D]) CPU copies of slot 0 up to the largest sampled
            attention position of that run.
        calls: (kernels, path, cls, plan) -> number of kernel calls seen.
    Raises:
        ValueError: an empty or negative position set.
    """

    CLASSES = ClassNames(lambda r: r.fp64 is not None)

    def __init__(self, positions, weights=None, classes=CLASSES):
        pos = sorted({int(p) for p in positions})
        if not pos or pos[0] < 0:
            raise ValueError(f"positions must be a non-empty set of ints >= 0, got {list(positions)[:8]}")
        self.positions = torch.tensor(pos, dtype=torch.int64)
        self.classes = set(classes)
        self.names = weight_names(weights)
        self.samples: dict[tuple, list[Sample]] = defaultdict(list)
        self.params: dict[tuple, torch.Tensor] = {}
        self.kv: dict[tuple, tuple] = {}
        self.calls: dict[tuple, int] = defaultdict(int)
        self.path: str | None = None
        self._seen: set = set()
        self._fwd = None
        self._kvref: dict[tuple, list] = {}
        self._staged: list = []   # (rows on the device, [(row, Sample)]): the samples waiting for their CPU data

    # ------------------------------------------------------------------ run bookkeeping
    @contextmanager
    def run(self, path: str):
        """File every call made inside the block under ``path``; copy the sampled keys/values when it ends."""
        self.path = path
        try:
            yield self
        finally:
            try:
                for key, (kc, vc, slot, pmax) in self._kvref.items():
                    self.kv[key] = (kc[slot, :pmax + 1].cpu().clone(), vc[slot, :pmax + 1].cpu().clone())
            finally:
                self._kvref.clear()
                self._to_cpu()
                self.path, self._fwd = None, None

    def _new_forward(self, positions: torch.Tensor) -> None:
        if positions is not self._fwd:
            self._fwd = positions          # holding it keeps its id from being reused by a later forward
            self._offset, self._h, self._pending, self._last_norm, self._occ = {}, {}, None, None, defaultdict(int)
            self._pos_cpu = positions.cpu()
            mask = torch.isin(self._pos_cpu, self.positions)
            rows = mask.nonzero().flatten()
            self._fwd_sel = (rows.tolist(), self._pos_cpu[rows].tolist())

    def _name(self, t: torch.Tensor) -> str:
        return self.names.get(t.data_ptr(), f"ptr{t.data_ptr():x}")

    def _keep(self, ks: str, cls: str, layer: int, tag: str, rows, pos, plan: str, data: dict, meta=None) -> list:
        """Add samples for row indices ``rows`` (positions ``pos``) of the call; ``data`` maps name -> [n, ...]."""
        kept = []
        if not len(rows):
            return kept
        idx = None
        for i, p in enumerate(pos):
            key = (ks, self.path, cls, layer, tag, int(p))
            if key in self._seen:
                continue
            self._seen.add(key)
            if idx is None:   # the rows copied on the device now, to the CPU when the run ends (_to_cpu)
                idx = torch.as_tensor(rows, dtype=torch.int64)
                rows_of = {k: v.index_select(0, idx.to(v.device, non_blocking=True)) for k, v in data.items()}
                self._staged.append((rows_of, []))
            s = Sample(cls, layer, tag, int(p), plan, {}, dict(meta or {}))
            self._staged[-1][1].append((i, s))
            self.samples[(ks, self.path, cls)].append(s)
            kept.append(s)
        return kept

    def _to_cpu(self) -> None:
        """Give the samples kept since the last call their CPU data: one copy per call's tensor, made after the
        run, so that the run makes no copy to the host per kernel call (it still reads positions and, for the
        experts, matches rows on the host)."""
        for rows_of, samples in self._staged:
            cpu = {k: v.cpu() for k, v in rows_of.items()}
            for i, s in samples:
                s.data = {k: v[i].clone() for k, v in cpu.items()}
        self._staged.clear()

    def _select(self, start: int = 0, n: int | None = None):
        """(row indices, positions) of the sampled rows among the forward's rows start..start+n-1 (default all)."""
        if n is None:
            return self._fwd_sel
        rows, pos = self._fwd_sel
        keep = [(r - start, p) for r, p in zip(rows, pos) if start <= r < start + n]
        return [r for r, _ in keep], [p for _, p in keep]

    # ------------------------------------------------------------------ the tap
    def record(self, *, cls, role, plan, kernels, layer, positions, args, out) -> None:
        """Called by model.Ops for every kernel call (see model.tapping). Keeps the sampled rows only."""
        if cls not in self.classes:
            return
        if self.path is None:
            raise RuntimeError("TapRecorder records inside `with recorder.run(path):` only (a sample's data "
                               "reaches the CPU when its run ends)")
        self._new_forward(positions)
        self.calls[(kernels, self.path, cls, plan)] += 1
        if self._fwd_sel[0]:               # a forward with no sampled row costs one dict update per call
            getattr(self, "_" + cls)(kernels, plan, layer, positions, args, out)

    def _dense(self, ks, plan, layer, positions, args, out):
        x, w = args
        tag = self._name(w)
        off = self._offset.get((layer, tag), 0)
        self._offset[(layer, tag)] = off + x.shape[0]
        rows, pos = self._select(start=off, n=x.shape[0])
        self.params[(layer, tag)] = w
        self._keep(ks, "dense", layer, tag, rows, pos, plan, {"x": x, "y": out})

    def _router(self, ks, plan, layer, positions, args, out):
        x, w, top_k, norm, *groups = args       # groups: (n_groups, topk_groups), passed for grouped routing only
        meta = {"top_k": top_k, "norm": norm}
        if groups and groups[0] is not None and groups[0][0] > 1:
            meta["groups"] = (int(groups[0][0]), int(groups[0][1]))
        weights, idx, logits = out
        rows, pos = self._select()
        self.params[(layer, "router")] = w
        if rows:
            sel = x[torch.as_tensor(rows, device=x.device)]
            self._h[layer] = (_row_hash(sel), sel, pos)
        self._keep(ks, "router", layer, "router", rows, pos, plan,
                   {"x": x, "y": logits, "idx": idx, "g": weights}, meta)

    def _expert_gate_up(self, ks, plan, layer, positions, args, out):
        x, wg, wu = args
        tag = self._name(wg).rsplit(".", 1)[0]
        rows, pos = [], []
        if layer in self._h:
            hh, hx, hpos = self._h[layer]
            cand = (_row_hash(x)[:, None] == hh[None, :]).nonzero().tolist()  # [(row of x, sampled row)]
            for r, j in cand:
                if r not in rows and torch.equal(x[r], hx[j]):
                    rows.append(r)
                    pos.append(hpos[j])
        self.params[(layer, tag + ".gate")], self.params[(layer, tag + ".up")] = wg, wu
        self._keep(ks, "expert_gate_up", layer, tag, rows, pos, plan, {"x": x, "y": out})
        self._pending = (layer, tag, rows, pos)

    def _expert_down(self, ks, plan, layer, positions, args, out):
        h, wd = args
        if self._pending is None or self._pending[0] != layer:
            return
        _, tag, rows, pos = self._pending
        self._pending = None
        self.params[(layer, tag + ".down")] = wd
        self._keep(ks, "expert_down", layer, tag, rows, pos, plan, {"x": h, "y": out})

    def _moe_combine(self, ks, plan, layer, positions, args, out):
        y, weights, shared = args
        rows, pos = self._select()
        data = {"y": y, "g": weights, "out": out}
        if shared is not None:
            data["shared"] = shared
        self._keep(ks, "moe_combine", layer, "combine", rows, pos, plan, data)

    def _attention(self, ks, plan, layer, positions, args, out):
        q, kc, vc, slots, pos_arg = args
        rows, pos = self._select()
        if not rows:
            return
        slot_vals = {int(slots[r]) for r in rows}
        if len(slot_vals) != 1:
            raise ValueError(f"sampled attention rows span cache slots {sorted(slot_vals)}; one slot per run")
        slot = slot_vals.pop()
        key = (ks, self.path, layer)
        ref = self._kvref.get(key)
        pmax = max(pos)
        if ref is not None and (ref[0] is not kc or ref[2] != slot):
            raise ValueError("a run used two KV caches or slots; TapRecorder.run() covers one generate() call")
        self._kvref[key] = [kc, vc, slot, max(pmax, ref[3] if ref else -1)]
        self._keep(ks, "attention", layer, "attn", rows, pos, plan, {"q": q, "o": out}, {"slot": slot})

    def _rmsnorm(self, ks, plan, layer, positions, args, out):
        x, w, eps = args
        tag = self._name(w)
        self._last_norm = tag
        rows, pos = self._select()
        self.params[(layer, tag)] = w
        self._keep(ks, "rmsnorm", layer, tag, rows, pos, plan, {"x": x, "y": out}, {"eps": float(eps)})

    def _rope(self, ks, plan, layer, positions, args, out):
        x, pos_arg, theta = args
        tag = NORM_TO_ROPE.get(self._last_norm, f"call{self._occ[(layer, 'rope')]}")
        self._occ[(layer, "rope")] += 1
        rows, pos = self._select()
        self._keep(ks, "rope", layer, tag, rows, pos, plan, {"x": x, "y": out}, {"theta": float(theta)})

    def _residual(self, ks, plan, layer, positions, args, out):
        a, b = args
        n = self._occ[(layer, "residual")]
        self._occ[(layer, "residual")] += 1
        tag = ("attn", "moe")[n] if n < 2 else f"call{n}"
        rows, pos = self._select()
        self._keep(ks, "residual", layer, tag, rows, pos, plan, {"a": a, "b": b, "y": out})

    def _lm_head(self, ks, plan, layer, positions, args, out):
        x, w = args
        rows, pos = self._select()
        self.params[(layer, "lm_head")] = w
        self._keep(ks, "lm_head", layer, "lm_head", rows, pos, plan, {"x": x, "y": out.to(w.dtype)})
