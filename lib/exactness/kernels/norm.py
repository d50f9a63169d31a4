"""Kernel classes ``rmsnorm`` and ``residual``.

RMSNorm (Zhang & Sennrich, arXiv 1910.07467) with Hugging Face ``Qwen3MoeRMSNorm`` semantics: mean of squares and
rsqrt in fp32, the normalised row rounded to the storage dtype, then multiplied by the weight in the storage dtype.

Signatures: ``rmsnorm(x [..., H], w [H], eps) -> [..., H]``; ``residual(a, b) -> a + b``; storage dtype throughout.
"""
from __future__ import annotations

import torch

from .tiles import per_tile


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return w * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def rmsnorm_fast(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """torch ops on the whole block."""
    return _rms(x, w, eps)


def rmsnorm_invariant(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows flattened to [R, H] and normalised on fixed 64-row tiles."""
    flat = x.reshape(-1, x.shape[-1])
    return per_tile(lambda t: _rms(t, w, eps), flat).reshape(x.shape)


def residual_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b in the storage dtype (one correctly rounded add per element: row-independent by construction)."""
    return a + b
