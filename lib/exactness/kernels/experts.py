"""Kernel classes ``expert_gate_up``, ``expert_down`` and ``moe_combine``.

Signatures:
    expert_gate_up(x [M, H], w_gate [I, H], w_up [I, H]) -> h [M, I]   SiLU(x w_gate^T) * (x w_up^T), storage dtype
    expert_down(h [M, I], w_down [H, I]) -> y [M, H]                     storage dtype
    moe_combine(y [M, k, H], weights [M, k], shared [M, H] | None) -> [M, H] storage dtype
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dense import tile_linear
from .tiles import per_tile


def gate_up_fast(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Library GEMMs on the whole block, then SiLU(gate) * up (Hugging Face Qwen3MoeMLP order of ops)."""
    return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


def gate_up_invariant(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Fixed 64-row tiles for both GEMMs and for the SiLU (whose vector/scalar code paths depend on position)."""
    g, u = tile_linear(x, w_gate), tile_linear(x, w_up)    # [M, I] storage dtype
    return per_tile(lambda gt, ut: F.silu(gt) * ut, g, u)


def down_fast(h: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Library GEMM on the whole block."""
    return F.linear(h, w_down)


def down_invariant(h: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Library GEMM on fixed 64-row tiles."""
    return tile_linear(h, w_down)


def combine_fast(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """einsum over k in the storage dtype (the library picks the reduction order), plus the shared expert."""
    out = torch.einsum("mk,mkh->mh", weights, y)
    return out if shared is None else out + shared


def combine_invariant(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """fp32 sum over the k slots in slot order 0..k-1 (elementwise ops: no reduction order to vary), then shared."""
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)  # [M, H] fp32
    for j in range(y.shape[1]):
        acc = acc + weights[:, j:j + 1].float() * y[:, j].float()
    if shared is not None:
        acc = acc + shared.float()
    return acc.to(y.dtype)
