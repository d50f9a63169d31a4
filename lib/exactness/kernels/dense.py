"""Kernel class ``dense``: y[M, N] = x[M, K] @ w[N, K]^T in the storage dtype with fp32 accumulation.

Used for the q/k/v/o projections and the shared expert's projections; ``tile_linear`` is also the GEMM of the
invariant expert, router and lm_head kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .tiles import per_tile


def linear_fast(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Library GEMM on the whole [M, K] block (torch.nn.functional.linear); blocking depends on M."""
    return F.linear(x, w)  # [M, N] storage dtype


def tile_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Library GEMM on fixed 64-row tiles (tiles.per_tile): row r's bytes do not depend on M. [M, N]."""
    return per_tile(lambda t: F.linear(t, w), x)
