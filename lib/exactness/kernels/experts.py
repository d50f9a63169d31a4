"""Kernel classes ``expert_gate_up``, ``expert_down`` and ``moe_combine``.

Signatures:
    expert_gate_up(x [M, H], w_gate [I, H], w_up [I, H]) -> h [M, I]   SiLU(x w_gate^T) * (x w_up^T), storage dtype
    expert_down(h [M, I], w_down [H, I]) -> y [M, H]                     storage dtype
    moe_combine(y [M, k, H], weights [M, k], shared [M, H] | None) -> [M, H] storage dtype

The weights may be quant.QuantWeight (quantized experts): the GEMMs then go through dense.linear_fast /
dense.tile_linear, which dispatch on the weight type.

Expert-id-aware kernels: a set whose options hold ``expert_id_aware=True`` gets the expert id as a keyword,
``expert_gate_up(x, w_gate, w_up, expert_id=e)`` and ``expert_down(h, w_down, expert_id=e)`` (e = -1 for the shared
expert), so hot and cold experts can be served by different kernels (:func:`by_expert`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from .dense import linear_fast, tile_linear
from .registry import KernelSet
from .tiles import per_tile


def gate_up_fast(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Library GEMMs on the whole block, then SiLU(gate) * up (Hugging Face Qwen3MoeMLP order of ops)."""
    return F.silu(linear_fast(x, w_gate)) * linear_fast(x, w_up)


def gate_up_invariant(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Fixed 64-row tiles for both GEMMs and for the SiLU (whose vector/scalar code paths depend on position)."""
    g, u = tile_linear(x, w_gate), tile_linear(x, w_up)    # [M, I] storage dtype
    return per_tile(lambda gt, ut: F.silu(gt) * ut, g, u)


def down_fast(h: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Library GEMM on the whole block."""
    return linear_fast(h, w_down)


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


def by_expert(base: KernelSet, hot: Iterable[int], cold_gate_up: Callable, cold_down: Callable,
              name: str | None = None) -> KernelSet:
    """A residency-dependent set: ``base`` with expert ids in ``hot`` (and the shared expert, id -1) served by
    base's expert kernels and every other (cold) expert by ``cold_gate_up`` / ``cold_down`` (the classes'
    signatures), in both roles. The set is expert-id aware (module docstring) and not registered.

    Raises:
        ValueError: a hot id is negative.
    """
    hot = frozenset(int(e) for e in hot)
    if any(e < 0 for e in hot):
        raise ValueError(f"hot expert ids must be >= 0, got {sorted(hot)}")

    def pick(spec, cold):
        def fn(*args, expert_id: int = -1):
            return (spec.fn if expert_id < 0 or expert_id in hot else cold)(*args)
        return replace(spec, fn=fn)
    cold = {"expert_gate_up": cold_gate_up, "expert_down": cold_down}
    tab = {r: {c: (pick(s, cold[c]) if c in cold else s) for c, s in getattr(base, r).items()}
           for r in ("decode", "prompt")}
    return KernelSet(name or f"{base.name}+cold", tab["decode"], tab["prompt"], base.claims_exact,
                     f"{base.description}; experts outside {sorted(hot)} served by other kernels",
                     replace(base.options.without("grouped_experts", "tiles_in_kernels"),
                             expert_id_aware=True))   # the cold kernels may depend on the call's rows
