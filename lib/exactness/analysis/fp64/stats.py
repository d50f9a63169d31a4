"""Per-row error statistics of an FP64 evaluation (fp64_ref.Eval) and the receipt row built from them; the
quantities are defined in section.py's module docstring."""
from __future__ import annotations

import math

import torch

from ...exact import as_int, ulp_distance
from ..ulp import U_ACC, distance_to_rounding_interval, round_to, unit_roundoff
from .ref import gamma

HIST_EDGES = (0, 1, 2, 3, 4, 8, 16, 64)  # ULP histogram bins [e_i, e_{i+1}), the last open


def _finite_max(t: torch.Tensor) -> float | None:
    t = t[torch.isfinite(t)]
    return float(t.max()) if t.numel() else None


def error_stats(ev) -> dict:
    """eta, pre-rounding and ULP statistics of an fp64_ref.Eval (see the module docstring)."""
    y, yh, A = ev.y, ev.yhat.double(), ev.A
    err = yh - y
    safe = torch.where(A > 0, A, torch.ones_like(A))
    eta = torch.where(A > 0, err.abs() / safe, torch.where(err == 0, 0.0, math.inf))
    pre = distance_to_rounding_interval(y, ev.yhat)
    eta_pre = torch.where(A > 0, pre / safe, torch.where(pre == 0, 0.0, math.inf))
    use = torch.where(ev.beta > 0, pre / torch.where(ev.beta > 0, ev.beta, 1.0), torch.where(pre == 0, 0.0, math.inf))
    nz = y.abs() > 0
    kappa = A[nz] / y.abs()[nz]
    ulps = ulp_distance(ev.yhat, round_to(y, ev.dtype))
    n = ulps.numel()
    return {"n": n, "eta": eta, "eta_pre": eta_pre, "pre": pre, "use": use, "ulps": ulps,
            "eta_max_u": float(eta.max()) / U_ACC, "eta_p99_u": float(torch.quantile(eta[:2 ** 24], 0.99)) / U_ACC,
            "eta_over_gamma": float((eta_pre / gamma(ev.K)).max()), "bound_use": float(use.max()),
            "eta_over_sqrtk_u": float((eta_pre / (ev.K.double().sqrt() * U_ACC)).max()),
            "bias_u": float((err[A > 0] / A[A > 0]).mean()) / U_ACC if bool((A > 0).any()) else 0.0,
            "kappa_median": float(kappa.median()) if kappa.numel() else None, "kappa_max": _finite_max(kappa),
            "ulp0_pct": 100.0 * float((ulps == 0).sum()) / n, "ulp1_pct": 100.0 * float((ulps == 1).sum()) / n,
            "ulp_max": int(ulps.max()), "rmse": float(err.pow(2).mean().sqrt())}


def distinct(x: torch.Tensor) -> torch.Tensor:
    """The distinct values of an int64 tensor, ascending (torch.unique's result), by counting: one pass over x
    instead of a sort, for the narrow ranges of K and layer indices."""
    if not x.numel():
        return x.new_zeros(0)
    lo = int(x.min())
    return torch.bincount((x - lo).flatten()).nonzero().flatten() + lo


def _by_sample(ev) -> dict:
    """sample key -> element indices of ``ev`` (in element order j), as a stable sort of ``ev.sid`` gives them.
    Where every sample's elements are one run (fp64/ref.py adds a sample's row at once) the runs are those slices."""
    sid, n = ev.sid, len(ev.samples)
    counts = torch.bincount(sid, minlength=n)
    cuts = (torch.nonzero(sid[1:] != sid[:-1]).flatten() + 1).tolist()
    if len(cuts) + 1 == int((counts > 0).sum()):        # one run per sample: the sort is the identity per run
        first = dict(zip(sid[[0, *cuts]].tolist(), [0, *cuts]))
        return {s.key: torch.arange(first.get(i, 0), first.get(i, 0) + int(counts[i])) for i, s in
                enumerate(ev.samples)}
    order, starts = torch.argsort(sid, stable=True), torch.cumsum(counts, 0) - counts
    return {s.key: order[int(starts[i]):int(starts[i] + counts[i])] for i, s in enumerate(ev.samples)}


