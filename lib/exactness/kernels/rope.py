"""Kernel class ``rope``: rotary position embedding (Su et al., RoFormer, arXiv 2104.09864), Hugging Face
``rotate_half`` layout: out = x * cos + rotate_half(x) * sin, with cos/sin computed in fp32 and rounded to the
storage dtype, the products and the sum in the storage dtype.

Signature: ``rope(x [M, h, D], positions [M] int64, theta) -> [M, h, D]``.
"""
from __future__ import annotations

import torch

_TABLES: dict = {}


def _inv_freq(D: int, theta: float, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D))  # [D/2] fp32


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def rope_fast(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """cos/sin evaluated for just these positions (the vector/scalar exp paths can depend on how many there are)."""
    freqs = positions.float()[:, None] * _inv_freq(x.shape[-1], theta, x.device)[None, :]  # [M, D/2] fp32
    emb = torch.cat([freqs, freqs], dim=-1)
    return _rotate(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))


def _table(D: int, theta: float, n: int, device, dtype):
    key = (D, theta, str(device), dtype)
    tab = _TABLES.get(key)
    if tab is None or tab[0].shape[0] < n:
        n = max(n, 32768)
        freqs = torch.arange(n, device=device).float()[:, None] * _inv_freq(D, theta, device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)                 # [n, D] fp32
        tab = (emb.cos().to(dtype), emb.sin().to(dtype))
        _TABLES[key] = tab
    return tab


def rope_invariant(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """cos/sin gathered from one table per (D, theta, device, dtype) computed once: a gather cannot vary by row."""
    cos, sin = _table(x.shape[-1], theta, int(positions.max()) + 1, x.device, x.dtype)
    return _rotate(x, cos[positions], sin[positions])
