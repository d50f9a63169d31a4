"""Kernel class ``router``: logits = x @ w_router^T, softmax in fp32, top-k, renormalised weights.

Semantics follow Hugging Face ``Qwen3MoeSparseMoeBlock``: logits in the storage dtype, softmax in fp32, top-k of the
probabilities, optional renormalisation over the k, weights cast back to the storage dtype.

Group-limited routing (DeepSeek-V2's ``group_limited_greedy``): with ``groups = (G, Gk)`` the E experts form G
groups of E/G consecutive ids, each group is scored by its largest probability, the Gk best groups are kept and the
top-k is taken over the kept groups' experts only (the weights are still the softmax over all E).

Signature: ``router(x [M, H], w [E, H], top_k, norm[, groups]) -> (weights [M, k] storage dtype, idx [M, k] int64,
logits [M, E] storage dtype)``; ``groups`` (n_groups, topk_groups) is passed only when n_groups > 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dense import tile_linear
from .tiles import per_tile


def _group_mask(p: torch.Tensor, groups: tuple[int, int] | None, stable: bool) -> torch.Tensor:
    """p [T, E] fp32 with the experts of dropped groups set to -1 (below every probability); p when no groups."""
    if groups is None or groups[0] == 1:
        return p
    G, Gk = groups
    score = p.view(p.shape[0], G, -1).amax(dim=-1)                          # [T, G] fp32 (max: exact)
    if stable:  # equal scores keep ascending group order: the lower group id wins
        kept = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :Gk]
    else:
        kept = torch.topk(score, Gk, dim=-1).indices
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, kept, True)   # [T, G]
    return torch.where(keep.repeat_interleave(p.shape[1] // G, dim=1), p, torch.full_like(p, -1.0))


def router_fast(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool, groups: tuple[int, int] | None = None):
    """torch ops on the whole block; ``torch.topk`` decides ties in its own (unspecified) way."""
    logits = F.linear(x, w)                                   # [M, E] storage dtype
    probs = torch.softmax(logits.float(), dim=-1)             # [M, E] fp32
    _, idx = torch.topk(_group_mask(probs, groups, False), top_k, dim=-1)   # [M, k]
    weights = probs.gather(1, idx)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), idx, logits


def _softmax_topk_tile(logits: torch.Tensor, top_k: int, norm: bool, groups: tuple[int, int] | None = None):
    p = logits.float()                                        # [T, E] fp32
    p = torch.exp(p - p.amax(dim=-1, keepdim=True))
    p = p / p.sum(dim=-1, keepdim=True)
    # Stable descending sort: equal probabilities keep ascending expert order (defined tie-break: lower id wins).
    idx = torch.sort(_group_mask(p, groups, True), dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = p.gather(1, idx)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, idx


def router_invariant(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool,
                     groups: tuple[int, int] | None = None):
    """Fixed 64-row tiles for the GEMM and for softmax/top-k; ties go to the lower expert (and group) id."""
    logits = tile_linear(x, w)                                # [M, E] storage dtype
    weights, idx = per_tile(lambda t: _softmax_topk_tile(t, top_k, norm, groups), logits)   # [M, k] fp32, int64
    return weights.to(x.dtype), idx, logits
