"""Reading ggml graph nodes from Python: the ``ggml_tensor`` struct (ctypes), op names, and a node's bytes as a torch
tensor. Used by the llama.cpp dump writer (llamacpp.py) inside ggml's scheduler eval callback, where each node's
``data`` is host memory of the CPU backend.

A node's torch view has ggml's dims reversed (``[ne3, ne2, ne1, ne0]``) and its strides (``nb``), so axis ``a``
of ggml is torch axis ``3 - a``. The struct layout is checked against the library on the first node
(:meth:`Ggml.check`): ``ggml_get_name(t)`` must be the struct's ``name`` field and ``ggml_nbytes`` must agree
with ``ne``/``nb``.
"""
from __future__ import annotations

import ctypes

import torch

from .format import DumpError

MAX_DIMS, MAX_SRC = 4, 10
# ggml_type id -> torch dtype of the types read back (quantized types are not).
TYPES = {0: torch.float32, 1: torch.float16, 24: torch.int8, 25: torch.int16, 26: torch.int32, 27: torch.int64,
         28: torch.float64, 30: torch.bfloat16}
SHAPE_OPS = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}   # no computation: no call of their own


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` of ggml.h (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * MAX_DIMS),
                ("nb", ctypes.c_size_t * MAX_DIMS), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * MAX_SRC), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


class Ggml:
    """ggml's op and type names and the layout check, from llama-cpp-python's libggml."""

    def __init__(self):
        from llama_cpp._ggml import libggml
        self.lib, self.checked, self._ops = libggml, False, {}
        for fn, res, args in (("ggml_op_name", ctypes.c_char_p, [ctypes.c_int]),
                              ("ggml_get_name", ctypes.c_void_p, [ctypes.c_void_p]),
                              ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
                              ("ggml_type_name", ctypes.c_char_p, [ctypes.c_int]),
                              ("ggml_backend_buffer_is_host", ctypes.c_bool, [ctypes.c_void_p])):
            getattr(libggml, fn).restype, getattr(libggml, fn).argtypes = res, args

    def op(self, t: GgmlTensor) -> str:
        """ggml's name of the node's op (``MUL_MAT``, ``RMS_NORM``; ``NONE`` for a leaf)."""
        if t.op not in self._ops:
            self._ops[t.op] = self.lib.ggml_op_name(t.op).decode()
        return self._ops[t.op]

    def type_name(self, t: GgmlTensor) -> str:
        return self.lib.ggml_type_name(t.type).decode()

    def host(self, t: GgmlTensor) -> bool:
        """Whether the node's data is host memory (the CPU backend's; a GPU buffer is not read)."""
        return bool(t.buffer) and bool(self.lib.ggml_backend_buffer_is_host(t.buffer))

    def check(self, ptr: int) -> None:
        """Check the struct layout on node ``ptr`` once. Raises DumpError when this ggml's struct differs."""
        if self.checked:
            return
        t = GgmlTensor.from_address(ptr)
        ok = self.lib.ggml_get_name(ptr) == ptr + GgmlTensor.name.offset
        if ok and t.type in TYPES:
            ok = self.lib.ggml_nbytes(ptr) == _extent(t)
        if not ok:
            raise DumpError("this ggml's struct ggml_tensor is not the layout dumps/ggml.py reads (GGML_MAX_SRC 10, "
                            "name after data); the llama.cpp dump writer cannot read its nodes")
        self.checked = True


def node(ptr: int) -> GgmlTensor:
    """The ggml_tensor at address ``ptr``."""
    return GgmlTensor.from_address(ptr)


def name(ptr: int | None) -> str | None:
    return GgmlTensor.from_address(ptr).name.decode(errors="replace") if ptr else None


def _extent(t: GgmlTensor) -> int:
    """Bytes from the first to one past the last element (the span ``data`` covers)."""
    size = torch.tensor([], dtype=TYPES[t.type]).element_size()
    if any(n == 0 for n in t.ne):
        return 0
    return sum((t.ne[i] - 1) * t.nb[i] for i in range(MAX_DIMS)) + size


def readable(t: GgmlTensor) -> bool:
    """Whether the node's type is read back (not quantized) and its data is set."""
    return t.type in TYPES and bool(t.data)


def view(t: GgmlTensor) -> torch.Tensor:
    """The node's bytes in place as a torch tensor ``[ne3, ne2, ne1, ne0]`` with ggml's strides (shares ggml's
    memory: writing to it writes the node). Raises DumpError for a type it does not read (quantized)."""
    if not readable(t):
        raise DumpError(f"ggml node {t.name.decode(errors='replace')!r}: type {t.type} has no data or is not one of "
                        "f32, f16, bf16, f64 and the integer types")
    dtype = TYPES[t.type]
    size = torch.tensor([], dtype=dtype).element_size()
    if any(n % size for n in t.nb):
        raise DumpError(f"ggml node {t.name.decode(errors='replace')!r}: strides {list(t.nb)} are not whole elements")
    n = _extent(t)
    raw = torch.frombuffer((ctypes.c_uint8 * max(n, size)).from_address(t.data), dtype=torch.uint8)
    flat = raw.view(dtype)
    return flat.as_strided([t.ne[3], t.ne[2], t.ne[1], t.ne[0]], [t.nb[3] // size, t.nb[2] // size,
                                                                  t.nb[1] // size, t.nb[0] // size])


def op_floats(t: GgmlTensor) -> list[float]:
    """The node's op_params read as float32 (RMS_NORM's eps is [0], ROPE's freq_base [5])."""
    return [float(v) for v in torch.tensor(list(t.op_params), dtype=torch.int32).view(torch.float32)]


def _stride_axis(t: GgmlTensor, nb: int, ne: int | None = None) -> int | None:
    """The axis of ``t`` with byte stride ``nb`` (and length ``ne`` when given); the highest when several."""
    hits = [a for a in range(MAX_DIMS) if t.nb[a] == nb and (ne is None or t.ne[a] == ne) and t.ne[a] > 1]
    return hits[-1] if hits else None


class Axes:
    """The token axis and the KV-cell axis (ggml axis numbers, or None) of the nodes of one graph (one
    micro-batch of ``T`` tokens), carried from the inputs through each op (``of``)."""

    def __init__(self, ggml: Ggml, T: int):
        self.g, self.T, self.memo = ggml, T, {}

    def of(self, ptr: int) -> tuple[int | None, int | None]:
        """(token axis, cell axis) of node ``ptr``; the token axis is checked to hold T entries (a KQ mask's,
        padded, at least T)."""
        if ptr not in self.memo:
            t = node(ptr)
            tok, cell = self._rule(t, self.g.op(t))
            if tok is not None and not (0 <= tok < MAX_DIMS and (t.ne[tok] == self.T or (
                    tok == 1 and _is_mask(t) and t.ne[1] >= self.T))):
                tok = self._guess(t)
            self.memo[ptr] = (tok, cell)
        return self.memo[ptr]

    def _guess(self, t: GgmlTensor) -> int | None:
        hits = [a for a in range(MAX_DIMS) if t.ne[a] == self.T]
        return hits[-1] if hits else None

    def _cache_cell(self, t: GgmlTensor) -> int | None:
        """The cell axis of a view of a KV cache: the cache's row stride, else contiguous cells (a V cache
        stored transposed)."""
        cache = node(t.view_src)
        a = _stride_axis(t, cache.nb[1])
        return a if a is not None else (0 if t.nb[0] == cache.nb[0] and t.ne[0] > 1 else None)

    def _rule(self, t: GgmlTensor, op: str) -> tuple[int | None, int | None]:
        nm = t.name.decode(errors="replace")
        src = [s for s in t.src]
        if t.view_src and name(t.view_src).startswith("cache_"):
            return None, self._cache_cell(t)
        if op == "NONE":
            if _is_mask(t):
                return 1, 0
            if nm.startswith("cache_"):
                return None, 1
            is_row = (nm.startswith("inp_") or "_inp_" in nm or nm == "out_ids") and t.ne[0] == self.T and \
                t.ne[1] == 1
            return (0 if is_row else None), None
        s0 = self.of(src[0]) if src[0] else (None, None)
        if op == "PERMUTE":
            perm = list(t.op_params)[:4]
            return tuple(None if a is None else perm[a] for a in s0)
        if op == "TRANSPOSE":
            return tuple(None if a is None else {0: 1, 1: 0}.get(a, a) for a in s0)
        if op in ("VIEW", "RESHAPE"):
            s = node(src[0])
            if s0[0] is None:
                return None, None
            if self.T == 1:   # the lowest axis of length 1 with the token's stride
                hits = [a for a in range(MAX_DIMS) if t.ne[a] == 1 and t.nb[a] == s.nb[s0[0]]]
                return (hits[0] if hits else self._guess(t)), None
            return _stride_axis(t, s.nb[s0[0]], s.ne[s0[0]]), None
        if op == "MUL_MAT":
            s1 = self.of(src[1])
            return (s1[0] if s1[0] else None), (0 if s0[1] == 1 else None)
        if op == "MUL_MAT_ID":
            ids = self.of(src[2])
            return (None if ids[0] is None else ids[0] + 1), None
        if op == "GET_ROWS":
            rows = self.of(src[1])
            return (None if rows[0] is None else rows[0] + 1), None
        return s0


def _is_mask(t: GgmlTensor) -> bool:
    return t.name.decode(errors="replace").endswith("kq_mask")
