"""The router of a decode-size call in one launch (CUDA): the logits' split-K programs (triton_split's, summed by
each tile's last split) and, in that last split, the softmax/top-k of the tile's rows (triton_moe_rows._topk_rows,
in its rows per program and warps), so every byte of triton_gemm.linear then triton_moe_rows.softmax_topk: the
same split programs, the same sum, and the same softmax/top-k code over the same [rows, experts] block laid out
over the same lanes. It serves where the logits' columns fit one tile of the call's placement (the router's
16-row decode placement has 128 columns) and counts serve; elsewhere the caller launches the two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_gemm
from . import triton_moe_rows as mr
from .triton_rows import _NO_FMA, cdiv, intern_key, launch, next_pow2, pdl_start
from .triton_tiles import _split_partial


@triton.jit(do_not_specialize=["M"])
def _router_split_kernel(a_src, b_src, ws_ptr, c_ptr, cnt_ptr, w_ptr, i_ptr, M, N, K, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
                         PRECISION: tl.constexpr, EMULATE: tl.constexpr, SPLIT: tl.constexpr, TOPK: tl.constexpr,
                         NORM: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr, BKK: tl.constexpr,
                         PDL: tl.constexpr):
    """One program per (row tile, split) over logits of one column tile: the split's partial; the tile's last split
    sums them into c [M, N] and then takes the softmax/top-k of the tile's rows, BR at a time, into w and i."""
    pdl_start(PDL)
    tile = tl.program_id(0)
    last = _split_partial(a_src, b_src, ws_ptr, c_ptr, cnt_ptr, tile, tl.program_id(1), M, N, K, K, K, BM, BN, BK,
                          GROUP_M, TMA, PRECISION, EMULATE, SPLIT, True)
    if last:
        tl.debug_barrier()                                   # the sum's stores of c before any thread reads them
        for r0 in tl.static_range(0, BM, BR):
            if tile * BM + r0 < M:                           # a block of rows past the call's holds no row
                mr._topk_rows(c_ptr, w_ptr, i_ptr, tile * BM + r0, M, N, TOPK, NORM, BR, BE, BKK, EMULATE)


def fits(cfg, N: int, top_k: int) -> bool:
    """Whether a split call of GemmConfig ``cfg`` over N logits can take the softmax/top-k in its last split: one
    column tile, rows a multiple of triton_moe_rows' rows per program, its warps, and 1 <= top_k <= N."""
    return (cfg.split_k > 1 and cdiv(N, cfg.block_n) == 1 and cfg.block_m % mr.ROWS == 0
            and cfg.num_warps == mr.WARPS and 1 <= top_k <= N)


def router(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool) -> tuple | None:
    """(weights [M, k] in x's dtype, idx [M, k] int64, logits [M, E] in x's dtype) with the bytes of
    triton_gemm.linear(x, w) then triton_moe_rows.softmax_topk, in one launch; None where that launch does not
    serve (no split programs for this call, ``fits`` refuses their config, no counts, or an empty call): the
    caller runs the two.

    Args:
        x: [M, K]; w: [E, K]; one dtype and CUDA device (or CPU under the interpreter); top_k, norm as softmax_topk.
    Raises:
        ValueError: shapes, dtypes or devices that do not match (triton_gemm's checks).
    """
    M, E = x.shape[0], w.shape[0]
    call = triton_gemm.split_call(x, w, lambda cfg: fits(cfg, E, top_k))
    if call is None:
        return None
    lp, a, aligned, ws, counts, tiles = call
    logits = torch.empty(M, E, dtype=x.dtype, device=x.device)
    weights = torch.empty(M, top_k, dtype=x.dtype, device=x.device)
    idx = torch.empty(M, top_k, dtype=torch.int64, device=x.device)
    key = intern_key((_router_split_kernel, lp.split_key, aligned, top_k, bool(norm)))
    launch(_router_split_kernel, (tiles, lp.cfg.split_k), (a, lp.b, ws, logits, counts, weights, idx, M, E,
                                                          x.shape[1]),
           dict(lp.split_consts, TOPK=top_k, NORM=bool(norm), BR=mr.ROWS, BE=next_pow2(E), BKK=next_pow2(top_k)),
           key=key, **lp.opts, **_NO_FMA)
    return weights, idx, logits
