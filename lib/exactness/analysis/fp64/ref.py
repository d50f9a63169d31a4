"""FP64 references per kernel class, their error bounds, and their certification against exact arithmetic.

For each class, :func:`evaluate` turns tapped samples (taps.Sample: the exact stored-dtype inputs and outputs of a
kernel call) into an :class:`Eval`: per output element the fp64 reference y (exact math on the captured inputs,
computed with torch in float64), the kernel's stored value yhat, a normaliser A and a bound beta (absolute) on the
error of the kernel's value *before its final rounding to the stored dtype*. u_a = 2^-24 (fp32 accumulation),
u_s = unit roundoff of the stored dtype, gamma_n = n·u_a/(1 - n·u_a) (Higham, Accuracy and Stability of Numerical
Algorithms, 2nd ed., §3.1 and eq. (3.5): |fl(x^T w) - x^T w| <= gamma_K·sum|x_k·w_k| in any order).

    class            y (exact)                      A (normaliser)              K        beta
    dense, expert_down, lm_head, router (logits)
                     x·w                            sum|x_k·w_k|                in-dim   gamma_K·A
    expert_gate_up   silu(x·wg)·(x·wu)              |silu'(g)||u|A_g+|silu(g)|A_u  H     propagated (see _gate_up)
    moe_combine      sum_j g_j·y_j + shared         sum_j|g_j·y_j| + |shared|    k+1     gamma_{k+1}·A + u_s·|routed|
    attention        sum_j p_j·v_jd, p=softmax(s)   A_d = sum_j p_j·|v_jd|       T keys  A_d·(expm1(E)(1+r)+r)
    rmsnorm          w_i·x_i/sqrt(mean(x^2)+eps)    |y|                         H        |y|·((1+th)(1+u_a)(1+u_s)-1)
    rope             x·cos(a) + rot(x)·sin(a)       |x·cos| + |rot(x)·sin|      2        storage of cos/sin and products
    residual         a + b                          |a| + |b|                   2        u_a·A
The composite bounds charge every rounding the class's documented semantics perform (kernels/*.py docstrings:
bf16 intermediates of SwiGLU, RMSNorm and RoPE, the fast combine's bf16 routed sum) plus C_EXP·u_a per fp32 exp,
C_RSQRT·u_a per rsqrt and C_TRIG·u_a (absolute) per fp32 cos/sin; they are first-order bounds with the second-order
terms kept where they are cheap to keep. RoPE's angle is pos·inv_freq with the model's fp32 inv_freq (a model
constant, like a weight); the kernel's fp32 rounding of the angle is charged as u_a·|angle|.

Quantized weights (kernels/quant.py: a QuantWeight where a tensor was). The weight's values are its
``dequantize()`` fp32 values (for nvfp4 these include the format's one fp32 rounding of e2m1·scale·gscale: it is
part of the format's definition, not an error of the kernel), converted to fp64 exactly (:func:`weight64`,
:func:`weight_row`); the references and A use them. The GEMM bound stays gamma_K·A, and this is where it is
needed in full: Higham's inner-product bound (§3.1, (3.2)-(3.5)) gives every term one rounding of its product
x_k·w_k plus the additions on its path (K - 1 in a recursive sum, ceil(log2 K) in quant.linear_rows' pairwise
tree), gamma_K covering both. With bf16 (or int4_g128: a 4-bit integer times a bf16 scale, <= 11 significant bits)
weights and bf16 activations a product has <= 19 significant bits and is exact in fp32, so the product's share of
gamma_K is unused; nvfp4's dequantized weights carry 24 significant bits, so each product x_k·w_k is rounded once
in fp32 (relative error <= u_a), which is exactly the share gamma_K reserves for it. A kernel that rounds the
dequantized weights to the storage dtype before its GEMM (the fast set's recipe above quant.FAST_GEMM_ROWS rows)
adds a relative error up to u_s per weight, which this bound does not charge: such rows are judged against the
format's weights and show that extra error.

KV cache formats (cache.py: an fp8 cache is uint8 [..., D + 4], codes then an fp32 scale per row). The keys and
values are the cache's ``dequantize()`` fp32 values, fp8 code times scale, converted to fp64 exactly (:func:`kv64`).
The format's one fp32 rounding of that product is part of its definition (as for nvfp4 weights) and is what every
kernel gets from cache.kv_rows; so the reference starts from the rows as stored, and the error measured is the
kernel's, not the quantization's. A kernel that rounds the dequantized rows further (to the storage dtype) is
judged against the cache's values and shows that rounding.

Certification (:func:`certify`): on picked output elements, the exact value is recomputed independently: sums of
exact fp64 products with ``math.fsum`` and with ``mpmath.fsum`` at 320 bits (they must agree); classes with exp,
rsqrt, SiLU, cos or sin in mpmath at 320 and 640 bits, which must agree to 2^-100·A. ``ref_cert_ulps`` is the worst
|y_ref - exact| in fp64 ULPs of the normaliser, i.e. divided by 2^-52·A; above CERT_MAX_ULPS = 2^10 (still 2^-18
of the fp32 accumulation's unit, so the reference judges errors it is far smaller than) the reference fails.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from ...cache import kv_rows
from ...kernels.quant import QuantWeight
from ...kernels.registry import ClassNames, class_record, resolve
from ..taps import Sample
from ..ulp import U_ACC, unit_roundoff

FP64_CLASSES = ClassNames(lambda r: r.fp64 is not None)
CERT_MAX_ULPS = 2.0 ** 10
CERT_PRECS = (320, 640)
MP_AGREE = 2.0 ** -100
C_EXP, C_RSQRT, C_TRIG, C_SILU = 4, 3, 2, 8
SILU_LIP, SILU_CURV = 1.0999, 0.5     # max |silu'| and max |silu''| over the reals
F64 = torch.float64


def gamma(n, u: float = U_ACC):
    """gamma_n = n·u / (1 - n·u) (Higham §3.1); ``n`` an int or an int tensor. Raises ValueError if n·u >= 1."""
    nu = n * u
    if (torch.as_tensor(nu) >= 1).any():
        raise ValueError(f"gamma_n undefined for n·u >= 1 (n={n}, u={u})")
    return nu / (1 - nu)


@dataclass
class Eval:
    """References and kernel values of one class on a list of samples, one entry per output element.

    Attributes:
        cls, samples: the class and its samples; dtype: stored dtype of yhat.
        y [n] fp64 reference; yhat [n] stored dtype; A [n] fp64 normaliser; beta [n] fp64 bound before the final
        rounding; K [n] int64 reduction length; sid [n] sample index; j [n] element index in the sample's output.
        decisions: router/lm_head only, per sample (kernel choice, reference choice, reference margin).
    """

    cls: str
    samples: list
    y: torch.Tensor
    yhat: torch.Tensor
    A: torch.Tensor
    beta: torch.Tensor
    K: torch.Tensor
    sid: torch.Tensor
    j: torch.Tensor
    decisions: list = field(default_factory=list)

    @property
    def dtype(self) -> torch.dtype:
        return self.yhat.dtype


class _Parts:
    """Accumulates per-group [r, N] blocks into flat per-element tensors."""

    def __init__(self):
        self.cols = {k: [] for k in ("y", "yhat", "A", "beta", "K", "sid", "j")}

    def add(self, sids, y, yhat, A, beta, K):
        r, n = y.shape
        self.cols["y"].append(y.cpu().reshape(-1))
        self.cols["yhat"].append(yhat.reshape(-1))
        self.cols["A"].append(A.cpu().reshape(-1))
        self.cols["beta"].append(beta.cpu().reshape(-1))
        self.cols["K"].append(torch.as_tensor(K).expand(r, n).reshape(-1).to(torch.int64).cpu())
        self.cols["sid"].append(torch.as_tensor(sids).repeat_interleave(n))
        self.cols["j"].append(torch.arange(n).repeat(r))

    def build(self, cls, samples, decisions=()) -> Eval:
        if not self.cols["y"]:
            raise ValueError(f"no samples of class {cls!r} to evaluate")
        c = {k: torch.cat(v) for k, v in self.cols.items()}
        return Eval(cls, samples, c["y"], c["yhat"], c["A"], c["beta"], c["K"], c["sid"], c["j"], list(decisions))


def _groups(samples: list[Sample], by=lambda s: (s.layer, s.tag)):
    out: dict = {}
    for i, s in enumerate(samples):
        out.setdefault(by(s), []).append(i)
    return out.items()


def _stack(samples, sids, name, dev=None) -> torch.Tensor:
    t = torch.stack([samples[i].data[name] for i in sids])
    return t if dev is None else t.to(dev)


def weight64(w) -> torch.Tensor:
    """The fp64 values of a weight [..., N, K]: a tensor converted, a QuantWeight's fp32 dequantized values
    converted (both exact), on the weight's device."""
    return (w.dequantize() if isinstance(w, QuantWeight) else w).to(F64)


