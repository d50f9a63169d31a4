"""A split-K projection, then the residual add and the next RMSNorm of its rows, in one launch (CUDA): every byte of
triton_gemm.linear(x, w) then triton_fused.residual_norm(a, that, wn).

The launch runs triton_split's programs, one per (output tile, split): each tile's last split sums the partials
into the projection's output, as there. That program then counts its tile for its block of rows (the counts past
the tiles' own in triton_split.split_counts, acq_rel at GPU scope after a barrier, as the tiles' counts); the tile
that counts last sees every column of those rows and runs residual_norm's code over them (triton_fused's
_add_norm_rows), on residual_norm's block (triton_rows._row_block of the width: its rows, block width and warps), so
that each row's mean of squares is summed in that kernel's order: the launch serves only where the call's
placement has residual_norm's warps and tile rows that are a multiple of its rows per program. It reads the
projection's output past L1 (.cg), which other SMs' stores do not update. Elsewhere (no split programs for the
call, no counts, or a placement that does not fit) the caller runs the two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_gemm
from .triton_fused import _add_norm_rows
from .triton_rows import _NO_FMA, INTERPRET, _row_block, intern_key, launch, pdl_start
from .triton_tiles import _split_partial, _tile_coords


@triton.jit(do_not_specialize=["M"])
def _dense_norm_kernel(a_src, b_src, ws_ptr, c_ptr, cnt_ptr, r_ptr, wn_ptr, x_ptr, h_ptr, M, N, K, eps,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                       TMA: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr, SPLIT: tl.constexpr,
                       BR: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    """One program per (output tile, split) of c [M, N] = a @ b^T; the last tile of a block of BM rows to be summed
    stores x = r + c and h = rmsnorm(x, wn) [M, N] for those rows, BR at a time."""
    pdl_start(PDL)
    tile = tl.program_id(0)
    last = _split_partial(a_src, b_src, ws_ptr, c_ptr, cnt_ptr, tile, tl.program_id(1), M, N, K, K, K, BM, BN, BK,
                          GROUP_M, TMA, PRECISION, EMULATE, SPLIT, True)
    if last:
        col_tiles = tl.cdiv(N, BN)
        pid_m, _ = _tile_coords(tile, tl.cdiv(M, BM), col_tiles, GROUP_M)
        row_cnt = cnt_ptr + tl.cdiv(M, BM) * col_tiles + pid_m
        tl.debug_barrier()                                   # the sum's stores of c before the count
        if tl.atomic_add(row_cnt, 1, sem="acq_rel", scope="gpu") == col_tiles - 1:
            cols = tl.arange(0, BH)
            for r0 in range(0, tl.minimum(BM, M - pid_m * BM), BR):     # blocks of BR rows holding the call's
                rows = pid_m * BM + r0 + tl.arange(0, BR)
                mask = (rows[:, None] < M) & (cols[None, :] < N)
                offs = rows[:, None] * N + cols[None, :]
                r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)                  # [BR, BH]
                c = tl.load(c_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
                _add_norm_rows(r, c, wn_ptr, x_ptr, h_ptr, offs, mask, cols, N, eps, EMULATE)
            tl.store(row_cnt, 0)


def fits(cfg, N: int) -> bool:
    """Whether a split call of GemmConfig ``cfg`` over N columns can run residual_norm's rows in its last tile: its
    warps are residual_norm's for rows of N, its tile rows a multiple of that kernel's rows per program."""
    rows, _, warps = _row_block(N)
    return cfg.split_k > 1 and cfg.num_warps == warps and cfg.block_m % rows == 0


def try_dense_residual_norm(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, wn: torch.Tensor, eps: float,
                            config=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a + linear(x, w), rmsnorm(that, wn, eps)), the bytes of triton_gemm.linear then triton_fused.residual_norm,
    in one launch; None where that launch does not serve (module docstring; also tensors of other shapes, dtypes
    or devices): nothing launched.

    Args:
        x: [M, K]; w: [N, K]; a: [M, N] the residual stream; wn: [N]; one float dtype on one CUDA device (the CPU
            under the interpreter). config: as triton_gemm.linear's (tests).
    Returns:
        (x_new, h), both [M, N] in a's dtype.
    """
    ts = (x, w, a, wn)
    if not (x.dim() == 2 and w.dim() == 2 and a.dim() == 2 and wn.dim() == 1 and (x.is_cuda or INTERPRET)
            and all(t.dtype == x.dtype and t.device == x.device for t in ts)
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return None
    (M, K), N = x.shape, w.shape[0]
    if w.shape[1] != K or a.shape != (M, N) or wn.shape != (N,):
        return None
    call = triton_gemm.split_call(x, w, lambda cfg: fits(cfg, N), config, row_counts=True)
    if call is None:
        return None
    lp, op, aligned, ws, counts, tiles = call
    ac, wc = a.contiguous(), wn.contiguous()
    c = torch.empty(M, N, dtype=x.dtype, device=x.device)
    xo, h = torch.empty_like(ac), torch.empty_like(ac)
    br, bh, _ = _row_block(N)
    key = intern_key((_dense_norm_kernel, lp.split_key, aligned, ac.data_ptr() % 16 == 0, wc.data_ptr() % 16 == 0))
    launch(_dense_norm_kernel, (tiles, lp.cfg.split_k), (op, lp.b, ws, c, counts, ac, wc, xo, h, M, N, K,
                                                         float(eps)),
           dict(lp.split_consts, BR=br, BH=bh), key=key, **lp.opts, **_NO_FMA)
    return xo, h
