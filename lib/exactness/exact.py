"""What "equal bytes" means in this suite, in one place: every comparison of outputs, logits, caches and tokens uses
these primitives, so that one definition decides what a receipt calls equal.

    as_int               a float tensor viewed as the signed integer of its width
    bytes_equal          same shape, dtype and bytes
    differing_rows       which rows of two [n, ...] tensors differ in bytes
    first_differing_row  the first such row; of 1-D tensors (token ids, a flattened row) the first element
    kv_first_difference  the first position where two KV caches' keys or values differ
    token_hash           12 hex digits of SHA-256 over token ids as little-endian int32
    ordered              the ordered-integer map of float bits; ulp_distance: the ULP distance it gives
    compare              one run against a reference -> Verdict: per part (tokens, prompt rows, prompt logprobs,
                         generated rows, KV) equal, different or not exposed, and the first difference of each
    margin               top-1 minus top-2 of one logit row (the reference's, where the tokens first differ)

Floats are compared as their bits, never as values: value equality calls +0 and -0 equal and a NaN unequal to
itself, while a receipt's claim is about bytes. Comparing integer views instead of raw uint8 keeps one element per
value, so a differing element or row can be located. Nothing here imports the rest of the package: compare reads
runs by their field names (run.Run's: gen_ids, prompt_logits, prompt_start, gen_logits, kv, prompt_logprobs,
prompt_logprob_ids), so any record with those fields compares.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

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
    ``lengths`` per slot) differ in bytes in any layer's keys or values, over the written positions (compare's KV
    part).

    Returns:
        None when equal; -1 when the two slots hold different numbers of positions (nothing to compare position by
        position).
    """
    slot0 = [[t[0, :c.lengths[0]] for t in (*c.k, *c.v)] for c in (a, b)]
    first = _kv(*slot0).first
    return None if first is None else first["position"]


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


# ------------------------------------------------------------------------------- one run against a reference

@dataclass(frozen=True)
class Part:
    """One compared part of two runs.

    Attributes:
        equal: True / False, or None where either run does not expose the part (never counted as equal).
        first: the first difference, None when equal or not exposed: tokens and rows an index (prompt rows: the
            prompt position), KV {"position", "layer", "part": "k"/"v", "tensor": index in the kv list} (position
            -1, layer and part None where the caches hold different numbers of positions).
        count: rows (tokens: 0 or 1; KV: tensors) that differ; 0 when equal or not exposed.
    """

    equal: bool | None
    first: int | dict | None = None
    count: int = 0


NOT_EXPOSED = Part(None)


@dataclass(frozen=True)
class Verdict:
    """``compare``'s answer: one Part per part of the run, and the reference's top-1 minus top-2 logit at the
    first differing token (None where the tokens agree or the reference has no logit row there).
    ``prompt_logprobs`` is None where neither run carries prompt logprobs (only servers give them)."""

    tokens: Part
    prompt_rows: Part
    gen_rows: Part
    kv: Part
    prompt_logprobs: Part | None = None
    oracle_margin: float | None = None

    def parts(self) -> dict[str, Part]:
        """Part name (as receipts write it) -> Part, in report order."""
        lp = {} if self.prompt_logprobs is None else {"prompt logprobs": self.prompt_logprobs}
        return {"tokens": self.tokens, "prompt logits": self.prompt_rows, **lp, "generated logits": self.gen_rows,
                "KV": self.kv}

    @property
    def failed(self) -> list[str]:
        """Names of the parts that differ, in report order."""
        return [k for k, p in self.parts().items() if p.equal is False]

    @property
    def not_exposed(self) -> list[str]:
        """Names of the parts either run does not expose."""
        return [k for k, p in self.parts().items() if p.equal is None]

    @property
    def equal(self) -> bool:
        """The tokens and every exposed part are equal."""
        return self.tokens.equal is True and not self.failed

    def line(self) -> str:
        """"differs: <parts>", or "equal" with "(not exposed: <parts>)" where some were not exposed."""
        if self.failed:
            return "differs: " + ", ".join(self.failed)
        missing = self.not_exposed
        return "equal" + (f" (not exposed: {', '.join(missing)})" if missing else "")


def margin(row: torch.Tensor) -> float:
    """Top-1 minus top-2 logit of one row [V] (any float dtype, compared in fp32)."""
    top = torch.topk(row.float(), 2).values
    return float(top[0] - top[1])


