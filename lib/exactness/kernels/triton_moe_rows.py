"""The MoE block's row-wise Triton kernels for CUDA: the router's softmax + top-k and the combine of the experts'
outputs, with triton_rows' invariance device (one block shape per row width, reductions along the row only, no
contraction) and rounding points of router.router_invariant and experts.combine_invariant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_rows import _NO_FMA, INTERPRET, _check_float, cdiv, launch, next_pow2, pdl_start, round_to


# Rows and warps of a softmax/top-k program: they fix how its reductions along a row are laid out over lanes, and so
# the sum's order; triton_router runs the same rows in the same warps.
ROWS = 8
WARPS = 4


@triton.jit
def _topk_rows(l_ptr, w_ptr, i_ptr, r0, M, E, TOPK: tl.constexpr, NORM: tl.constexpr, BR: tl.constexpr,
               BE: tl.constexpr, BK: tl.constexpr, EMULATE: tl.constexpr):
    """The router tail of rows r0..r0+BR-1 of logits l [M, E]: fp32 softmax, top-k, optional renorm, stored to
    w [M, TOPK] (l's dtype) and i [M, TOPK] int64; rows >= M are left alone."""
    rows = r0 + tl.arange(0, BR)
    cols = tl.arange(0, BE)
    kk = tl.arange(0, BK)
    rmask = rows < M
    cmask = cols[None, :] < E
    x = tl.load(l_ptr + rows[:, None] * E + cols[None, :], mask=rmask[:, None] & cmask,
                other=float("-inf")).to(tl.float32)                                            # [BR, BE]
    mx = tl.max(x, axis=1)
    p = tl.exp(x - mx[:, None])
    p = tl.math.div_rn(p, tl.sum(p, axis=1)[:, None])                                          # fp32 softmax
    p = tl.where(cmask, p, -1.0)                                                               # never chosen
    vals = tl.zeros((BR, BK), dtype=tl.float32)
    idxs = tl.zeros((BR, BK), dtype=tl.int64)
    total = tl.zeros((BR,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        v = tl.max(p, axis=1)
        i = tl.argmax(p, axis=1, tie_break_left=True)                                          # lower id wins
        vals = tl.where(kk[None, :] == j, v[:, None], vals)
        idxs = tl.where(kk[None, :] == j, i[:, None].to(tl.int64), idxs)
        total = total + v                                                                      # slot order
        p = tl.where(cols[None, :] == i[:, None], -1.0, p)
    if NORM:
        vals = tl.math.div_rn(vals, total[:, None])
    omask = rmask[:, None] & (kk[None, :] < TOPK)
    tl.store(w_ptr + rows[:, None] * TOPK + kk[None, :], round_to(vals, w_ptr.dtype.element_ty, EMULATE),
             mask=omask)
    tl.store(i_ptr + rows[:, None] * TOPK + kk[None, :], idxs, mask=omask)


@triton.jit(do_not_specialize=["M"])
def _softmax_topk_kernel(l_ptr, w_ptr, i_ptr, M, E, TOPK: tl.constexpr, NORM: tl.constexpr,
                         BR: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, EMULATE: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_start(PDL)
    _topk_rows(l_ptr, w_ptr, i_ptr, tl.program_id(0) * BR, M, E, TOPK, NORM, BR, BE, BK, EMULATE)


def softmax_topk(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router tail as router.router_invariant: fp32 softmax, top-k (ties: lower expert id), optional renorm.

    Args:
        logits: [M, E] bf16/fp16/fp32; top_k: 1..E; norm: renormalise the k weights to sum to 1.
    Returns:
        (weights [M, k] in logits' dtype, idx [M, k] int64), slots in descending probability order.
    Raises:
        ValueError: top_k outside 1..E or bad logits.
    """
    _check_float("logits", logits)
    if logits.dim() != 2 or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"expected logits [M, E] and 1 <= top_k <= E; got {tuple(logits.shape)}, top_k={top_k}")
    M, E = logits.shape
    lc = logits.contiguous()
    w = torch.empty(M, top_k, dtype=logits.dtype, device=logits.device)
    idx = torch.empty(M, top_k, dtype=torch.int64, device=logits.device)
    if M:
        launch(_softmax_topk_kernel, (cdiv(M, ROWS),), (lc, w, idx, M, E),
               dict(TOPK=top_k, NORM=bool(norm), BR=ROWS, BE=next_pow2(E),
                    BK=next_pow2(top_k), EMULATE=INTERPRET), num_warps=WARPS, **_NO_FMA)
    return w, idx


@triton.jit(do_not_specialize=["M"])
def _combine_kernel(y_ptr, w_ptr, s_ptr, o_ptr, M, H, K: tl.constexpr, HAS_SHARED: tl.constexpr,
                    BH: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    m = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = cols < H
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(K):
        wj = tl.load(w_ptr + m * K + j).to(tl.float32)
        yj = tl.load(y_ptr + (m * K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
        acc = acc + wj * yj                                                                    # no fma
    if HAS_SHARED:
        acc = acc + tl.load(s_ptr + m * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + m * H + cols, round_to(acc, o_ptr.dtype.element_ty, EMULATE), mask=mask)


def combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """MoE combine as experts.combine_invariant: fp32 sum over slots 0..k-1 of w*y, + shared, rounded once.

    Args:
        y: [M, k, H]; weights: [M, k]; shared: [M, H] or None; one dtype, one device.
    Returns:
        [M, H] in y's dtype.
    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    _check_float("y", y)
    M, k, H = y.shape
    if weights.shape != (M, k) or (shared is not None and shared.shape != (M, H)):
        raise ValueError(f"expected weights [{M}, {k}] and shared [{M}, {H}] or None; got "
                         f"{tuple(weights.shape)}, {None if shared is None else tuple(shared.shape)}")
    if weights.dtype != y.dtype or (shared is not None and shared.dtype != y.dtype):
        raise ValueError(f"y, weights and shared must share y's dtype {y.dtype}")
    out = torch.empty(M, H, dtype=y.dtype, device=y.device)
    if M:
        bh = min(1024, next_pow2(H))
        s = shared.contiguous() if shared is not None else out
        launch(_combine_kernel, (M, cdiv(H, bh)), (y.contiguous(), weights.contiguous(), s, out, M, H),
               dict(K=k, HAS_SHARED=shared is not None, BH=bh, EMULATE=INTERPRET), num_warps=4, **_NO_FMA)
    return out
