"""Kernel classes ``lm_head`` and ``argmax``.

Signatures: ``lm_head(x [M, H], w [V, H]) -> logits [M, V] fp32`` (the storage-dtype GEMM result, widened, as in
Hugging Face ``logits.float()``); ``argmax(logits [M, V]) -> ids [M] int64`` (ties: the lowest id).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dense import tile_linear


def lm_head_fast(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Library GEMM on the whole block."""
    return F.linear(x, w).float()


def lm_head_invariant(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Library GEMM on fixed 64-row tiles."""
    return tile_linear(x, w).float()


def argmax_first(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the vocabulary: documented to return the first maximal index (lowest id wins ties)."""
    return torch.argmax(logits, dim=-1)