def _differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bool [max(n, m)]: rows of ``a`` [n, ...] and ``b`` [m, ...] that differ in bytes; rows only one has differ,
    and every row differs where the rows' shapes or dtypes do."""
    n, m = max(a.shape[0], b.shape[0]), min(a.shape[0], b.shape[0])
    out = torch.ones(n, dtype=torch.bool, device=a.device)
    if a.shape[1:] == b.shape[1:] and a.dtype == b.dtype:
        out[:m] = differing_rows(a[:m], b[:m])
    return out


def _part(d: torch.Tensor, offset: int = 0) -> Part:
    """The Part of a differing-rows mask ``d``; ``offset`` is added to the first index."""
    if not bool(d.any()):
        return Part(True)
    return Part(False, offset + int(d.nonzero()[0]), int(d.sum()))


def _rows(a, b, start_a: int = 0, start_b: int = 0) -> Part:
    """Logit rows [R, V] of two runs, aligned on the prompt position their first row holds (``start_*``): only
    the positions both computed are compared (a resumed run's rows against a fresh run's same rows)."""
    if a is None or b is None:
        return NOT_EXPOSED
    s = max(start_a, start_b)
    return _part(_differing(a[s - start_a:], b[s - start_b:]), s)


def _logprobs(run, ref) -> Part | None:
    """Prompt logprob rows [R, 1+N] and their ids together: a row differs where either does."""
    a, b = getattr(run, "prompt_logprobs", None), getattr(ref, "prompt_logprobs", None)
    if a is None and b is None:
        return None
    if a is None or b is None:
        return NOT_EXPOSED
    d = _differing(a, b)
    ia, ib = getattr(run, "prompt_logprob_ids", None), getattr(ref, "prompt_logprob_ids", None)
    if ia is not None and ib is not None:
        di = _differing(ia, ib)
        n = max(d.numel(), di.numel())
        d = torch.cat([d, d.new_zeros(n - d.numel())]) | torch.cat([di, di.new_zeros(n - di.numel())])
    return _part(d)


def _kv(a: list | None, b: list | None) -> Part:
    """Two kv lists (2L position-major tensors [T, ...]: keys of layers 0..L-1, then values): the first site by
    position, then layer, keys before values."""
    if a is None or b is None:
        return NOT_EXPOSED
    same = [x.shape == y.shape and bytes_equal(x, y) for x, y in zip(a, b)] if len(a) == len(b) else [False]
    if all(same):
        return Part(True)
    site = {"position": -1, "layer": None, "part": None, "tensor": same.index(False)}
    count = sum(not s for s in same) if len(a) == len(b) else max(len(a), len(b))
    if len(a) != len(b) or any(x.shape[0] != y.shape[0] for x, y in zip(a, b)):
        return Part(False, site, count)
    paired = len(a) % 2 == 0          # keys then values; any other list names no layer or part
    L = len(a) // 2 if paired else len(a)
    pos, layer, kv = min((0 if x.shape != y.shape or x.dtype != y.dtype else first_differing_row(x, y), i % L,
                          i // L) for i, (x, y, s) in enumerate(zip(a, b, same)) if not s)
    where = {"layer": layer, "part": "kv"[kv]} if paired else {}
    return Part(False, {**site, "position": pos, **where}, count)


def compare(run, ref) -> Verdict:
    """``run`` against its reference ``ref``: tokens (gen_ids [G] int64), prompt rows (prompt_logits [R, V] from
    prompt position prompt_start), prompt logprobs and their ids (a server's, [R, 1+N]), generated rows
    (gen_logits [G, V]) and KV (kv: 2L position-major tensors), each compared in bytes; a part either run lacks
    (None or no such field) is not exposed. The margin is the reference's gen_logits row at the first differing
    token.

    Raises:
        ValueError: token ids of different dtypes, or a dtype as_int refuses.
    """
    div = first_differing_row(run.gen_ids, ref.gen_ids)
    tokens = Part(True) if div is None else Part(False, div, 1)
    logits = getattr(ref, "gen_logits", None)
    near = margin(logits[div]) if div is not None and logits is not None and div < logits.shape[0] else None
    prompt = _rows(getattr(run, "prompt_logits", None), getattr(ref, "prompt_logits", None),
                   getattr(run, "prompt_start", 0) or 0, getattr(ref, "prompt_start", 0) or 0)
    return Verdict(tokens, prompt, _rows(getattr(run, "gen_logits", None), logits),
                   _kv(getattr(run, "kv", None), getattr(ref, "kv", None)), _logprobs(run, ref), near)