def vs_decode(ev, dec) -> dict:
    """Byte equality and ULP distance between ``ev`` and the decode path's ``dec`` on the rows both sampled."""
    if dec is None:
        return {"bitwise_equal_share": None, "max_ulp_vs_decode": None, "matched": 0, "flips_vs_decode": None}
    a, b = _by_sample(ev), _by_sample(dec)
    keys = [k for k in a if k in b and a[k].numel() == b[k].numel()]
    if not keys:
        return {"bitwise_equal_share": None, "max_ulp_vs_decode": None, "matched": 0, "flips_vs_decode": None}
    ia, ib = torch.cat([a[k] for k in keys]), torch.cat([b[k] for k in keys])
    ya, yb = ev.yhat[ia], dec.yhat[ib]
    eq = as_int(ya) == as_int(yb)
    flips = None
    if ev.decisions:
        da = {s.key: d for s, d in zip(ev.samples, ev.decisions)}
        db = {s.key: d for s, d in zip(dec.samples, dec.decisions)}
        flips = sum(1 for k in da if k in db and da[k][0] != db[k][0])
    return {"bitwise_equal_share": float(eq.double().mean()), "max_ulp_vs_decode": int(ulp_distance(ya, yb).max()),
            "matched": len(keys), "all_matched": len(keys) == len(a), "flips_vs_decode": flips}


def flip_stats(ev) -> dict:
    """Router/lm_head choices that differ from the fp64 reference's on the same inputs, with margins."""
    if not ev.decisions:
        return {"flips": None, "min_flip_margin": None, "min_margin": None}
    flipped = [d[2] for d in ev.decisions if d[0] != d[1]]
    return {"flips": len(flipped), "min_flip_margin": min(flipped) if flipped else None,
            "min_margin": min(d[2] for d in ev.decisions)}


def pick_elements(ev, n: int, seed: int = 0, eta: torch.Tensor | None = None) -> list[int]:
    """Elements to certify: the n//2 with the largest eta, then n - n//2 drawn at random from the rest."""
    total = ev.y.numel()
    if total <= n:
        return list(range(total))
    worst = torch.topk(eta, n // 2).indices.tolist() if eta is not None else []
    g = torch.Generator().manual_seed(seed)
    rest = [i for i in torch.randperm(total, generator=g).tolist()[:n + len(worst)] if i not in set(worst)]
    return worst + rest[:n - len(worst)]


def make_row(ev, dec, cert: dict, meta: dict, st: dict | None = None) -> tuple[dict, dict]:
    """One receipt row (and its error statistics, for histograms) from an Eval, the decode Eval and a cert;
    ``st``: error_stats(ev) when already computed."""
    st = st or error_stats(ev)
    row = {**meta, "K": int(ev.K.max()), "u_store": unit_roundoff(ev.dtype), "u_acc": U_ACC,
           "ref_method": cert["method"], "ref_certified": cert["certified"], "ref_cert_ulps": cert["ulps"],
           **{k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}, **flip_stats(ev)}
    if ev.cls == "attention":  # diagnostic: the bound if the unnormalised softmax weights were stored (u_s each)
        b2 = ev.beta + 2 * unit_roundoff(ev.dtype) * ev.A
        row["bound_use_p_stored"] = float(torch.where(b2 > 0, st["pre"] / torch.where(b2 > 0, b2, 1.0), 0.0).max())
    vd = vs_decode(ev, dec) if meta["path"] != "decode" else vs_decode(None, None)
    row.update({k: vd[k] for k in ("bitwise_equal_share", "max_ulp_vs_decode", "flips_vs_decode")})
    if not cert["certified"]:
        row["verdict"], row["cert_failures"] = "uncertified", cert["failures"]
    elif meta["path"] != "decode" and vd.get("all_matched") and vd["bitwise_equal_share"] == 1.0:
        row["verdict"] = "exact"
    else:
        row["verdict"] = "within bound" if st["bound_use"] <= 1.0 else "outside bound"
    return row, st


def ulp_hist(ulps: torch.Tensor) -> list[int]:
    """Counts of ULP distances in the bins HIST_EDGES (last bin open)."""
    edges = torch.tensor(HIST_EDGES[1:])
    return torch.bincount(torch.bucketize(ulps, edges, right=True), minlength=len(HIST_EDGES)).tolist()
