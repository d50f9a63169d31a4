"""The invariant set's options that run several kernel calls in fewer launches with the same bytes (CUDA; on other
devices they serve nothing and the engine calls the kernels one by one).

Each option names the kernels whose bytes it gives in ``stands_for`` ((class, kernel) pairs): model.Ops uses it only
for a set whose kernels of those classes are those very callables, so a set that replaces one of them (a planted
fault, a user's kernel) runs its own kernels.

- ``qk_norm_rope(q, k, wq, wk, eps, positions, theta, store=None) -> (q, k) | None``: per-head RMSNorm then RoPE of
  a layer's queries and keys in one launch (triton_fused), for cuda.rmsnorm then cuda.rope; given a store (the
  layer's KV caches, the rows' slots and values) the same launch writes the keys and values to the caches, as the
  engine's cache store (kernels/cache_store.py) would.
- ``residual_norm(a, b, w, eps) -> (x, h) | None``: the residual add and the next RMSNorm of its sum in one launch
  (triton_fused), for cuda.residual then cuda.rmsnorm.
- ``combine_residual_norm(y, weights, shared, a, w, eps) -> (x, h) | None``: the MoE combine of the experts'
  outputs, the residual add and the next RMSNorm in one launch (triton_fused), for cuda.combine, cuda.residual then
  cuda.rmsnorm.
- ``dense_residual_norm(x, w, a, wn, eps) -> (x, h) | None``: a projection, the residual add of its output and the
  next RMSNorm in one launch (triton_dense_norm: the split-K programs of a decode-size call, the norm in each block
  of rows' last tile), for cuda.dense_invariant, cuda.residual then cuda.rmsnorm.
- ``dense_group(x, ws) -> tuple | None``: x @ w^T for several weights of one input, those whose split-K launches
  can share one in one grouped launch (triton_group: a decode step's q, k and v), for cuda.dense_invariant.
"""
from __future__ import annotations

import torch

from . import cuda
from . import rope as _rope


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                 positions: torch.Tensor, theta: float, store: tuple | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rope(rmsnorm(q, wq)), rope(rmsnorm(k, wk))) with cuda.rmsnorm's and cuda.rope's bytes in one launch.

    Args:
        q: [M, Hq, D]; k: [M, Hk, D]; wq, wk: [D]; positions: [M] int64; theta: RoPE base.
        store: None, or (k_cache, v_cache [S, T, Hk, D], slots [M] int64, v [M, Hk, D]): the launch also writes the
            keys it returns and v to the caches at (slots, positions) (triton_fused.qk_norm_rope).
    Returns:
        (q, k) in q's dtype, or None where not served (CPU tensors, or inputs or a store triton_fused refuses):
        then nothing is written.
    """
    if not (q.is_cuda and torch.is_tensor(wq) and torch.is_tensor(wk)):
        return None
    cos, sin = _rope._table(q.shape[-1], theta, 1, q.device, q.dtype)                # [L, D], as cuda.rope
    return cuda._tk("triton_fused").try_qk_norm_rope(q, k, wq, wk, eps, positions, cos, sin, store)


def residual_norm(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a + b, rmsnorm(a + b, w, eps)) with cuda.residual's and cuda.rmsnorm's bytes in one launch.

    Args:
        a, b: [..., H]; w: [H]. Returns: (x, h) of a's shape and dtype, or None where not served (CPU tensors, or
        inputs triton_fused.try_residual_norm refuses).
    """
    if not (a.is_cuda and torch.is_tensor(w)):
        return None
    return cuda._tk("triton_fused").try_residual_norm(a, b, w, eps)


def combine_residual_norm(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None, a: torch.Tensor,
                          w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x, h) = (a + combine(y, weights, shared), rmsnorm(x, w, eps)) with cuda.combine's, cuda.residual's and
    cuda.rmsnorm's bytes in one launch.

    Args:
        y: [M, k, H]; weights: [M, k]; shared: [M, H] or None; a: [M, H]; w: [H]. Returns: (x, h) [M, H] in a's
        dtype, or None where not served (CPU tensors, or inputs triton_fused.try_combine_residual_norm refuses).
    """
    if not (y.is_cuda and torch.is_tensor(w)):
        return None
    return cuda._tk("triton_fused").try_combine_residual_norm(y, weights, shared, a, w, eps)


def dense_residual_norm(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, wn: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a + x @ w^T, rmsnorm(that, wn, eps)) with cuda.dense_invariant's, cuda.residual's and cuda.rmsnorm's bytes
    in one launch.

    Args:
        x: [M, K]; w: [N, K]; a: [M, N]; wn: [N]. Returns: (x, h) [M, N] in a's dtype, or None where not served (CPU
        tensors, a weight that is not a plain tensor, or a call triton_dense_norm's launch does not take).
    """
    if not (x.is_cuda and torch.is_tensor(w) and torch.is_tensor(wn)):
        return None
    return cuda._tk("triton_dense_norm").try_dense_residual_norm(x, w, a, wn, eps)


def dense_group(x: torch.Tensor, ws: tuple) -> tuple[torch.Tensor, ...] | None:
    """(cuda.dense_invariant(x, w) for w in ws), the bytes of each, in fewer launches (triton_group.linear_many).

    Args:
        x: [M, K]; ws: weights [N_i, K] of x's dtype.
    Returns:
        one [M, N_i] per weight, or None where not served (CPU tensors, or a weight that is not a plain tensor).
    """
    if not (x.is_cuda and all(torch.is_tensor(w) for w in ws)):
        return None
    return cuda._tk("triton_group").linear_many(x, tuple(ws))


qk_norm_rope.stands_for = (("rmsnorm", cuda.rmsnorm), ("rope", cuda.rope))
qk_norm_rope.stores_kv = True
dense_group.stands_for = (("dense", cuda.dense_invariant),)
residual_norm.stands_for = (("residual", cuda.residual), ("rmsnorm", cuda.rmsnorm))
combine_residual_norm.stands_for = (("moe_combine", cuda.combine), ("residual", cuda.residual),
                                    ("rmsnorm", cuda.rmsnorm))
dense_residual_norm.stands_for = (("dense", cuda.dense_invariant), ("residual", cuda.residual),
                                  ("rmsnorm", cuda.rmsnorm))
