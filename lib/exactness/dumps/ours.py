"""Dumps of this suite's engine: every kernel call of a run, observed through ``model.tapping``.

:func:`dumping` is a context manager: inside it every kernel call of every forward writes its dumped rows (those
whose position is in ``positions``; all when None) to a DumpWriter, with the class record's row arguments as
per-row inputs, weight arguments by name (stored once), the attention KV cache as a by-position fixed input, and
scalar arguments as meta. :func:`dump_engine` runs a prompt through the ``batched`` path (prompt role) and the
``decode`` path (decode role) inside it.

Call sites and rows per class (rows are the forward's rows unless said):
    dense                site = the weight (``L0.wq``); on the deep plan the rows of consecutive tiles are
                         counted with a per-site offset
    expert_gate_up       site ``L<l>.e<e>`` (``L<l>.shared``): a routed expert's rows are the forward rows that
                         picked it in the router call of the same layer, ascending (model.moe_block's order), tiled
                         as the deep plan tiles them; the shared expert's are all rows
    expert_down          the rows of the expert_gate_up call just before it (model.Ops.expert chains the two)
    router, moe_combine, attention, residual, rope, rmsnorm, lm_head
                         one site per layer and use (``L0.router``, ``L0.residual_attn``, ``L0.rope_q``; norms by
                         weight: ``L0.q_norm``, ``final_norm``)
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..cache import KVCache
from ..kernels import KernelSet, class_record, get_set
from ..model import tapping
from ..paths import Schedule, prefill
from .writer import DumpWriter, Fixed

ENGINE = "exactness"
NORM_TO_ROPE = {"q_norm": "rope_q", "k_norm": "rope_k"}


def weight_names(w) -> dict[int, str]:
    """data_ptr -> layer-qualified name (``L0.wq``, ``L1.e3.gate``, ``L0.shared.up``, ``final_norm``) of every
    weight tensor of a ``Weights`` (expert slices included)."""
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
        self.names = weight_names(weights)
        self.tokens = [int(t) for t in tokens.cpu().tolist()]
        self.keep = None if positions is None else {int(p) for p in positions}
        self._fwd = None

    def _new_forward(self, positions: torch.Tensor) -> None:
        if positions is not self._fwd:
            self._fwd = positions       # held so that its id is not reused by a later forward
            self._pos = positions.cpu().tolist()
            self._off, self._idx, self._last_norm, self._occ, self._gate_rows = {}, {}, None, {}, None

    def _site(self, cls: str, layer: int, args) -> str:
        pre = f"L{layer}." if layer >= 0 else ""
        if cls in ("dense", "rmsnorm"):
            name = self.names.get(args[1].data_ptr(), f"ptr{args[1].data_ptr():x}")
            if cls == "rmsnorm":
                self._last_norm = name.rsplit(".", 1)[-1]
            return name
        if cls in ("expert_gate_up", "expert_down"):
            if args[1].data_ptr() not in self.names:   # staged copies (expert offload) name no model weight
                raise ValueError(f"{cls}: its weights are none of the model's tensors; dumps need resident experts")
            return self.names[args[1].data_ptr()].rsplit(".", 1)[0]
        if cls in ("rope", "residual"):
            n = self._occ[(layer, cls)] = self._occ.get((layer, cls), -1) + 1
            tag = NORM_TO_ROPE.get(self._last_norm, f"rope{n}") if cls == "rope" else \
                (("residual_attn", "residual_moe")[n] if n < 2 else f"residual{n}")
            return pre + tag
        return pre + {"moe_combine": "combine", "attention": "attn"}.get(cls, cls)

    def _rows(self, cls: str, site: str, M: int, layer: int) -> list[int]:
        """Forward row index of each of the call's M rows."""
        if cls == "expert_down":
            return self._gate_rows
        if cls == "expert_gate_up" and ".e" in site:
            e = int(site.rsplit(".e", 1)[1])
            pool = (self._idx[layer] == e).any(dim=1).nonzero().flatten().tolist()
        elif cls in ("dense", "expert_gate_up"):
            pool = list(range(len(self._pos)))
        else:
            return list(range(M))
        off = self._off.get(site, 0)      # deep plan: consecutive tiles of the same site's rows
        self._off[site] = off + M
        return pool[off:off + M]

    def record(self, *, cls, role, plan, kernels, layer, positions, args, out) -> None:
        """Called by model.Ops for every kernel call: writes the call's dumped rows."""
        self._new_forward(positions)
        site = self._site(cls, layer, args)
        outs = out if isinstance(out, tuple) else (out,)
        if cls == "router":
            self._idx[layer] = outs[1].cpu()
        fwd_rows = self._rows(cls, site, outs[0].shape[0], layer)
        if cls == "expert_gate_up":
            self._gate_rows = fwd_rows
        if len(fwd_rows) != outs[0].shape[0]:
            raise ValueError(f"{cls} at {site}: {outs[0].shape[0]} call rows, {len(fwd_rows)} rows mapped")
        tok = lambda p: self.tokens[p] if p < len(self.tokens) else -1  # noqa: E731  (-1: a token not given)
        rows = [(i, self.seq, self._pos[r], tok(self._pos[r])) for i, r in enumerate(fwd_rows)
                if self.keep is None or self._pos[r] in self.keep]
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
