"""The tap recorder: a bounded sample of the exact inputs and outputs of every kernel call, copied to the CPU.

Use with ``model.tapping(recorder)`` (model.py): inside the block every kernel call reports
``record(cls, role, plan, kernels, layer, positions, args, out)``. The recorder keeps only the rows whose prompt
position is in a fixed set ``positions`` (the same set on every path, so the same rows can be compared between the
decode oracle and the batched/deep runs), at most one sample per (layer, class, weight, position) and run: that
bounds memory by ``len(positions)`` per (layer, class, weight).

Each call's site and the forward row of each of its rows come from sites.CallSites (the class record's ``rows``
rule), as for our engine's tensor dumps; a sample's tag is its site without the layer (``wq``, ``e3``, ``attn``,
``rope_q``, ``residual_attn``, ``final_norm``). A quantized weight (kernels/quant.QuantWeight) is kept and named
like a tensor (by its codes' address). Weights are named from the model's tensors (``wq``, ``e3.gate``,
``shared.up``, ``final_norm``, ...) when ``weights`` is given; otherwise by address (routed experts then cannot be
mapped: a ValueError). Attention samples keep the query row and output; the keys/values up to the largest sampled
position are copied once per (run, layer) when the run ends (:meth:`TapRecorder.run`).
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..kernels.registry import ClassNames
from ..sites import CallSites


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
        calls: (kernels, path, cls, plan) -> number of kernel calls seen (in the forwards shown: wants).
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
        self.sites = CallSites(weights)
        self._wanted = set(pos)
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
            self._any = bool(torch.isin(positions.cpu(), self.positions).any())

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

    def wants(self, positions) -> bool:
        """Whether a forward of the rows at host ``positions`` (ints) holds a sampled row (model.taps_want): a CUDA
        graph replays the others untapped, so ``calls`` counts the calls of the forwards shown."""
        return not self._wanted.isdisjoint(int(p) for p in positions)

    # ------------------------------------------------------------------ the tap
    def record(self, *, cls, role, plan, kernels, layer, positions, args, out) -> None:
        """Called by model.Ops for every kernel call (see model.tapping). Keeps the sampled rows only."""
        if self.path is None:
            if cls not in self.classes:
                return
            raise RuntimeError("TapRecorder records inside `with recorder.run(path):` only (a sample's data "
                               "reaches the CPU when its run ends)")
        self._new_forward(positions)
        if cls in self.classes:
            self.calls[(kernels, self.path, cls, plan)] += 1
        if not self._any:                  # a forward with no sampled row costs a dict update per call
            return
        site, fwd_rows = self.sites.call(cls, layer, positions, args, out)
        if cls not in self.classes:
            return
        pos = self.sites.positions
        sel = [(i, pos[r]) for i, r in enumerate(fwd_rows) if pos[r] in self._wanted]
        tag = site.split(".", 1)[1] if layer >= 0 and site.startswith(f"L{layer}.") else site
        data, meta, weights = _TAP_DATA.get(cls, _generic)(args, out)
        for part, wt in weights.items():
            self.params[(layer, tag + part)] = wt
        if cls == "attention" and sel:
            meta = {"slot": self._kv_ref(kernels, layer, args, [i for i, _ in sel], [p for _, p in sel])}
        self._keep(kernels, cls, layer, tag, [i for i, _ in sel], [p for _, p in sel], plan, data, meta)

    def _kv_ref(self, ks, layer, args, rows, pos) -> int:
        """Note the cache and slot of sampled attention rows (their keys/values are copied when the run ends);
        returns the slot."""
        q, kc, vc, slots, _ = args
        slot_vals = {int(slots[r]) for r in rows}
        if len(slot_vals) != 1:
            raise ValueError(f"sampled attention rows span cache slots {sorted(slot_vals)}; one slot per run")
        slot = slot_vals.pop()
        key = (ks, self.path, layer)
        ref = self._kvref.get(key)
        if ref is not None and (ref[0] is not kc or ref[2] != slot):
            raise ValueError("a run used two KV caches or slots; TapRecorder.run() covers one generate() call")
        self._kvref[key] = [kc, vc, slot, max(max(pos), ref[3] if ref else -1)]
        return slot


def _generic(args, out) -> tuple[dict, dict, dict]:
    """A class without an entry below: its tensor arguments and outputs under the record-free names arg<i>/y."""
    outs = out if isinstance(out, tuple) else (out,)
    data = {f"arg{i}": a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    return {**data, **{("y" if i == 0 else f"y{i}"): o for i, o in enumerate(outs)}}, {}, {}


def _router(args, out):
    x, w, top_k, norm, *groups = args      # groups: (n_groups, topk_groups), passed for grouped routing only
    meta = {"top_k": top_k, "norm": norm}
    if groups and groups[0] is not None and groups[0][0] > 1:
        meta["groups"] = (int(groups[0][0]), int(groups[0][1]))
    weights, idx, logits = out
    return {"x": x, "y": logits, "idx": idx, "g": weights}, meta, {"": w}


def _moe_combine(args, out):
    y, g, shared = args
    return {"y": y, "g": g, "out": out, **({"shared": shared} if shared is not None else {})}, {}, {}


# class -> (args, out) -> (data: name -> [M, ...] tensor, meta: scalars, weights: tag suffix -> weight tensor); the
# names the FP64 evaluators read (fp64/ref.py).
_TAP_DATA = {
    "dense": lambda a, o: ({"x": a[0], "y": o}, {}, {"": a[1]}),
    "router": _router,
    "expert_gate_up": lambda a, o: ({"x": a[0], "y": o}, {}, {".gate": a[1], ".up": a[2]}),
    "expert_down": lambda a, o: ({"x": a[0], "y": o}, {}, {".down": a[1]}),
    "moe_combine": _moe_combine,
    "attention": lambda a, o: ({"q": a[0], "o": o}, {}, {}),
    "rmsnorm": lambda a, o: ({"x": a[0], "y": o}, {"eps": float(a[2])}, {"": a[1]}),
    "rope": lambda a, o: ({"x": a[0], "y": o}, {"theta": float(a[2])}, {}),
    "residual": lambda a, o: ({"a": a[0], "b": a[1], "y": o}, {}, {}),
    "lm_head": lambda a, o: ({"x": a[0], "y": o.to(a[1].dtype)}, {}, {"": a[1]}),
}
