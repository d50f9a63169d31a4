"""Dumps of this suite's engine: every kernel call of a run, observed through ``model.tapping``.

:func:`dumping` is a context manager: inside it every kernel call of every forward writes its dumped rows (those
whose position is in ``positions``; all when None) to a DumpWriter, with the class record's row arguments as
per-row inputs, weight arguments by name (stored once), the attention KV cache as a by-position fixed input, and
scalar arguments as meta. :func:`dump_engine` runs a prompt through the ``batched`` path (prompt role) and the
``decode`` path (decode role) inside it.

Call sites and rows: sites.CallSites (the class record's ``rows`` rule), shared with the FP64 taps.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..cache import KVCache
from ..kernels import KernelSet, class_record, get_set
from ..model import tapping
from ..paths import Schedule, prefill
from ..sites import CallSites
from .writer import DumpWriter, Fixed

ENGINE = "exactness"


class EngineDumper:
    """The tap (model.tapping) that writes kernel calls to a DumpWriter.

    Args:
        writer: the DumpWriter; weights: the run's ``Weights`` (names the weights; stored on first use).
        kernels: the KernelSet the run uses (names the kernels; an unregistered test set works too).
        tokens: [P] int64 token ids by position (the dumped rows' token field; -1 past P); seq: the sequence id.
        positions: positions to dump (None = all).
    Raises (from record):
        ValueError: expert weights that are not the model's resident tensors (expert offload), a call whose rows
            cannot be mapped, or dumped attention rows in two cache slots.
    """

    def __init__(self, writer: DumpWriter, weights, kernels: KernelSet, tokens: torch.Tensor, seq: int = 0,
                 positions=None):
        self.dw, self.ks, self.seq = writer, kernels, seq
        self.sites = CallSites(weights)
        self.names = self.sites.names
        self.tokens = [int(t) for t in tokens.cpu().tolist()]
        self.keep = None if positions is None else {int(p) for p in positions}

    def record(self, *, cls, role, plan, kernels, layer, positions, args, out) -> None:
        """Called by model.Ops for every kernel call: writes the call's dumped rows."""
        site, fwd_rows = self.sites.call(cls, layer, positions, args, out)
        outs, pos = out if isinstance(out, tuple) else (out,), self.sites.positions
        tok = lambda p: self.tokens[p] if p < len(self.tokens) else -1  # noqa: E731  (-1: a token not given)
        rows = [(i, self.seq, pos[r], tok(pos[r])) for i, r in enumerate(fwd_rows)
                if self.keep is None or pos[r] in self.keep]
        if rows:
            self._write(cls, role, site, args, outs, rows)

    def _write(self, cls, role, site, args, outs, rows) -> None:
        spec = (self.ks.prompt if role == "prompt" else self.ks.decode)[cls]
        rec = class_record(cls)
        names = rec.args or tuple(f"arg{i}" for i in range(len(args)))
        inputs, weights, fixed, meta = {}, {}, {}, {}
        for i, (name, a) in enumerate(zip(names, args)):
            if a is None:
                continue
            if not isinstance(a, torch.Tensor):
                meta[name] = a if isinstance(a, (bool, int, float, str)) else float(a)
            elif i in rec.row_args:
                inputs[name] = a
            elif a.data_ptr() in self.names:
                weights[name] = self._weight(a)
            else:
                fixed[name] = a
        if cls == "attention":
            fixed = self._kv(fixed, args[3], rows)
        self.dw.add_call(cls, role, spec.name, rows, outs[0].shape[0], inputs=inputs, weights=weights,
                         outputs=dict(zip(rec.outs, outs)), replaces=spec.replaces, site=site,
                         fixed=fixed, meta=meta)

    def _weight(self, t: torch.Tensor) -> str:
        name = self.names[t.data_ptr()]
        if not self.dw.has_weight(name):
            self.dw.add_weight(name, t)
        return name

    def _kv(self, fixed: dict, slots: torch.Tensor, rows) -> dict:
        """The dumped rows' cache slot, positions 0..max dumped position (a row at p reads 0..p)."""
        sl = {int(slots[r]) for r, *_ in rows}
        if len(sl) != 1:
            raise ValueError(f"dumped attention rows span cache slots {sorted(sl)}; dump one slot per call")
        s, top = sl.pop(), max(p for _, _, p, _ in rows) + 1
        return {n: Fixed(t[s, :top], by_position=True) for n, t in fixed.items()}


@contextmanager
def dumping(writer: DumpWriter, weights, kernels, tokens: torch.Tensor, seq: int = 0, positions=None):
    """Within the block, every kernel call of the engine is dumped to ``writer`` (see EngineDumper)."""
    rec = EngineDumper(writer, weights, get_set(kernels), tokens, seq, positions)
    with tapping(rec), torch.no_grad():
        yield rec


def dump_engine(folder, weights, prompt_ids: torch.Tensor, kernels="invariant", step: int | None = None,
                positions=None, build: str = "", path: str = "batched", deep_threshold: int = 512) -> str:
    """Dump one prompt prefilled twice: ``path`` (``batched`` or ``deep``) in segments of ``step`` rows (prompt
    role; None = one segment) and the ``decode`` path (decode role, one row per forward). Returns the folder.

    Args:
        weights: Weights (bf16/fp32, any device); prompt_ids: [P] int64; kernels: a set name or KernelSet.
        positions: positions to dump (None = all P); deep_threshold: segments of at least this many rows run the
            deep plan on the deep path.
    Raises:
        ValueError: an unknown kernel set or path, or a prompt longer than the model's max_positions.
        FileExistsError: ``folder`` is not empty.
    """
    ks = get_set(kernels)
    if path not in ("batched", "deep"):
        raise ValueError(f"path {path!r} has no prompt role; allowed: batched, deep")
    ids = prompt_ids.to(torch.int64).cpu()
    P = ids.numel()
    if P > weights.cfg.max_positions:
        raise ValueError(f"prompt of {P} tokens exceeds max_positions={weights.cfg.max_positions}")
    meta = {"kernel_set": ks.name, "prompt_tokens": P, "path": path, "step": step, "deep_threshold": deep_threshold,
            "dtype": str(weights.dtype).replace("torch.", "")}
    with DumpWriter(folder, ENGINE, build, meta=meta) as dw, dumping(dw, weights, ks, ids, positions=positions):
        for sched in (Schedule(path, step, deep_threshold), Schedule("decode")):
            prefill(weights, KVCache(weights.cfg, P, 1, weights.dtype, weights.device), ids, ks, sched)
    return str(folder)
