"""Kernel class ``dense``: y[M, N] = x[M, K] @ w[N, K]^T in the storage dtype with fp32 accumulation.

Used for the q/k/v/o projections and the shared expert's projections; ``tile_linear`` is also the GEMM of the
invariant expert, router and lm_head kernels. ``w`` may be a quant.QuantWeight (weights ``int4_g128`` / ``nvfp4``):
the kernels then run quant.py's (fast: mat-vec below a row threshold, dequantize + GEMM above; invariant: the
fixed-order per-row reduction for every call size).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import quant
from .tiles import per_tile


def linear_fast(x: torch.Tensor, w) -> torch.Tensor:
    """Library GEMM on the whole [M, K] block (torch.nn.functional.linear); blocking depends on M. [M, N]."""
    if isinstance(w, quant.QuantWeight):
        return quant.linear_fast(x, w)
    return F.linear(x, w)  # [M, N] storage dtype


def tile_linear(x: torch.Tensor, w) -> torch.Tensor:
    """Library GEMM on fixed 64-row tiles (tiles.per_tile): row r's bytes do not depend on M. [M, N]."""
    if isinstance(w, quant.QuantWeight):
        return quant.linear_tiles(x, w)
    return per_tile(lambda t: F.linear(t, w), x)
