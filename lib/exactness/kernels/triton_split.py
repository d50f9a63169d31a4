"""Split-K in parallel programs for triton_gemm's small calls: which calls take it (``takes_split``), the launch
(``run_split``) and the per-tile counts by which each tile's last split sums the partials (``split_counts``).
triton_group runs the same programs for several weights.

A split call runs one program per (output tile, split): each stores its split's fp32 partial (accumulated from zero
over its K chunks in ascending order), then counts it for its tile; the program that counts last adds every split's
partial in split order, rounds once and stores -- the operations of one program doing the splits in turn, so the
same bytes (triton_gemm's invariance device). Where no counts serve, a second launch adds them the same way.
"""
from __future__ import annotations

import torch

from .triton_rows import INTERPRET, cdiv, launch
from .triton_tiles import _gemm_split_kernel, _split_reduce_kernel

# Where a split-K config runs its splits in parallel programs rather than in turn (the same bytes either way): below
# this many output tiles the in-turn programs leave most SMs idle, above it the parallel runs' fp32 partials and
# their sum cost more (the crossover measured for every split shape of the small preset on the H200 by
# benchmarks/bench_split_k.py --part rows, with the sum in a second launch) ...
SPLIT_TILES_BELOW = 40
SPLIT_MAX_ROWS = 512      # ... for calls of up to this many rows (the range measured)
REDUCE = dict(BM=32, BN=128)   # the second launch's tile
COUNT_SLOTS = 4096
WIDE = {torch.bfloat16: 1, torch.float16: 2}   # storage dtype -> triton_tiles._sum_tile's WIDE (sum widened to fp32)
_COUNTS: dict[tuple, torch.Tensor] = {}


def takes_split(lp, M: int, N: int) -> bool:
    """Whether a call of M rows in triton_gemm launch ``lp`` runs its splits in parallel programs (run_split)."""
    tiles = cdiv(M, lp.cfg.block_m) * cdiv(N, lp.cfg.block_n)
    return lp.cfg.split_k > 1 and lp.b2 is None and tiles < SPLIT_TILES_BELOW and M <= SPLIT_MAX_ROWS


def split_counts(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The int32 counts [COUNT_SLOTS] by which a split call's programs find each tile's last split (_sum_if_last):
    one buffer per device and CUDA stream, zero between calls (the last split of a tile sets its count back), so
    calls on one stream, which run one after another, share it. Never freed: a captured CUDA graph keeps its
    address. None where ``tiles`` exceed it, or while a CUDA graph is captured and the stream has none yet (its
    zeros would not be written before the first replay): the caller sums in a second launch (_split_reduce_kernel,
    the same bytes)."""
    if tiles > COUNT_SLOTS:
        return None
    key = (device, torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0)
    c = _COUNTS.get(key)
    if c is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        c = _COUNTS[key] = torch.zeros(COUNT_SLOTS, dtype=torch.int32, device=device)
    return c if c is not None and c.numel() >= tiles else None


def run_split(lp, a, out: torch.Tensor, M: int, N: int, K: int, key, wide: int = 0) -> None:
    """triton_gemm launch ``lp``'s splits in parallel programs (partials [split_k, M, N] fp32) and their fixed-order
    sum, rounded into out [M, N]: in the same launch by each tile's last split where split_counts serves, else by
    a second launch. a: x as lp loads it (triton_gemm.a_operand); key: the call's launch key (lp.key, or
    (lp.key, aligned) without TMA); wide: WIDE's code of x's dtype for an fp32 ``out`` that gets the sum rounded
    to that dtype and widened (the bytes of the storage-dtype result then ``.float()``), else 0."""
    ws = torch.empty(lp.cfg.split_k, M, N, dtype=torch.float32, device=out.device)
    tiles = cdiv(M, lp.cfg.block_m) * cdiv(N, lp.cfg.block_n)
    counts = split_counts(out.device, tiles)
    skey = (lp.split_key if key == lp.key else (lp.split_key, key[1]), counts is not None, wide)
    launch(_gemm_split_kernel, (tiles, lp.cfg.split_k), (a, lp.b, ws, out, ws if counts is None else counts,
                                                         M, N, K, K, K),
           dict(lp.split_consts, SUM=counts is not None, WIDE=wide), key=skey, **lp.opts)
    if counts is None:
        launch(_split_reduce_kernel, (cdiv(M, REDUCE["BM"]), cdiv(N, REDUCE["BN"])), (ws, out, M, N),
               dict(**REDUCE, SPLIT=lp.cfg.split_k, EMULATE=INTERPRET, WIDE=wide), num_warps=4)