def weight_row(w, j: int) -> torch.Tensor:
    """Row ``j`` [K] of a weight [N, K] in its own values: a tensor's row, or a QuantWeight's dequantized fp32 row
    (only that row is dequantized)."""
    return w.dequantize(slice(j, j + 1))[0] if isinstance(w, QuantWeight) else w[j]


def kv64(t: torch.Tensor) -> torch.Tensor:
    """Cache rows as fp64 values: a packed fp8 cache (uint8 [..., D + 4]) its dequantized fp32 values, any other
    cache [..., D] its own values (both converted exactly)."""
    return kv_rows(t, torch.float32).to(F64)


def _gemm(x: torch.Tensor, w):
    """x [r, K] (stored dtype), w [N, K] (stored dtype or QuantWeight) -> y = x w^T, A = |x||w|^T, both [r, N]
    fp64 on w's device."""
    xd, wd = x.to(w.device, F64), weight64(w)
    return xd @ wd.T, xd.abs() @ wd.abs().T


def weight_key(cls: str, s: Sample) -> tuple:
    """(layer, tag) of the weight a GEMM-class sample multiplies by (expert_down: the expert's ``.down``)."""
    return (s.layer, s.tag + ".down") if cls == "expert_down" else (s.layer, s.tag)


def _eval_gemm(cls, samples, params, kv):
    parts, decisions = _Parts(), [None] * len(samples)
    for wkey, sids in _groups(samples, by=lambda s: weight_key(cls, s)):
        x = _stack(samples, sids, "x")                                             # [r, K]
        y, A = _gemm(x, params[wkey])                                              # [r, N] fp64
        yhat = _stack(samples, sids, "y")                                          # [r, N] stored
        K = x.shape[1]
        parts.add(sids, y, yhat, A, gamma(K) * A, K)
        if cls in ("router", "lm_head"):
            for r, i in enumerate(sids):
                decisions[i] = _decision(cls, samples[i], y[r].cpu(), yhat[r])
    return parts.build(cls, samples, decisions if cls in ("router", "lm_head") else ())


