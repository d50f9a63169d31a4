"""The KV cache of a llama.cpp sequence, read from its ``llama_state_seq_get_data`` blob (engines/llamacpp.py)."""
from __future__ import annotations

import struct

import torch

# ggml type id -> (torch dtype, bytes per element) of the KV cache types the parser reads.
_GGML_TYPES = {0: (torch.float32, 4), 1: (torch.float16, 2), 30: (torch.bfloat16, 2)}
_SEQ_MAGIC = 0xAF143CD8  # llama_state_seq_get_data's leading io magic


class _Reader:
    def __init__(self, blob: bytes):
        self.blob, self.at = blob, 0

    def take(self, fmt: str):
        if self.at + struct.calcsize(fmt) > len(self.blob):
            raise ValueError(f"the blob ends at byte {len(self.blob)} inside a header")
        v = struct.unpack_from(fmt, self.blob, self.at)
        self.at += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def tensor(self, nbytes: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        if self.at + nbytes > len(self.blob):
            raise ValueError(f"the blob ends at byte {len(self.blob)} inside a tensor of {nbytes} bytes")
        raw = torch.frombuffer(bytearray(self.blob[self.at:self.at + nbytes]), dtype=torch.uint8)
        self.at += nbytes
        return raw.view(dtype).reshape(shape)


def _kv_header(r: _Reader, layer: int, what: str, transposed: bool) -> tuple[torch.dtype, int, int]:
    """(dtype, element size, row width or 0) of one layer's K or V block; ValueError on an unknown type."""
    t = r.take("<i")
    if t not in _GGML_TYPES:
        raise ValueError(f"layer {layer} {what}: ggml type {t} is not one of {sorted(_GGML_TYPES)} (f32/f16/bf16)")
    dtype, el = _GGML_TYPES[t]
    if transposed:
        el_ref, width = r.take("<II")
        if el_ref != el:
            raise ValueError(f"layer {layer} V: element size {el_ref}, expected {el}")
        return dtype, el, width
    row = r.take("<Q")
    if row % el:
        raise ValueError(f"layer {layer} {what}: row of {row} bytes is not whole elements of {el}")
    return dtype, el, row // el


def parse_seq_state(blob: bytes, n_tokens: int, n_kv_heads: int) -> list[torch.Tensor]:
    """The KV cache of sequence 0 from a ``llama_state_seq_get_data`` blob: [K_0, ..., K_{L-1}, V_0, ..., V_{L-1}],
    each [T, Hkv, D] in the cache's storage type (bytes as stored; a transposed V cache is read back to rows).

    Layout read (llama.cpp's kv-cache state_write): u32 magic, i32 seq id, u32 n_stream, per stream u32 cells and,
    when non-zero, per cell (i32 pos, u32 n_seq, n_seq x i32 seq id), u32 v_trans, u32 n_layer, per layer (i32
    type, u64 row bytes, rows), per layer V (as K, or transposed: i32 type, u32 element bytes, u32 width, width
    runs of T elements). The parse must consume the blob exactly, with positions 0..T-1 and T = ``n_tokens``.

    Raises:
        ValueError: anything else (another layout or version, a cache that is not positions 0..n_tokens-1).
    """
    if n_kv_heads < 1:
        raise ValueError(f"the model's KV head count is {n_kv_heads} (not in the GGUF metadata)")
    r = _Reader(blob)
    if r.take("<I") != _SEQ_MAGIC:
        raise ValueError("unknown magic (not a llama_state_seq_get_data blob of the parsed version)")
    r.take("<i")
    if r.take("<I") != 1:
        raise ValueError("more than one KV stream")
    T = r.take("<I")
    if T != n_tokens:
        raise ValueError(f"{T} cells for a sequence of {n_tokens} tokens")
    pos = []
    for _ in range(T):
        p, n_seq = r.take("<iI")
        pos.append(p)
        [r.take("<i") for _ in range(n_seq)]
    if pos != list(range(T)):
        raise ValueError("cells are not positions 0..T-1 in order")
    v_trans, n_layer = r.take("<II")
    ks, vs = [], []
    for il in range(n_layer):
        dtype, el, width = _kv_header(r, il, "K", False)
        ks.append(r.tensor(T * width * el, dtype, (T, n_kv_heads, width // n_kv_heads)))
    for il in range(n_layer):
        dtype, el, width = _kv_header(r, il, "V", bool(v_trans))
        v = r.tensor(T * width * el, dtype, (width, T) if v_trans else (T, width))
        vs.append((v.t() if v_trans else v).contiguous().reshape(T, n_kv_heads, width // n_kv_heads))
    if r.at != len(blob):
        raise ValueError(f"{len(blob) - r.at} bytes left after the last layer")
    return ks + vs
