"""Certification of the FP64 references (fp64/ref.py) on picked output elements, against exact arithmetic.

Sum classes (dense, router, expert_down, lm_head, moe_combine, residual): the output is a sum of products of
stored-dtype numbers (a quantized weight enters as its dequantized fp32 values, fp64/ref.py). Each product is exact
in fp64 (at most 48 significand bits), so the exact output, correctly
rounded to fp64, is ``math.fsum`` of the products (Python docs: fsum tracks exact partials); it is recomputed with
``mpmath.fsum`` at 320 bits and the two must be the same double.

Transcendental classes (expert_gate_up: SiLU; attention: exp; rmsnorm: rsqrt; rope: cos/sin): the output is
evaluated in mpmath at 320 and at 640 bits from the exact inputs (each inner sum of exact products enters as its
exact float expansion, :func:`expansion`; an fp8 KV cache's keys and values enter as their dequantized fp32 values,
fp64/ref.py kv64); the two values must agree to MP_AGREE·A = 2^-100·A, far below any output ULP; the 640-bit value
is taken as exact.

The disagreement of the fp64 reference is reported in fp64 ULPs of the normaliser: |y_ref - exact| / (2^-52·A).
The reference is certified when every picked element is below CERT_MAX_ULPS and every cross-check agreed.
"""
from __future__ import annotations

import hashlib
import math

import mpmath
import torch
from mpmath import mp, mpf

from ...kernels.registry import ClassNames
from .ref import CERT_MAX_ULPS, CERT_PRECS, MP_AGREE, Eval, kv64, rope_angles, weight_key, weight_row

# The groups come from the class records' ``fp64_cert``; the terms (sum_terms) and values (mp_value) are per class.
SUM_CLASSES = ClassNames(lambda r: r.fp64_cert == "sum")
MP_CLASSES = ClassNames(lambda r: r.fp64_cert == "mpmath")


class CertificationError(ArithmeticError):
    """Two independent exact evaluations disagree: the exact value is not established."""


def exact_sum(terms: list[float]) -> float:
    """The exact sum of ``terms`` (python floats) correctly rounded to fp64, established twice.

    Returns ``math.fsum(terms)`` after checking it equals ``mpmath.fsum`` of the same terms at 320 bits rounded to
    the nearest double. Example: ``exact_sum([1e16, 1.0, -1e16]) == 1.0`` (a naive left-to-right sum gives 0.0).

    Raises:
        CertificationError: the two disagree (a term beyond 320 bits of the largest, or a non-finite term).
    """
    a = math.fsum(terms)
    with mp.workprec(CERT_PRECS[0]):
        b = float(mpmath.fsum(terms))
    if a != b:
        raise CertificationError(f"math.fsum gives {a!r} but mpmath.fsum at {CERT_PRECS[0]} bits gives {b!r}")
    return a


def _floats(t) -> list[float]:
    return [float(v) for v in t.reshape(-1).tolist()]


def _products(x, w) -> list[float]:
    """Exact fp64 products of two stored-dtype vectors (bf16/fp16/fp32 significands multiply exactly)."""
    return [a * b for a, b in zip(_floats(x), _floats(w))]


def sum_terms(ev: Eval, i: int, params: dict) -> list[float]:
    """The exact-product terms whose sum is element ``i`` of ``ev`` (sum classes)."""
    s, j = ev.samples[int(ev.sid[i])], int(ev.j[i])
    if ev.cls in ("dense", "router", "expert_down", "lm_head"):
        return _products(s.data["x"], weight_row(params[weight_key(ev.cls, s)], j))
    if ev.cls == "moe_combine":
        terms = _products(s.data["g"], s.data["y"][:, j])
        return terms + ([float(s.data["shared"][j])] if "shared" in s.data else [])
    return [float(s.data["a"].reshape(-1)[j]), float(s.data["b"].reshape(-1)[j])]


def expansion(terms: list[float], max_parts: int = 64) -> list[float]:
    """The exact sum of ``terms`` as a short list of floats whose (exact) sum it is: s_0 = fsum(terms),
    s_k = fsum(terms - s_0 - ... - s_{k-1}) until the remainder is exactly 0 (each s_k is the correctly rounded
    remainder, so the list is exact; typically 1-3 floats).

    Raises:
        CertificationError: no exact expansion within ``max_parts`` floats (non-finite terms).
    """
    parts: list[float] = []
    for _ in range(max_parts):
        r = math.fsum(terms + [-p for p in parts])
        if r == 0.0:
            return parts or [0.0]
        parts.append(r)
    raise CertificationError(f"no exact expansion of {len(terms)} terms within {max_parts} floats")


def _mdot(x, w) -> mpf:
    """The exact dot product of two stored-dtype vectors as an mpf (exact at the working precision when the
    expansion spans fewer bits; the two-precision check catches it otherwise)."""
    return mpmath.fsum(expansion(_products(x, w)))


def _silu(g):
    return g / (1 + mpmath.exp(-g))