def group_mask(y: torch.Tensor, groups: tuple[int, int]) -> tuple[torch.Tensor, float]:
    """Group-limited routing on reference logits y [E] fp64 (kernels/router.py): a group's score is its largest
    logit (the kernels score by the largest probability; softmax keeps the order), the topk_groups best groups are
    kept. Returns (allowed [E] bool: the experts of the kept groups, margin: the score of the last kept group minus
    the best dropped one's, inf when none is dropped)."""
    G, Gk = groups
    score = y.view(G, -1).amax(dim=-1)                                             # [G]
    order = torch.sort(score, descending=True, stable=True)
    keep = torch.zeros(G, dtype=torch.bool)
    keep[order.indices[:Gk]] = True
    margin = float(order.values[Gk - 1] - order.values[Gk]) if Gk < G else math.inf
    return keep.repeat_interleave(y.numel() // G), margin


def _decision(cls, s: Sample, y: torch.Tensor, yhat: torch.Tensor):
    """(kernel choice, reference choice, reference margin): top-k expert set or argmax token. A router routing in
    groups (meta ``groups``) chooses among the experts of the reference's kept groups (group_mask); its margin is
    the smaller of the group margin and the top-k margin among the allowed experts."""
    if cls == "router":
        k = int(s.meta["top_k"])
        gm = math.inf
        if s.meta.get("groups"):
            allowed, gm = group_mask(y, tuple(s.meta["groups"]))
            y = torch.where(allowed, y, torch.full_like(y, -math.inf))
        ys = torch.sort(y, descending=True).values
        margin = float(ys[k - 1] - ys[k]) if k < y.numel() and math.isfinite(float(ys[k])) else math.inf
        return (tuple(sorted(s.data["idx"].tolist())), tuple(sorted(torch.topk(y, k).indices.tolist())),
                min(margin, gm))
    ys = torch.topk(y, 2).values
    return (int(torch.argmax(yhat.float())), int(torch.argmax(y)), float(ys[0] - ys[1]))


def _silu(g):
    return g * torch.sigmoid(g)


def _gate_up(samples, params, kv):
    """h = silu(g)·u, g = x·wg, u = x·wu. The kernel rounds g and u to u_s after an fp32 dot (gamma_K), evaluates
    silu in fp32 (C_SILU·u_a) and rounds it (u_s); |silu(g') - silu(g)| <= (|silu'(g)| + SILU_CURV·e_g)·e_g."""
    parts = _Parts()
    for (layer, tag), sids in _groups(samples):
        x = _stack(samples, sids, "x")
        g, Ag = _gemm(x, params[(layer, tag + ".gate")])
        u, Au = _gemm(x, params[(layer, tag + ".up")])
        us, K = unit_roundoff(x.dtype), x.shape[1]
        sg = _silu(g)
        dsg = torch.sigmoid(g) * (1 + g * (1 - torch.sigmoid(g)))                  # silu'(g)
        e_g = gamma(K) * Ag + us * (g.abs() + gamma(K) * Ag)
        e_u = gamma(K) * Au + us * (u.abs() + gamma(K) * Au)
        lip = dsg.abs() + SILU_CURV * e_g
        e_s = lip * e_g + (us + 2 * C_SILU * U_ACC) * (sg.abs() + lip * e_g)
        beta = e_s * (u.abs() + e_u) + sg.abs() * e_u
        A = dsg.abs() * u.abs() * Ag + sg.abs() * Au
        parts.add(sids, sg * u, _stack(samples, sids, "y"), A, beta, K)
    return parts.build("expert_gate_up", samples)


def _combine(samples, params, kv):
    """out = sum_j g_j y_j (+ shared). Bound: gamma_{k+1}·A plus one u_s rounding of the routed sum (the fast
    kernel's einsum result is stored before the shared expert is added)."""
    parts = _Parts()
    for _, sids in _groups(samples, by=lambda s: "shared" in s.data):
        y, g = _stack(samples, sids, "y").to(F64), _stack(samples, sids, "g").to(F64)   # [r, k, H], [r, k]
        terms = g[:, :, None] * y                                                        # [r, k, H]
        routed, A = terms.sum(1), terms.abs().sum(1)
        if "shared" in samples[sids[0]].data:
            sh = _stack(samples, sids, "shared").to(F64)
            ref, A = routed + sh, A + sh.abs()
        else:
            ref = routed
        k, us = y.shape[1], unit_roundoff(samples[sids[0]].data["y"].dtype)
        beta = gamma(k + 1) * A + us * (routed.abs() + gamma(k) * terms.abs().sum(1))
        parts.add(sids, ref, _stack(samples, sids, "out"), A, beta, k + 1)
    return parts.build("moe_combine", samples)


def _device(params: dict) -> torch.device:
    """Where a class without weights computes its references: the device of the run's weights (CPU without any)."""
    return next((w.device for w in params.values() if isinstance(getattr(w, "device", None), torch.device)),
                torch.device("cpu"))


def _attention(samples, params, kv):
    """o_d = sum_j p_j v_jd over keys 0..pos. Scores s_j = q·k_j/sqrt(D) with error Delta_j <= gamma_{D+2}·S_j
    (S_j = sum_d|q_d k_jd|/sqrt(D)); each unnormalised weight has relative error <= E = 2·max_j(Delta_j +
    u_a|s_j - max s|) + C_EXP·u_a; the value sums and the online-softmax rescales add r = gamma_{T + 2·ceil(T/32)
    + 4}; beta_d = A_d·(expm1(E + r)·(1 + r) + r). Computed on the weights' device (_device): fp64 there too."""
    parts, dev, cache64 = _Parts(), _device(params), {}
    for i, s in enumerate(samples):
        if s.layer not in cache64:   # the layer's keys and values as fp64, once (the conversion is exact)
            cache64[s.layer] = tuple(kv64(t).to(dev) for t in kv[s.layer])
        kc, vc = cache64[s.layer]
        p = s.pos
        q = s.data["q"].to(dev, F64)                                               # [Hq, D]
        Hq, D = q.shape
        k = kc[:p + 1].repeat_interleave(Hq // kc.shape[1], dim=1)                 # [T, Hq, D]
        v = vc[:p + 1].repeat_interleave(Hq // vc.shape[1], dim=1)
        sc = torch.einsum("hd,thd->ht", q, k) / math.sqrt(D)                       # [Hq, T]
        S = torch.einsum("hd,thd->ht", q.abs(), k.abs()) / math.sqrt(D)
        pr = torch.softmax(sc, dim=-1)
        o = torch.einsum("ht,thd->hd", pr, v)
        Ad = torch.einsum("ht,thd->hd", pr, v.abs())
        T = p + 1
        E = 2 * (gamma(D + 2) * S + U_ACC * (sc - sc.amax(-1, keepdim=True)).abs()).amax(-1) + C_EXP * U_ACC  # [Hq]
        r = gamma(T + 2 * math.ceil(T / 32) + 4)
        beta = Ad * (torch.expm1(E + r) * (1 + r) + r)[:, None]
        parts.add([i], o.reshape(1, -1), s.data["o"].reshape(1, -1), Ad.reshape(1, -1), beta.reshape(1, -1), T)
    return parts.build("attention", samples)


def _rmsnorm(samples, params, kv):
    """y = w·x·r, r = 1/sqrt(mean(x^2) + eps). The fp32 mean has relative error gamma_{H+2} (squares, sum, /H,
    +eps), rsqrt C_RSQRT·u_a: th = 0.505·gamma_{H+2} + (C_RSQRT+1)·u_a; then x·r in fp32 (u_a), stored (u_s)."""
    parts = _Parts()
    for (layer, tag), sids in _groups(samples):
        x = _stack(samples, sids, "x").to(F64)                                     # [r, ..., H]
        w = params[(layer, tag)].to("cpu", F64)
        eps = samples[sids[0]].meta["eps"]
        H = x.shape[-1]
        y = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        us = unit_roundoff(samples[sids[0]].data["x"].dtype)
        th = 0.505 * gamma(H + 2) + (C_RSQRT + 1) * U_ACC
        beta = y.abs() * ((1 + th) * (1 + U_ACC) * (1 + us) - 1)
        r = len(sids)
        parts.add(sids, y.reshape(r, -1), _stack(samples, sids, "y").reshape(r, -1), y.abs().reshape(r, -1),
                  beta.reshape(r, -1), H)
    return parts.build("rmsnorm", samples)


def rope_angles(D: int, theta: float, pos: torch.Tensor) -> torch.Tensor:
    """[n, D] fp64 exact angles pos·inv_freq with the model's fp32 inv_freq (kernels/rope.py), halves repeated."""
    from ...kernels.rope import _inv_freq
    inv = _inv_freq(D, theta, "cpu").to(F64)                                       # [D/2] fp32 values
    a = pos.to(F64)[:, None] * inv[None, :]                                        # exact: <= 15 + 24 bits
    return torch.cat([a, a], dim=-1)


def _rot(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope(samples, params, kv):
    """y = x·cos + rot(x)·sin. cos/sin: fp32 angle (u_a·|a|), fp32 cos/sin (C_TRIG·u_a abs), stored (u_s);
    each product stored (u_s); the final add is the final rounding."""
    parts = _Parts()
    for _, sids in _groups(samples, by=lambda s: (s.meta["theta"], s.tag, tuple(s.data["x"].shape))):
        x = _stack(samples, sids, "x").to(F64)                                     # [r, h, D]
        pos = torch.tensor([samples[i].pos for i in sids])
        a = rope_angles(x.shape[-1], samples[sids[0]].meta["theta"], pos)[:, None, :]   # [r, 1, D]
        c, s_, rx = torch.cos(a), torch.sin(a), _rot(x)
        us = unit_roundoff(samples[sids[0]].data["x"].dtype)
        ea = U_ACC * a.abs() + C_TRIG * U_ACC
        ec, es = ea + us * (c.abs() + ea), ea + us * (s_.abs() + ea)
        beta = x.abs() * (ec + us * (c.abs() + ec)) + rx.abs() * (es + us * (s_.abs() + es))
        r = len(sids)
        y, A = x * c + rx * s_, (x * c).abs() + (rx * s_).abs()
        parts.add(sids, y.reshape(r, -1), _stack(samples, sids, "y").reshape(r, -1), A.reshape(r, -1),
                  beta.reshape(r, -1), 2)
    return parts.build("rope", samples)


def _residual(samples, params, kv):
    """y = a + b: one fp32 add of stored values (u_a·A) before the final rounding."""
    parts = _Parts()
    a, b = _stack(samples, range(len(samples)), "a").to(F64), _stack(samples, range(len(samples)), "b").to(F64)
    A = a.abs() + b.abs()
    parts.add(list(range(len(samples))), a + b, _stack(samples, range(len(samples)), "y"), A, U_ACC * A, 2)
    return parts.build("residual", samples)


# The evaluators the kernel-class records (kernels/registry.py, field ``fp64``) name: (samples, params, kv) -> Eval.
eval_dense, eval_router, eval_expert_down, eval_lm_head = (functools.partial(_eval_gemm, c) for c in
                                                           ("dense", "router", "expert_down", "lm_head"))
eval_expert_gate_up, eval_moe_combine, eval_attention = _gate_up, _combine, _attention
eval_rmsnorm, eval_rope, eval_residual = _rmsnorm, _rope, _residual


def evaluate(cls: str, samples: list[Sample], params: dict, kv: dict) -> Eval:
    """The :class:`Eval` of ``samples`` (all of class ``cls``).

    Args:
        params: (layer, tag) -> weight tensor (taps.TapRecorder.params); kv: layer -> (k [T, Hkv, D], v) of the run,
            as the cache stores them (an fp8 cache: uint8 [T, Hkv, D + 4], read through kv64).
    The evaluator is the class record's ``fp64`` (kernels/registry.py).
    Raises:
        ValueError: a class with no FP64 evaluator (lists the known ones) or no samples.
    """
    if cls not in FP64_CLASSES:
        raise ValueError(f"no FP64 reference for class {cls!r}; known: {', '.join(FP64_CLASSES)}")
    return resolve(class_record(cls).fp64)(samples, params, kv)
