"""Fixed row tiles: the batch-invariance device used by the CPU invariant kernels.

A library GEMM chooses its blocking, and so its accumulation order, from the problem shape: row r of
``x[M] @ w`` can differ from ``x[r:r+1] @ w`` once M changes (on CPU with torch 2.13 for M >= 7 in fp32). Calling the
library only on tiles of exactly ``TILE_ROWS`` rows (padding the last one with zero rows) fixes the shape every call
sees, so each row's bytes no longer depend on how many rows came with it. The contract checker verifies this claim
for every class rather than trusting it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

TILE_ROWS = 64


def pad_rows(x: torch.Tensor, multiple: int = TILE_ROWS) -> torch.Tensor:
    """Append zero rows to ``x`` [M, ...] so that its first dim is a multiple of ``multiple`` (no copy if it is)."""
    pad = (-x.shape[0]) % multiple
    if pad == 0:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))          # zeros after the last row


def per_tile(fn: Callable[..., torch.Tensor], *row_args: torch.Tensor, tile: int = TILE_ROWS) -> torch.Tensor:
    """Apply ``fn`` to fixed ``tile``-row tiles of every row argument and concatenate the first M output rows.

    Args:
        fn: maps tiles ``[tile, ...]`` (one per row argument) to an output ``[tile, ...]``, or to a tuple of them.
        row_args: tensors sharing the leading row dim M.
    Returns:
        ``[M, ...]``: fn's rows for the real (unpadded) rows; a tuple of them where fn returns a tuple.
    """
    M = row_args[0].shape[0]
    padded = [pad_rows(a, tile) for a in row_args]
    outs = [fn(*(a[i:i + tile] for a in padded)) for i in range(0, padded[0].shape[0], tile)]
    if isinstance(outs[0], tuple):
        return tuple(_rows(parts, M) for parts in zip(*outs))
    return _rows(outs, M)


def _rows(outs, M: int) -> torch.Tensor:
    """The first M rows of the tiles' outputs in order, contiguous (one contiguous tile: a view of it, no copy)."""
    return outs[0][:M].contiguous() if len(outs) == 1 else torch.cat(outs, dim=0)[:M]
