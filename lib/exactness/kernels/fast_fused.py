"""The fast set's elementwise classes on CUDA: the same torch code compiled by torch.compile (Inductor), as an
engine built on stock PyTorch runs its glue between library GEMMs (fused Triton kernels instead of one launch per
torch op; a CUDA graph holds them).

    rmsnorm, rope, router, moe_combine   each call one compiled graph (the router's GEMM stays cuBLAS, top-k aten's)
    expert_gate_up                       one expert's GEMMs (cuBLAS) and SiLU * up as the grouped experts' route
                                         computes it, so an expert run alone (offloaded, one by one) gives the
                                         grouped GEMMs' bytes where cuBLAS and the grouped GEMM agree
    residual_norm, combine_residual_norm, dense_residual_norm, qk_norm_rope
                                         the fast set's options: a residual add with the next norm (after the
                                         MoE combine, or after the output projection), and a layer's q/k norms
                                         with their RoPE, each one compiled graph

Inductor computes a fused chain of bf16 ops in fp32 and rounds where a value is stored, so these rows are not
the eager ops' bytes (the fast set claims none). Graphs are compiled with the row count dynamic and the other sizes
static (a row count of 1 gets its own), once per process and signature of the arguments. Where a tensor is not on
CUDA or has no rows the eager torch code runs (CPU rows stay plain torch's); where compiling fails the first time,
the eager code serves every later call and ``fast_cuda.STATUS["inductor"]`` says why (fast_cuda.run_compiled).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import dense as _dense
from . import experts as _experts
from . import fast_cuda
from . import norm as _norm
from . import rope as _rope
from . import router as _router

_run, _here = fast_cuda.run_compiled, fast_cuda.compiles


# ---------------------------------------------------------------------------------------------- classes

def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """norm.rmsnorm_fast's torch ops; x [..., H], w [H] -> x's shape and dtype."""
    return _run(_norm._rms, x, w, eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """rope.rope_fast's torch ops (cos/sin evaluated for these positions); x [M, h, D] -> x's shape."""
    return _run(_rope.rope_fast, x, positions, theta, rows=(0, 1))


def router(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool, groups: tuple[int, int] | None = None):
    """router.router_fast's torch ops -> (weights [M, k], idx [M, k] int64, logits [M, E])."""
    return _run(_router.router_fast, x, w, top_k, norm, groups)


def gate_up(x: torch.Tensor, w_gate, w_up) -> torch.Tensor:
    """experts.gate_up_fast's torch ops; x [M, H], w_gate, w_up [I, H] -> [M, I]. CPU, quantized weights: eagerly."""
    out = _option(_experts.gate_up_fast, (x, w_gate, w_up), (w_gate, w_up))
    return _experts.gate_up_fast(x, w_gate, w_up) if out is None else out


def combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """experts.combine_fast's torch ops; y [M, k, H], weights [M, k] -> [M, H]."""
    return _run(_experts.combine_fast, y, weights, shared, rows=(0, 1, 2))


# ---------------------------------------------------------------------------------------------- options

def _residual_norm(a, b, w, eps):
    x = _norm.residual_add(a, b)
    return x, _norm._rms(x, w, eps)


def _combine_residual_norm(y, weights, shared, a, w, eps):
    return _residual_norm(a, _experts.combine_fast(y, weights, shared), w, eps)


def _dense_residual_norm(x, w, a, wn, eps):
    return _residual_norm(a, F.linear(x, w), wn, eps)


def _qk_norm_rope(q, k, wq, wk, eps, positions, theta):
    return (_rope.rope_fast(_norm._rms(q, wq, eps), positions, theta),
            _rope.rope_fast(_norm._rms(k, wk, eps), positions, theta))


def _option(fn, args: tuple, weights: tuple):
    """fn(*args) compiled where args[0] is on CUDA and every weight is a plain tensor (not a quantized one); else
    None: the engine then calls the set's kernels one by one. Every tensor argument but the weights has the row
    count as its dim 0."""
    if not (_here(args[0]) and all(type(t) is torch.Tensor for t in weights)):
        return None
    rows = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not any(a is w for w in weights))
    return _run(fn, *args, rows=rows)


def residual_norm(a: torch.Tensor, b: torch.Tensor, w, eps: float):
    """(a + b, rmsnorm(a + b, w, eps)) in one compiled graph; a, b [..., H]. None on the CPU (the engine then calls
    the set's residual and rmsnorm)."""
    return _option(_residual_norm, (a, b, w, eps), (w,))


def combine_residual_norm(y: torch.Tensor, weights: torch.Tensor, shared, a: torch.Tensor, w, eps: float):
    """(x, h) = (a + combine(y, weights, shared), rmsnorm(x, w, eps)) in one compiled graph; y [M, k, H]. None on
    the CPU."""
    return _option(_combine_residual_norm, (y, weights, shared, a, w, eps), (w,))


def dense_residual_norm(x: torch.Tensor, w, a: torch.Tensor, wn, eps: float):
    """(a + x @ w^T, its rmsnorm by wn) in one compiled graph (the GEMM cuBLAS's); x [M, K], w [N, K]. None on the
    CPU or for a weight that is not a plain tensor (a quantized one)."""
    return _option(_dense_residual_norm, (x, w, a, wn, eps), (w, wn))


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, wq, wk, eps: float, positions: torch.Tensor, theta: float):
    """(rope(rmsnorm(q, wq)), rope(rmsnorm(k, wk))) in one compiled graph; q [M, Hq, D], k [M, Hk, D]. None on
    the CPU. Stores nothing: the engine writes the cache."""
    return _option(_qk_norm_rope, (q, k, wq, wk, eps, positions, theta), (wq, wk))


residual_norm.stands_for = (("residual", _norm.residual_add), ("rmsnorm", rmsnorm))
combine_residual_norm.stands_for = (("moe_combine", combine), ("residual", _norm.residual_add),
                                    ("rmsnorm", rmsnorm))
dense_residual_norm.stands_for = (("dense", _dense.linear_fast), ("residual", _norm.residual_add),
                                  ("rmsnorm", rmsnorm))
qk_norm_rope.stands_for = (("rmsnorm", rmsnorm), ("rope", rope))
