"""DumpWriter: writes a dump set (docs/dumps.md) from any Python engine's kernel calls.

    with DumpWriter(folder, engine="mine", build="abc123") as dw:
        dw.add_weight("L0.wq", wq)                                   # stored once, referenced by name
        dw.add_call("dense", "prompt", "mine.gemm_tiled", rows=[(0, 0, 5, 17), (3, 0, 8, 99)], call_rows=16,
                    inputs={"x": x}, weights={"w": "L0.wq"}, outputs={"y": y}, replaces="mine.gemv", site="L0.wq")

Tensors are buffered and written to safetensors shards of about ``shard_bytes``; ``close`` writes the last shard,
then ``manifest.json`` atomically (a reader never sees a manifest naming a shard not yet written).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from ..files import write_json
from .format import BYTE_ORDER, FORMAT, FP8, MANIFEST, ROLES, VERSION, DumpError, dtype_name


@dataclass
class Fixed:
    """A call input that is not per row (a KV cache, a table): stored whole.

    Attributes:
        tensor: any shape; by_position: axis 0 is indexed by position and a row at position p reads entries
            0..p only (the checker then compares those entries when it asks whether two rows had equal inputs).
    """

    tensor: torch.Tensor
    by_position: bool = False


class DumpWriter:
    """Writes one dump set.

    Args:
        folder: a new or empty folder; engine, build: the engine's name and build id (a commit, a version).
        class_map: engine class name -> kernel class of this suite (KERNEL_CLASSES), when the engine's calls use
            its own class names.
        shard_bytes: bytes per tensor file before a new one is started.
        meta: free JSON-ready fields stored under the manifest's ``meta``.
    Raises:
        FileExistsError: ``folder`` holds files already.
    """

    def __init__(self, folder, engine: str, build: str = "", class_map: dict | None = None,
                 shard_bytes: int = 256 << 20, meta: dict | None = None):
        self.folder = str(folder)
        if os.path.isdir(self.folder) and os.listdir(self.folder):
            raise FileExistsError(f"{self.folder} is not empty; a dump set is written to a new folder")
        os.makedirs(self.folder, exist_ok=True)
        self.manifest = {"format": FORMAT, "version": VERSION, "byte_order": BYTE_ORDER,
                         "engine": {"name": engine, "build": build}, "class_map": dict(class_map or {}),
                         "meta": dict(meta or {}), "weights": {}, "calls": []}
        self.shard_bytes = shard_bytes
        self._buf: dict[str, torch.Tensor] = {}
        self._bytes, self._shard = 0, 0
        self.closed = False

    # ------------------------------------------------------------------ tensors
    def _file(self, prefix: str) -> str:
        return f"{prefix}-{self._shard:05d}.safetensors"

    def _put(self, key: str, t: torch.Tensor, scale: torch.Tensor | None = None) -> dict:
        """Buffer ``t`` under ``key``; returns its manifest reference."""
        t = t.detach().to("cpu").contiguous().clone()
        ref = {"file": self._file("tensors"), "key": key, "dtype": dtype_name(t.dtype)}
        self._buf[key] = t
        self._bytes += t.numel() * t.element_size()
        if scale is not None:
            if ref["dtype"] not in FP8:
                raise DumpError(f"tensor {key!r}: a scale belongs to fp8 tensors only, this one is {ref['dtype']}")
            self._buf[key + ".scale"] = scale.detach().to("cpu", torch.float32).contiguous().clone()
            ref["scale"] = {"file": ref["file"], "key": key + ".scale", "dtype": "fp32"}
        if self._bytes >= self.shard_bytes:
            self._flush()
        return ref

    def _flush(self) -> None:
        if self._buf:
            save_file(self._buf, os.path.join(self.folder, self._file("tensors")), metadata={"format": FORMAT})
            self._buf, self._bytes = {}, 0
            self._shard += 1

    # ------------------------------------------------------------------ records
    def add_weight(self, name: str, tensor: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Store weight ``name`` (any shape and format dtype) once; calls reference it by name.

        Raises:
            DumpError: a name stored twice, or a dtype the format does not name.
        """
        if name in self.manifest["weights"]:
            raise DumpError(f"weight {name!r} is added twice; weights are stored once")
        self.manifest["weights"][name] = self._put(f"w.{name}", tensor, scale)

    def has_weight(self, name: str) -> bool:
        """Whether weight ``name`` was added."""
        return name in self.manifest["weights"]

    def add_call(self, cls: str, role: str, kernel: str, rows, call_rows: int, inputs: dict | None = None,
                 outputs: dict | None = None, weights: dict | None = None, replaces: str | None = None,
                 site: str | None = None, fixed: dict | None = None, meta: dict | None = None,
                 scales: dict | None = None) -> int:
        """Record one kernel call; returns its id (the index in the manifest's ``calls``).

        Args:
            cls: kernel class (ours, or an engine name in ``class_map``); role: ``"prompt"`` or ``"decode"``.
            kernel: the kernel's name; replaces: for a prompt call, the decode kernel it claims to reproduce.
            rows: the dumped rows, each (row index in the call, sequence, position, token id).
            call_rows: M, the call's row count (the dumped rows may be a subset).
            inputs, outputs: name -> per-row tensor of the WHOLE call [call_rows, ...]; the dumped rows are kept.
            weights: argument name -> weight name (add_weight); fixed: name -> Fixed (or a tensor) stored whole.
            site: the call site (``"L0.wq"``) when a class is called from several places per forward.
            meta: JSON scalars (eps, top_k, ...); scales: name -> scale tensor of an fp8 input/output, whole call.
        Raises:
            DumpError: a bad role, an empty or out-of-range row list, a tensor whose first dim is not call_rows,
                an unknown weight name, or a closed writer.
        """
        if self.closed:
            raise DumpError("add_call on a closed DumpWriter")
        if role not in ROLES:
            raise DumpError(f"role must be one of {ROLES}, got {role!r}")
        rows = [tuple(int(v) for v in r) for r in rows]
        if not rows or any(len(r) != 4 or not 0 <= r[0] < call_rows for r in rows):
            raise DumpError(f"rows must be non-empty (row, seq, pos, token) tuples with 0 <= row < {call_rows}")
        for w in (weights or {}).values():
            if w not in self.manifest["weights"]:
                raise DumpError(f"call references weight {w!r}, which was not added (add_weight first)")
        cid = len(self.manifest["calls"])
        idx = torch.tensor([r[0] for r in rows], dtype=torch.int64)
        rec = {"id": cid, "class": cls, "role": role, "kernel": kernel, "replaces": replaces, "site": site,
               "call_rows": int(call_rows), "rows": [list(r) for r in rows], "inputs": {}, "fixed": {},
               "weights": dict(weights or {}), "outputs": {}, "meta": dict(meta or {})}
        scales = scales or {}
        for part, tensors in (("inputs", inputs), ("outputs", outputs)):
            for name, t in (tensors or {}).items():
                if t.dim() == 0 or t.shape[0] != call_rows:
                    raise DumpError(f"{part[:-1]} {name!r} has shape {tuple(t.shape)}; its first dim must be "
                                    f"call_rows={call_rows}")
                sc = scales.get(name)
                sc = sc[idx.to(sc.device)] if sc is not None and sc.dim() and sc.shape[0] == call_rows else sc
                rec[part][name] = self._put(f"c{cid}.{part[0]}.{name}", t[idx.to(t.device)], sc)
        for name, f in (fixed or {}).items():
            f = f if isinstance(f, Fixed) else Fixed(f)
            rec["fixed"][name] = {**self._put(f"c{cid}.f.{name}", f.tensor), "by_position": f.by_position}
        self.manifest["calls"].append(rec)
        return cid

    def close(self) -> str:
        """Write the last tensor file and then the manifest (atomically). Returns the manifest's path."""
        if not self.closed:
            self._flush()
            write_json(self.manifest, os.path.join(self.folder, MANIFEST))
            self.closed = True
        return os.path.join(self.folder, MANIFEST)

    def __enter__(self) -> "DumpWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
