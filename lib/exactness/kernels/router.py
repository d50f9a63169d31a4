"""Kernel class ``router``: logits = x @ w_router^T, softmax in fp32, top-k, renormalised weights.

Semantics follow Hugging Face ``Qwen3MoeSparseMoeBlock``: logits in the storage dtype, softmax in fp32, top-k of the
probabilities, optional renormalisation over the k, weights cast back to the storage dtype.

Signature: ``router(x [M, H], w [E, H], top_k, norm) -> (weights [M, k] storage dtype, idx [M, k] int64,
logits [M, E] storage dtype)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dense import tile_linear
from .tiles import per_tile


def router_fast(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool):
    """torch ops on the whole block; ``torch.topk`` decides ties in its own (unspecified) way."""
    logits = F.linear(x, w)                                   # [M, E] storage dtype
    probs = torch.softmax(logits.float(), dim=-1)             # [M, E] fp32
    weights, idx = torch.topk(probs, top_k, dim=-1)           # [M, k]
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), idx, logits


def _softmax_topk_tile(logits: torch.Tensor, top_k: int, norm: bool):
    p = logits.float()                                        # [T, E] fp32
    p = torch.exp(p - p.amax(dim=-1, keepdim=True))
    p = p / p.sum(dim=-1, keepdim=True)
    # Stable descending sort: equal probabilities keep ascending expert order (defined tie-break: lower id wins).
    weights, idx = torch.sort(p, dim=-1, descending=True, stable=True)
    weights, idx = weights[:, :top_k], idx[:, :top_k]
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, idx


def router_invariant(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool):
    """Fixed 64-row tiles for the GEMM and for softmax/top-k; ties go to the lower expert id."""
    logits = tile_linear(x, w)                                # [M, E] storage dtype
    weights = per_tile(lambda t: _softmax_topk_tile(t, top_k, norm)[0], logits)
    idx = per_tile(lambda t: _softmax_topk_tile(t, top_k, norm)[1], logits)
    return weights.to(x.dtype), idx, logits
