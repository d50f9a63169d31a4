"""Formats, ULP steps and correct rounding for bf16, fp16 and fp32 (steps in fp64 too).

The ordered-integer map and the ULP distance it gives live in ../exact.py (``ordered``, ``ulp_distance``) with the
suite's other byte primitives; this module walks that order (``from_ordered``, ``step``, ``neighbours``). NaN has
no place in the order: every function here raises ``ValueError`` on NaN.

Correct rounding (:func:`round_to`) takes fp64 values to bf16/fp16/fp32 with round-to-nearest, ties-to-even, in
integer arithmetic on the fp64 bit pattern (one rounding; converting fp64 -> fp32 -> bf16 instead rounds twice and
can land one ULP off, see tests/test_ulp.py). Overflow follows IEEE 754-2019 §4.3.1 and §7.4: magnitudes at or above
(2 - 2^-p)·2^emax round to infinity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..exact import INT_VIEW, ordered


@dataclass(frozen=True)
class Format:
    """A binary floating-point format: ``p`` significand bits (with the implicit one), exponents emin..emax (the
    signed integer of the same width: exact.INT_VIEW)."""

    name: str
    p: int
    emin: int
    emax: int


FORMATS: dict[torch.dtype, Format] = {
    torch.bfloat16: Format("bfloat16", 8, -126, 127),
    torch.float16: Format("float16", 11, -14, 15),
    torch.float32: Format("float32", 24, -126, 127),
    torch.float64: Format("float64", 53, -1022, 1023),
}
ROUNDABLE = (torch.bfloat16, torch.float16, torch.float32)
U_ACC = 2.0 ** -24  # unit roundoff of fp32 accumulation


def fmt(dtype: torch.dtype) -> Format:
    """The :class:`Format` of ``dtype``.

    Raises:
        ValueError: ``dtype`` is not bf16, fp16, fp32 or fp64.
    """
    try:
        return FORMATS[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; allowed: {', '.join(f.name for f in FORMATS.values())}") \
            from None


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p (Higham, ch. 2): bf16 2^-8, fp16 2^-11, fp32 2^-24, fp64 2^-53."""
    return 2.0 ** -fmt(dtype).p


def from_ordered(o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of exact.ordered: int64 ordered integers -> values of ``dtype`` (0 maps to +0).

    Raises:
        ValueError: unsupported dtype, or an integer outside the format's range (past the infinities).
    """
    f = fmt(dtype)
    width = torch.finfo(dtype).bits
    top = ((f.emax + 1 - f.emin + 1) << (f.p - 1))  # ordered integer of +inf: biased exponent all ones, fraction 0
    if o.numel() and int(o.abs().max()) > top:
        raise ValueError(f"ordered integer {int(o.abs().max())} beyond +-inf ({top}) of {f.name}")
    sign = -(1 << (width - 1))  # the sign bit as a negative number of the signed integer type
    bits = torch.where(o >= 0, o, (-o) | sign) if width == 64 else torch.where(o >= 0, o, (-o) + sign)
    return bits.to(INT_VIEW[dtype]).view(dtype)


def step(x: torch.Tensor, n: int | torch.Tensor) -> torch.Tensor:
    """``x`` moved ``n`` representable values up (n < 0: down) in its own dtype: plants an error of exactly n ULPs."""
    return from_ordered(ordered(x) + n, x.dtype)


def round_to(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """RN(y): fp64 ``y`` (any shape) correctly rounded to ``dtype`` (bf16/fp16/fp32), nearest, ties to even.

    Integer arithmetic on the fp64 bits: with y = m·2^E (m the 53-bit integer significand), the target quantum is
    2^q, q = max(floor(log2|y|), emin) - (p - 1); keep m >> (q - E), round up when the dropped bits exceed half,
    or equal half with an odd kept part. The result kept·2^q is representable in ``dtype``, so the final cast is
    exact. Signed zeros, infinities and NaN are kept; overflow gives infinity.

    Raises:
        ValueError: ``y`` is not float64, or ``dtype`` is not bf16/fp16/fp32.
    """
    if y.dtype != torch.float64:
        raise ValueError(f"round_to takes float64 input, got {y.dtype}")
    if dtype not in ROUNDABLE:
        raise ValueError(f"round_to targets bf16, fp16 or fp32, got {dtype}")
    f = fmt(dtype)
    bits = y.contiguous().view(torch.int64)
    mag = bits & 0x7FFF_FFFF_FFFF_FFFF
    e = mag >> 52                                                                  # biased fp64 exponent
    m = torch.where(e > 0, (mag & ((1 << 52) - 1)) | (1 << 52), mag)              # integer significand
    E = torch.where(e > 0, e - 1075, torch.full_like(e, -1074))                   # y = m * 2^E
    q = torch.clamp(e - 1023, min=f.emin) - (f.p - 1)                             # target quantum exponent
    shift = torch.clamp(q - E, min=1, max=62)                                     # >= 53 - p >= 1 always
    kept = m >> shift
    rem = m - (kept << shift)
    half = torch.ones_like(m) << (shift - 1)
    kept = kept + ((rem > half) | ((rem == half) & ((kept & 1) == 1))).to(torch.int64)
    two_q = ((q + 1023) << 52).view(torch.float64)                                # 2^q exactly (q >= -149)
    out = kept.to(torch.float64) * two_q                                          # exact: kept <= 2^p
    out = torch.where(out >= 2.0 ** (f.emax + 1), torch.full_like(out, float("inf")), out)
    out = torch.where(bits < 0, -out, out)
    out = torch.where(torch.isnan(y) | torch.isinf(y), y, out)
    return out.to(dtype)


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gap below, gap above) of each finite ``x`` in its own dtype, as fp64: x - pred(x), succ(x) - x.

    At the largest finite magnitude the gap towards infinity is taken equal to the gap on the other side (the
    distance to the overflow threshold is half of it, as for any other value).

    Raises:
        ValueError: unsupported dtype, NaN or an infinity in ``x``.
    """
    if bool(torch.isinf(x).any()):
        raise ValueError("neighbours of an infinity are not defined")
    o = ordered(x)
    top = (fmt(x.dtype).emax + 1 - fmt(x.dtype).emin + 1) << (fmt(x.dtype).p - 1)
    lo = from_ordered(torch.clamp(o - 1, min=-top + 1), x.dtype).double()
    hi = from_ordered(torch.clamp(o + 1, max=top - 1), x.dtype).double()
    xd = x.double()
    below, above = xd - lo, hi - xd
    below = torch.where(o - 1 <= -top, above, below)
    above = torch.where(o + 1 >= top, below, above)
    return below, above


def distance_to_rounding_interval(y: torch.Tensor, yhat: torch.Tensor) -> torch.Tensor:
    """Distance (fp64, >= 0) from exact values ``y`` (fp64) to the set of reals that round to ``yhat`` (stored dtype).

    That set is [yhat - below/2, yhat + above/2] (see :func:`neighbours`). The result is the smallest error that the
    value *before* its final rounding to the stored dtype can have had: 0 when yhat == RN(y). Shapes broadcast.
    """
    below, above = neighbours(yhat)
    d = yhat.double() - y
    return torch.clamp(torch.maximum(d - below / 2, -d - above / 2), min=0.0)
