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


def serves(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
           k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a launch stores these (store's args): one CUDA device (the CPU under the interpreter), one element
    type, contiguous caches [S, T, *row], rows [M, *row] of the caches' row shape, slots and positions [M] int64."""
    M = k.shape[0] if k.dim() else -1
    same = all(t.device == k_cache.device and t.dtype == k_cache.dtype for t in (v_cache, k, v))
    return ((k_cache.is_cuda or INTERPRET) and same and k_cache.dim() >= 2 and k_cache.shape == v_cache.shape
            and k.shape == v.shape and k.shape[1:] == k_cache.shape[2:] and k_cache.element_size() in _INTS
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and all(t.shape == (M,) and t.dtype == torch.int64 and t.device == k.device for t in (slots, positions)))


def store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
          k: torch.Tensor, v: torch.Tensor) -> bool:
    """k_cache[slots, positions] = k and v_cache[slots, positions] = v in one launch, where served (serves). True if
    stored, False if not served. A row whose slot or position is outside the cache is not stored: no device read
    checks them here (model.forward and the graph runs check them first)."""
    M = k.shape[0] if k.dim() else -1
    if not serves(k_cache, v_cache, slots, positions, k, v):
        return False
    if M:
        S, T = k_cache.shape[:2]
        W = k_cache[0, 0].numel()
        it = _INTS[k_cache.element_size()]
        launch(_kv_store_kernel, (M,), (k.contiguous().view(it), v.contiguous().view(it), k_cache.view(it),
                                        v_cache.view(it), slots.contiguous(), positions.contiguous(), S, T, W),
               dict(BW=next_pow2(W)), num_warps=4)
    return True


def kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """``store``, for tensors it must serve.

    Raises:
        ValueError: tensors ``store`` does not serve (each one's shape, dtype and device named).
    """
    if not store(k_cache, v_cache, slots, positions, k, v):
        named = (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("slots", slots),
                 ("positions", positions))
        raise ValueError("kv_store takes contiguous caches [S, T, ...] on one CUDA device, rows [M, ...] of their row "
                         "shape and dtype, and slots and positions [M] int64; got "
                         + ", ".join(f"{n} {tuple(t.shape)} {t.dtype} {t.device}" for n, t in named))
