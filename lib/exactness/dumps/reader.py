"""Reading and validating a dump set (docs/dumps.md); tensors are read one call at a time.

``read_dump(folder)`` checks the whole manifest and every tensor file's header (names, dtypes, shapes; no tensor
data is read) and raises :class:`DumpError` with one line naming the first defect: a missing file or tensor, a
tensor whose rows disagree with the call's dumped rows, an unknown class or dtype, a row claimed by two calls of
one class, role and site, or a format version this reader does not read. ``DumpSet.tensors(call, part)`` then loads
one call's tensors (safetensors ``safe_open``: only the asked tensors are read), so memory stays bounded by a call.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from ..kernels.registry import KERNEL_CLASSES
from .format import (BYTE_ORDER, DTYPES, FORMAT, FP8, MANIFEST, PARTS, ROLES, VERSION, DumpError, torch_dtype)


@dataclass
class Call:
    """One kernel call of a dump set (the manifest's call record, checked).

    Attributes:
        id, cls (our class name, after class_map), engine_cls (as written), role, kernel, replaces, site, call_rows.
        rows: [(row, seq, pos, token)] dumped rows; refs: part -> name -> tensor reference; weights: arg -> name.
    """

    id: int
    cls: str
    engine_cls: str
    role: str
    kernel: str
    replaces: str | None
    site: str | None
    call_rows: int
    rows: list
    refs: dict
    weights: dict
    meta: dict = field(default_factory=dict)

    def label(self) -> str:
        """``call 17 (dense prompt L0.wq)`` for messages."""
        return f"call {self.id} ({self.cls} {self.role}{' ' + self.site if self.site else ''})"


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise DumpError(msg)


class DumpSet:
    """A validated dump set. Use :func:`read_dump`.

    Attributes:
        folder, manifest (the parsed JSON), calls (list[Call], in the manifest's order: the engine's call order),
        weights (name -> reference), engine ({"name", "build"}).
    """

    def __init__(self, folder):
        self.folder = str(folder)
        self._files: dict[str, object] = {}
        self._headers: dict[str, dict] = {}
        self.manifest = self._load_manifest()
        m = self.manifest
        self.engine = m["engine"]
        self.weights = m["weights"]
        self.class_map = m.get("class_map") or {}
        self._check_class_map()
        for name, ref in self.weights.items():
            self._check_ref(ref, f"weight {name!r}", None)
        self.calls = [self._call(i, c) for i, c in enumerate(m["calls"])]
        self._check_claims()

    # ------------------------------------------------------------------ manifest
    def _load_manifest(self) -> dict:
        path = os.path.join(self.folder, MANIFEST)
        _need(os.path.isfile(path), f"{self.folder}: no {MANIFEST} (not a dump set, or its writer did not close)")
        try:
            with open(path, encoding="utf-8") as fh:
                m = json.load(fh)
        except json.JSONDecodeError as e:
            raise DumpError(f"{path}: not valid JSON ({e})") from None
        _need(isinstance(m, dict) and m.get("format") == FORMAT,
              f"{path}: format {m.get('format') if isinstance(m, dict) else None!r} is not {FORMAT!r}")
        _need(m.get("version") == VERSION, f"{path}: version mismatch: the set is version {m.get('version')!r}, "
                                           f"this reader reads version {VERSION}")
        _need(m.get("byte_order") == BYTE_ORDER, f"{path}: byte_order {m.get('byte_order')!r}; only "
                                                 f"{BYTE_ORDER!r} is defined")
        eng = m.get("engine")
        _need(isinstance(eng, dict) and isinstance(eng.get("name"), str) and isinstance(eng.get("build"), str),
              f"{path}: engine must be an object with string fields name and build, got {eng!r}")
        for key in ("weights", "calls"):
            _need(isinstance(m.get(key), dict if key == "weights" else list), f"{path}: field {key!r} is missing "
                                                                              "or of the wrong type")
        return m

    def _check_class_map(self) -> None:
        _need(isinstance(self.class_map, dict), f"class_map must be an object, got {self.class_map!r}")
        for k, v in self.class_map.items():   # null: an engine class of its own, kept under its name
            _need(v is None or v in KERNEL_CLASSES, f"class_map maps {k!r} to unknown class {v!r}; known: "
                                                    f"{', '.join(KERNEL_CLASSES)}, or null")

    def _call(self, i: int, c: dict) -> Call:
        """The checked Call of record ``c`` (fields first, then its tensors against the files' headers)."""
        call = self._record(i, c)
        for part in PARTS:
            for name, ref in call.refs[part].items():
                n_rows = None if part == "fixed" else len(call.rows)
                self._check_ref(ref, f"{call.label()}: {part[:-1]} {name!r}", n_rows)
        top = max(r[2] for r in call.rows)
        for name, ref in call.refs["fixed"].items():
            n = (self._headers[ref["file"]][ref["key"]][1] or [0])[0]
            _need(not ref.get("by_position") or n > top, f"{call.label()}: fixed {name!r} holds {n} positions, a "
                                                         f"dumped row is at position {top}")
        for arg, w in call.weights.items():
            _need(w in self.weights, f"{call.label()}: weight {arg!r} names {w!r}, which is not in weights")
        return call

    def _record(self, i: int, c: dict) -> Call:
        """Check the fields of call record ``c`` (index ``i``); tensors are checked by the caller."""
        _need(isinstance(c, dict), f"call {i}: the record is not an object")
        _need(c.get("id", i) == i, f"call {i}: id {c.get('id')!r} is not its index {i} in calls")
        ecls = c.get("class")
        cls = self.class_map.get(ecls) or ecls   # a class_map value null keeps the engine's class name
        _need(cls in KERNEL_CLASSES or (isinstance(ecls, str) and ecls in self.class_map),
              f"call {i}: unknown class {ecls!r}; known: {', '.join(KERNEL_CLASSES)}, "
              f"or a key of class_map ({', '.join(self.class_map) or 'empty'})")
        _need(c.get("role") in ROLES, f"call {i}: role {c.get('role')!r}; allowed: {', '.join(ROLES)}")
        _need(isinstance(c.get("kernel"), str) and c["kernel"], f"call {i}: kernel name missing")
        _need(c["role"] == "decode" or isinstance(c.get("replaces"), str),
              f"call {i}: a prompt call must name the decode kernel it replaces (field 'replaces')")
        M = c.get("call_rows")
        _need(type(M) is int and M >= 1, f"call {i}: call_rows must be an int >= 1, got {M!r}")
        rows = c.get("rows")
        where = f"call {i} ({ecls} {c['role']} {c.get('site') or 'no site'})"
        _need(isinstance(rows, list) and bool(rows), f"{where}: rows must be a non-empty list of [row, seq, pos, "
                                                     f"token] integer lists, got {rows!r}"[:300])
        bad = next((r for r in rows if not (isinstance(r, list) and len(r) == 4 and
                                            all(type(v) is int for v in r))), None)
        _need(bad is None, f"{where}: row entry {bad!r} is not a [row, seq, pos, token] list of 4 integers")
        idx = [r[0] for r in rows]
        out = next((r for r in idx if not 0 <= r < M), None)
        _need(out is None, f"{where}: dumped row index {out} is outside 0..{M - 1} (call_rows {M})")
        _need(len(set(idx)) == len(idx), f"call {i}: a row index is dumped twice")
        for key in (*PARTS, "weights", "meta"):
            _need(isinstance(c.get(key) or {}, dict), f"call {i}: field {key!r} must be an object")
        _need(bool(c.get("outputs")), f"call {i}: no outputs")
        return Call(i, cls, ecls, c["role"], c["kernel"], c.get("replaces"), c.get("site"), M,
                    [tuple(r) for r in rows], {p: dict(c.get(p) or {}) for p in PARTS}, dict(c.get("weights") or {}),
                    dict(c.get("meta") or {}))

    def _check_ref(self, ref, what: str, n_rows: int | None) -> None:
        """Check a tensor reference against its file's header (existence, dtype, leading dim = n_rows)."""
        _need(isinstance(ref, dict) and all(isinstance(ref.get(k), str) for k in ("file", "key", "dtype")),
              f"{what}: a tensor reference needs string fields file, key and dtype, got {ref!r}")
        _need(ref["dtype"] in DTYPES, f"{what}: unknown dtype {ref['dtype']!r}; allowed: {', '.join(DTYPES)}")
        header = self._header(ref["file"], what)
        _need(ref["key"] in header, f"{what}: tensor {ref['key']!r} is missing from {ref['file']}")
        stored, shape = header[ref["key"]]
        _need(stored == DTYPES[ref["dtype"]][0], f"{what}: the manifest says {ref['dtype']}, {ref['file']} stores "
                                                 f"{stored}")
        if n_rows is not None:
            _need(bool(shape) and shape[0] == n_rows, f"{what}: shape mismatch: tensor {ref['key']!r} has shape "
                                                      f"{shape}, the call dumps {n_rows} row(s)")
        if "scale" in ref:
            _need(ref["dtype"] in FP8, f"{what}: a scale is allowed on fp8 tensors only, not {ref['dtype']}")
            self._check_ref(ref["scale"], what + " scale", None)

    def _header(self, file: str, what: str) -> dict:
        """key -> (safetensors dtype, shape) of ``file``, read once from its header (no tensor data)."""
        if file not in self._headers:
            path = os.path.join(self.folder, file)
            _need(os.path.basename(file) == file and file not in (".", ".."),
                  f"{what}: file {file!r} has a folder part; allowed: a plain file name in {self.folder}")
            _need(os.path.isfile(path), f"{what}: file {file!r} is missing from {self.folder}")
            try:
                with open(path, "rb") as fh:
                    n = struct.unpack("<Q", fh.read(8))[0]
                    head = json.loads(fh.read(n))
                self._headers[file] = {k: (v["dtype"], list(v["shape"])) for k, v in head.items()
                                       if k != "__metadata__"}
            except (struct.error, ValueError, KeyError, TypeError) as e:
                raise DumpError(f"{what}: {file} is not a readable safetensors file ({e})") from None
        return self._headers[file]

    def _check_claims(self) -> None:
        seen: dict[tuple, int] = {}
        for c in self.calls:
            for _, seq, pos, _ in c.rows:
                key = (c.cls, c.role, c.site, seq, pos)
                _need(key not in seen, f"{c.label()}: row (seq {seq}, pos {pos}) is also claimed by call "
                                       f"{seen.get(key)} of the same class, role and site")
                seen[key] = c.id

    # ------------------------------------------------------------------ data
    def tensor(self, ref: dict) -> torch.Tensor:
        """The tensor of one reference (fp8 stays fp8: its scale is ``tensor(ref["scale"])``)."""
        if ref["file"] not in self._files:
            self._files[ref["file"]] = safe_open(os.path.join(self.folder, ref["file"]), framework="pt")
        t = self._files[ref["file"]].get_tensor(ref["key"])
        _need(t.dtype == torch_dtype(ref["dtype"]), f"tensor {ref['key']!r}: read as {t.dtype}")
        return t

    def tensors(self, call: Call, part: str, scales: bool = False) -> dict[str, torch.Tensor]:
        """name -> tensor of one part (``inputs``/``fixed``/``outputs``) of ``call``; per-row parts are
        [len(call.rows), ...] in the order of ``call.rows``. With ``scales``, an fp8 tensor's scale is included
        as ``"<name>.scale"``."""
        out = {n: self.tensor(r) for n, r in call.refs[part].items()}
        if scales:
            out.update({f"{n}.scale": self.tensor(r["scale"]) for n, r in call.refs[part].items() if "scale" in r})
        return out

    def weight(self, name: str) -> torch.Tensor:
        """Weight ``name``. Raises DumpError when the set has no such weight."""
        _need(name in self.weights, f"no weight {name!r} in the dump set")
        return self.tensor(self.weights[name])


def read_dump(folder) -> DumpSet:
    """Open and validate the dump set in ``folder``.

    Raises:
        DumpError: the first defect found, in one line (see the module docstring).
    """
    return DumpSet(folder)