def mp_value(ev: Eval, i: int, params: dict, kv: dict, cache: dict) -> mpf:
    """Element ``i`` of ``ev`` evaluated in mpmath at the current precision (transcendental classes)."""
    s, j = ev.samples[int(ev.sid[i])], int(ev.j[i])
    if ev.cls == "expert_gate_up":
        g = _mdot(s.data["x"], weight_row(params[(s.layer, s.tag + ".gate")], j))
        return _silu(g) * _mdot(s.data["x"], weight_row(params[(s.layer, s.tag + ".up")], j))
    if ev.cls == "rmsnorm":
        x = s.data["x"].reshape(-1, s.data["x"].shape[-1])
        row, col = divmod(j, x.shape[1])
        ms = mpmath.fsum(expansion([v * v for v in _floats(x[row])])) / x.shape[1]
        w = float(params[(s.layer, s.tag)][col])
        return w * mpf(float(x[row, col])) / mpmath.sqrt(ms + mpf(s.meta["eps"]))
    if ev.cls == "rope":
        x = s.data["x"]
        h, col = divmod(j, x.shape[-1])
        half = x.shape[-1] // 2
        inv = float(rope_angles(x.shape[-1], s.meta["theta"], torch.tensor([1]))[0, col])  # fp32 inv_freq
        a = mpf(s.pos) * mpf(inv)
        rot = -float(x[h, col + half]) if col < half else float(x[h, col - half])
        return mpf(float(x[h, col])) * mpmath.cos(a) + mpf(rot) * mpmath.sin(a)
    return _mp_attention(s, j, kv, cache)


def _mp_attention(s, j, kv, cache) -> mpf:
    q = s.data["q"]
    Hq, D = q.shape
    h, d = divmod(j, D)
    rows = (id(s), "kv")
    if rows not in cache:   # the cache's values (fp8: dequantized), once per sample
        cache[rows] = tuple(kv64(t[:s.pos + 1]) for t in kv[s.layer])
    kc, vc = cache[rows]
    g = Hq // kc.shape[1]
    key = (id(s), h, mp.prec)
    if key not in cache:
        scale = 1 / mpmath.sqrt(D)
        sc = [_mdot(q[h], kc[t, h // g]) * scale for t in range(s.pos + 1)]
        m = max(sc)
        cache[key] = [mpmath.exp(v - m) for v in sc]
    e = cache[key]
    vals = _floats(vc[:s.pos + 1, h // g, d])
    return mpmath.fsum([a * b for a, b in zip(e, vals)]) / mpmath.fsum(e)


def certify(ev: Eval, picks, params: dict, kv: dict, memo: dict | None = None) -> dict:
    """Certify ``ev.y`` on the element indices ``picks``.

    Args:
        params, kv: as for fp64_ref.evaluate; memo: optional dict shared between calls: exact values are kept per
            (input digest, element) so paths that fed a kernel identical bytes are certified once.
    Returns:
        {"ulps": worst |y_ref - exact| / (2^-52·A) (float), "certified": bool, "n": picks checked,
         "method": str, "failures": [str] (cross-check disagreements and elements over CERT_MAX_ULPS, at most 5)}.
    Raises:
        ValueError: a class with no certification method.
    """
    known = [*SUM_CLASSES, *MP_CLASSES]
    if ev.cls not in known:
        raise ValueError(f"no certification for class {ev.cls!r}; known: {', '.join(known)}")
    memo = {} if memo is None else memo
    worst, failures, cache, digests = 0.0, [], {}, {}
    for i in picks:
        i, sid = int(i), int(ev.sid[int(i)])
        A, yref = float(ev.A[i]), float(ev.y[i])
        if sid not in digests:
            digests[sid] = input_digest(ev, sid, kv)
        key = (digests[sid], int(ev.j[i]))
        if key not in memo:
            try:
                memo[key] = _exact(ev, i, params, kv, cache, A)
            except CertificationError as e:
                memo[key] = e
        exact = memo[key]
        if isinstance(exact, CertificationError):
            failures.append(f"element {i}: {exact}")
            continue
        unit = 2.0 ** -52 * A
        err = abs(mpf(yref) - exact)
        ulps = float(err / unit) if unit > 0 else (0.0 if err == 0 else math.inf)
        worst = max(worst, ulps)
        if ulps > CERT_MAX_ULPS:
            failures.append(f"element {i}: reference {yref!r} vs exact {float(exact)!r} ({ulps:.3g} fp64 ulps)")
    method = ("math.fsum == mpmath.fsum@320 over exact fp64 products" if ev.cls in SUM_CLASSES
              else "mpmath @320 vs @640 bits (exact inner sums)")
    return {"ulps": worst, "certified": not failures and len(picks) > 0, "n": len(picks), "method": method,
            "failures": failures[:5]}


def _exact(ev, i, params, kv, cache, A) -> mpf:
    if ev.cls in SUM_CLASSES:
        return mpf(exact_sum(sum_terms(ev, i, params)))
    vals = []
    for prec in CERT_PRECS:
        with mp.workprec(prec):
            vals.append(+mp_value(ev, i, params, kv, cache))
    with mp.workprec(CERT_PRECS[-1]):
        if abs(vals[0] - vals[1]) > MP_AGREE * A:
            raise CertificationError(f"mpmath at {CERT_PRECS[0]} and {CERT_PRECS[1]} bits disagree: "
                                     f"{mpmath.nstr(vals[0], 20)} vs {mpmath.nstr(vals[1], 20)}")
    return vals[1]


def input_digest(ev: Eval, sid: int, kv: dict) -> str:
    """Hash of the inputs of sample ``sid`` (and, for attention, of the keys/values it reads): equal inputs give
    equal exact outputs, so certifications are shared between paths that fed a kernel the same bytes."""
    s = ev.samples[sid]
    h = hashlib.blake2b(digest_size=12)
    h.update(repr((ev.cls, s.layer, s.tag, s.pos, sorted(s.meta.items()))).encode())
    parts = [v for k, v in sorted(s.data.items()) if k not in ("y", "o", "out", "idx", "g") or
             (ev.cls == "moe_combine" and k in ("y", "g"))]
    if ev.cls == "attention":
        parts += [kv[s.layer][0][:s.pos + 1], kv[s.layer][1][:s.pos + 1]]
    for t in parts:
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
