"""What "equal bytes" means in this suite, in one place: every comparison of outputs, logits, caches and tokens uses
these primitives, so that one definition decides what a receipt calls equal.

    as_int               a float tensor viewed as the signed integer of its width
    bytes_equal          same shape, dtype and bytes
    differing_rows       which rows of two [n, ...] tensors differ in bytes
    first_differing_row  the first such row; of 1-D tensors (token ids, a flattened row) the first element
    kv_first_difference  the first position where two KV caches' keys or values differ
    token_hash           12 hex digits of SHA-256 over token ids as little-endian int32
    ordered              the ordered-integer map of float bits; ulp_distance: the ULP distance it gives

Floats are compared as their bits, never as values: value equality calls +0 and -0 equal and a NaN unequal to
itself, while a receipt's claim is about bytes. Comparing integer views instead of raw uint8 keeps one element per
value, so a differing element or row can be located. Nothing here imports the analyses (they import this).
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

# float dtype -> the signed integer of the same width (the ordered-integer map needs the sign in the top bit)
INT_VIEW: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
                                            torch.float32: torch.int32, torch.float64: torch.int64}


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def as_int(t: torch.Tensor) -> torch.Tensor:
    """``t`` (any shape) as integers that compare equal exactly when the elements' bytes are equal.

    bf16/fp16 -> int16, fp32 -> int32, fp64 -> int64 (a view: same storage, same shape, no copy); integer and bool
    tensors are returned as they are.

    Raises:
        ValueError: any other dtype (float8, complex, ...), named with the allowed ones.
    """
    if t.dtype in INT_VIEW:
        return t.view(INT_VIEW[t.dtype])
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        return t
    raise ValueError(f"as_int: unsupported dtype {t.dtype}; allowed: {_names(INT_VIEW)}, integer and bool dtypes")


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` (any shape, any dtype, one device) have the same shape, the same dtype and the
    same bytes; a shape or dtype mismatch is False, not an error."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    # raw bytes, so that any dtype compares (as_int refuses some); contiguous + reshape(-1) lets strided views and
    # 0-dim tensors be viewed as bytes too
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def _check_rows(a: torch.Tensor, b: torch.Tensor, same_length: bool) -> None:
    if a.dim() == 0 or b.dim() == 0:
        raise ValueError(f"row comparison needs tensors of at least one dimension, got shapes "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"row comparison needs one dtype, got {a.dtype} and {b.dtype}")
    if a.shape[1:] != b.shape[1:] or (same_length and a.shape[0] != b.shape[0]):
        raise ValueError(f"row comparison needs rows of one shape, got shapes {tuple(a.shape)} and {tuple(b.shape)}")


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bool [n]: whether row i of ``a`` [n, ...] differs in bytes from row i of ``b`` [n, ...] (of 1-D tensors,
    element i).

    Raises:
        ValueError: 0-dim tensors, different shapes or dtypes (rows of another shape or dtype have no byte-wise
            counterpart), or a dtype as_int refuses.
    """
    _check_rows(a, b, same_length=True)
    ne = as_int(a) != as_int(b)
    return ne if ne.dim() == 1 else ne.flatten(1).any(dim=1)


def first_differing_row(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First row index where ``a`` [n, ...] and ``b`` [m, ...] differ in bytes: None when they are equal,
    min(n, m) when the common rows are equal and only the lengths differ. Token sequences [n] are the 1-D case
    (the first differing token).

    Raises:
        ValueError: 0-dim tensors, rows of different shapes, different dtypes, or a dtype as_int refuses.
    """
    _check_rows(a, b, same_length=False)
    n = min(a.shape[0], b.shape[0])
    diff = differing_rows(a[:n], b[:n]).nonzero()
    if diff.numel():
        return int(diff[0])
    return None if a.shape[0] == b.shape[0] else n


def kv_first_difference(a, b) -> int | None:
    """First position where slot 0 of two KV caches (cache.KVCache: ``k``, ``v`` lists of [S, T, Hkv, D] per layer,
    ``lengths`` per slot) differ in bytes in any layer's keys or values, over the written positions.

    Returns:
        None when equal; -1 when the two slots hold different numbers of positions (nothing to compare position by
        position).
    Raises:
        ValueError: as first_differing_row (caches of different dtypes or head shapes).
    """
    if a.lengths[0] != b.lengths[0]:
        return -1
    n = a.lengths[0]
    firsts = [first_differing_row(x[0, :n], y[0, :n]) for x, y in zip(a.k + a.v, b.k + b.v)]
    return min((f for f in firsts if f is not None), default=None)


def kv_first_site(a, b) -> dict | None:
    """Where slot 0 of two KV caches (as kv_first_difference) first differ: {"position", "layer", "part"} with part
    "k" or "v", the smallest position first, then the lowest layer, keys before values; None when equal; position -1
    when the slots hold different numbers of positions.

    Raises:
        ValueError: as first_differing_row.
    """
    if a.lengths[0] != b.lengths[0]:
        return {"position": -1, "layer": None, "part": None}
    n, best = a.lengths[0], None
    for part, xs, ys in (("k", a.k, b.k), ("v", a.v, b.v)):
        for layer, (x, y) in enumerate(zip(xs, ys)):
            pos = first_differing_row(x[0, :n], y[0, :n])
            if pos is not None and (best is None or (pos, layer) < (best["position"], best["layer"])):
                best = {"position": pos, "layer": layer, "part": part}
    return best


def token_hash(ids) -> str:
    """First 12 hex digits of SHA-256 over the token ids (a tensor or sequence of ints, any device, flattened) as
    little-endian int32."""
    arr = np.asarray(torch.as_tensor(ids).cpu().numpy(), dtype="<i4")
    return hashlib.sha256(arr.tobytes()).hexdigest()[:12]


def ordered(x: torch.Tensor) -> torch.Tensor:
    """Ordered integers of ``x`` (any shape; bf16, fp16, fp32 or fp64) as int64 of the same shape.

    The bits as a signed integer ``i`` of the same width, mapped to ``i if i >= 0 else -(i & 0x7F..F)``. The map is
    monotone in the value, sends +0 and -0 to 0, and consecutive representable values (subnormals and the
    infinities included) to consecutive integers. NaN has no place in that order.

    Raises:
        ValueError: an unsupported dtype, or a NaN in ``x``.
    """
    if x.dtype not in INT_VIEW:
        raise ValueError(f"unsupported dtype {x.dtype}; allowed: {_names(INT_VIEW)}")
    if bool(torch.isnan(x).any()):
        raise ValueError(f"NaN at flat index {int(torch.isnan(x).flatten().nonzero()[0])}: NaN has no ULP order")
    bits = as_int(x).to(torch.int64)
    mask = (1 << (8 * x.element_size() - 1)) - 1
    return torch.where(bits >= 0, bits, -(bits & mask))


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of representable values stepped over from ``a`` to ``b``: |ordered(a) - ordered(b)|, int64.

    ``a`` and ``b`` share one dtype (bf16/fp16/fp32/fp64) and broadcast. +0 and -0 are 0 apart; the largest finite
    value is 1 from infinity. (For bf16 this equals the fp32 distance of the widened values >> 16.)

    Raises:
        ValueError: different dtypes, an unsupported dtype, or a NaN.
    """
    if a.dtype != b.dtype:
        raise ValueError(f"ulp_distance needs one dtype, got {a.dtype} and {b.dtype}")
    return (ordered(a) - ordered(b)).abs()
