"""The KV-cache store in Triton (CUDA): a call's keys and values copied into the cache in one launch.

A copy, no arithmetic: each element's bytes go unchanged from the rows to the cache, as indexing assignment
(``cache[slots, positions] = rows``) would put them, for any element type (the tensors are viewed as integers of
the element's size). One launch stores both tensors, where indexing takes one per tensor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_rows import INTERPRET, launch, next_pow2, pdl_start

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _kv_store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, s_ptr, p_ptr, S, T, W, BW: tl.constexpr, PDL: tl.constexpr):
    """Row m's W key and W value elements stored at (slots[m], positions[m]) of the caches [S, T, W]; a row whose
    slot or position is out of range is not stored."""
    pdl_start(PDL)
    m = tl.program_id(0).to(tl.int64)
    slot = tl.load(s_ptr + m)
    pos = tl.load(p_ptr + m)
    c = tl.arange(0, BW)
    mask = (c < W) & (slot >= 0) & (slot < S) & (pos >= 0) & (pos < T)
    dst = (slot * T + pos) * W + c
    tl.store(kc_ptr + dst, tl.load(k_ptr + m * W + c, mask=mask), mask=mask)
    tl.store(vc_ptr + dst, tl.load(v_ptr + m * W + c, mask=mask), mask=mask)


def serves(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether kv_store takes these tensors: one CUDA device (the CPU under the interpreter), one element type, caches [S, T, *row] contiguous and
    rows [M, *row] of the caches' row shape."""
    ts = (k_cache, v_cache, k, v)
    same = all(t.device == k_cache.device and t.dtype == k_cache.dtype for t in ts)
    return ((k_cache.is_cuda or INTERPRET) and same and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and k_cache.dim() >= 2 and k.shape == v.shape and k.dim() == k_cache.dim() - 1
            and k.shape[1:] == k_cache.shape[2:] and k_cache.element_size() in _INTS)


def kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache[slots, positions] = k and v_cache[slots, positions] = v in one launch.

    Args:
        k_cache, v_cache: [S, T, ...] contiguous, one dtype, on one CUDA device; k, v: [M, ...] rows of the caches'
            row shape; slots, positions: [M] int64 on that device, 0 <= slots < S, 0 <= positions < T (a row
            outside is not stored: no device read checks them here).
    Raises:
        ValueError: tensors that ``serves`` does not take, or slots/positions not [M] int64.
    """
    if not serves(k_cache, v_cache, k, v):
        raise ValueError(f"kv_store takes contiguous CUDA caches [S, T, ...] and rows [M, ...] of their row shape "
                         f"and dtype; got caches {tuple(k_cache.shape)} {k_cache.dtype} {k_cache.device}, rows "
                         f"{tuple(k.shape)} {k.dtype} {k.device}")
    M = k.shape[0]
    for name, t in (("slots", slots), ("positions", positions)):
        if t.shape != (M,) or t.dtype != torch.int64 or t.device != k.device:
            raise ValueError(f"{name} must be [{M}] int64 on {k.device}, got {tuple(t.shape)} {t.dtype} {t.device}")
    if M == 0:
        return
    S, T = k_cache.shape[:2]
    W = k_cache[0, 0].numel()
    it = _INTS[k_cache.element_size()]
    launch(_kv_store_kernel, (M,), (k.contiguous().view(it), v.contiguous().view(it), k_cache.view(it),
                                    v_cache.view(it), slots.contiguous(), positions.contiguous(), S, T, W),
           dict(BW=next_pow2(W)), num_warps=4)
