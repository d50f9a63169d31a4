"""Batch-invariant Triton GEMMs for CUDA: ``linear`` (y = x @ w^T) and the fused expert ``gate_up``.

Invariance device: a row's arithmetic is fixed per weight shape. The shape's config (from (N, K), the dtype and the
GPU architecture, never from M) fixes BLOCK_K and split_k: each output tile's K chunks are accumulated in ascending
order in fp32, either in one run or, where split_k > 1, in split_k fixed runs whose partials (each from zero) are
added in run order -- by parallel programs for small M (triton_split: each tile's last run to finish adds them),
by one program in turn for large M: the same operations, hence the same bytes. ``M`` is marked
``do_not_specialize``, so one binary serves M = 1 and M = 16384 alike. A row's bytes therefore depend only on the
row and the weights: a decode call (M = 1) reproduces the row of a prompt call (M rows) bit for bit.

Tile placement may depend on M (gemm_configs.PLACEMENTS: which program computes which tile, and on sm_90 the tile's
rows and columns, warps and stages), never a row's arithmetic; the configs, placements and their lookup are in
gemm_configs.py.

Semantics (same as the CPU kernels dense.tile_linear / experts.gate_up_invariant): storage-dtype inputs, fp32
accumulation (tensor cores for bf16/fp16; ``input_precision="ieee"`` FMA for fp32, so no tf32 rounding), the
result rounded once to the storage dtype. ``gate_up`` rounds both GEMM results to the storage dtype, computes
SiLU(g) = g / (1 + exp(-g)) in fp32 (PyTorch's CUDA silu formula; Triton's exp, an ex2-based
approximation, and IEEE division), rounds it, multiplies by u in fp32 and rounds
again, exactly the rounding points of ``F.silu(g) * u`` on storage-dtype tensors.

Loads use TMA tensor descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``) on sm_90+ and plain masked
pointer loads elsewhere; stores are masked pointer stores (any N).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import triton_split
# the configs' names under this module too, for the benchmarks and tests that tune and read them through it
from .gemm_configs import (DTYPES, PLACEMENT_FIELDS, PLACEMENTS, SHAPE_CONFIGS, SPLIT_LOOPS,  # noqa: F401
                           GemmConfig, arch_of, check_placement, config_for, placements, with_config)
from .triton_rows import INTERPRET, _spec, capability, cdiv, intern_key, launch
from .triton_tiles import _gemm_kernel, _gemm_persistent_kernel, _gemm_split_kernel

_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """TMA descriptor of a contiguous, 16-byte-aligned 2-D tensor whose row size is a multiple of 16 bytes.

    Built without TensorDescriptor's per-field validation (callers guarantee the conditions above, which are the
    ones it checks): it is built once per call for the activation operand, so its host cost counts per launch.
    """
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(base=t, shape=list(t.shape), strides=[t.shape[1], 1], block_shape=block, padding="zero")
    return d


def _check(x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> None:
    if x.dim() != 2 or any(w.dim() != 2 for w in ws):
        raise ValueError(f"expected x [M, K] and weights [N, K]; got x {tuple(x.shape)}, "
                         f"weights {[tuple(w.shape) for w in ws]}")
    if x.dtype not in DTYPES or any(w.dtype != x.dtype for w in ws):
        raise ValueError(f"x and weights must share one dtype of {DTYPES}; got x {x.dtype}, "
                         f"weights {[w.dtype for w in ws]}")
    if any(w.shape[1] != x.shape[1] for w in ws) or any(w.shape != ws[0].shape for w in ws):
        raise ValueError(f"inner dims differ: x {tuple(x.shape)}, weights {[tuple(w.shape) for w in ws]}")
    if any(w.device != x.device for w in ws):
        raise ValueError(f"x on {x.device} but weights on {[str(w.device) for w in ws]}")


@dataclass
class _Launch:
    """Everything about one placement's launch that depends on the weights and the config only, not on x or M."""

    cfg: GemmConfig
    use_tma: bool
    kernel: object
    b: object
    b2: object | None
    consts: dict
    opts: dict
    key: int
    sms: int
    split_consts: dict
    split_key: int


@dataclass
class _Plan:
    """A weight shape's launches: (rows, _Launch) per placement, rows ascending, the last for any row count."""

    N: int
    K: int
    launches: tuple
    weights: tuple


_PLANS: dict[tuple, _Plan] = {}


def _make_launch(x: torch.Tensor, ws: tuple[torch.Tensor, ...], kind: str, cfg: GemmConfig) -> _Launch:
    N, K = ws[0].shape
    use_tma = cfg.tma and _tma_fits(x, K)
    bs = [descriptor(w, [cfg.block_n, cfg.block_k]) for w in ws] if use_tma else list(ws)
    consts = dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, GATE_UP=kind == "gate_up",
                  TMA=use_tma, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", EMULATE=INTERPRET,
                  SPLIT=cfg.split_k, SPLIT_LOOP=SPLIT_LOOPS.index(cfg.split_loop))
    split_consts = {k: v for k, v in consts.items() if k not in ("GATE_UP", "SPLIT_LOOP")}
    sms = (_num_sms(x.device) if x.device.type == "cuda" else 4) if cfg.persistent else 0
    kernel = _gemm_persistent_kernel if cfg.persistent else _gemm_kernel
    if cfg.persistent:
        consts |= dict(NUM_SMS=sms, WS=cfg.warp_specialize)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    key = intern_key((kernel, tuple(consts.items()), tuple(opts.items()), x.dtype, N, K,
                      tuple(_spec(b) for b in bs), x.device))
    split_key = intern_key((_gemm_split_kernel, tuple(split_consts.items()), tuple(opts.items()), x.dtype, N, K,
                            _spec(bs[0]), x.device))
    return _Launch(cfg, use_tma, kernel, bs[0], bs[1] if kind == "gate_up" else None, consts, opts, key, sms,
                   split_consts, split_key)


def _tma_fits(x: torch.Tensor, K: int) -> bool:
    """Whether TMA loads serve x's device (sm_90+, or the interpreter) for rows of K elements (16-byte rows)."""
    return (x.device.type != "cuda" or capability(x.device)[0] >= 9) and (K * x.element_size()) % 16 == 0


def _make_plan(x: torch.Tensor, ws: tuple[torch.Tensor, ...], kind: str, config: GemmConfig | None) -> _Plan:
    _check(x, ws)
    ws = tuple(w.contiguous() for w in ws)
    N, K = ws[0].shape
    placed = ((float("inf"), config),) if config else placements(kind, N, K, x.dtype, capability(x.device))
    if any(c.tma for _, c in placed) and _tma_fits(x, K):
        ws = tuple(w if w.data_ptr() % 16 == 0 else w.clone() for w in ws)   # TMA needs a 16-byte-aligned base
    return _Plan(N, K, tuple((r, _make_launch(x, ws, kind, c)) for r, c in placed), ws)


def plan_for(x: torch.Tensor, ws: tuple[torch.Tensor, ...], kind: str, config: GemmConfig | None) -> _Plan:
    """The launches of these weights for calls like x (kept per weight pointer, shape and layout; ValueError from
    _check for shapes, dtypes or devices that do not match)."""
    pk = (kind, config, x.dtype, x.device, x.dim(), x.shape[-1]) + tuple(
        (w.data_ptr(), w.shape, w.stride(), w.dtype, w.device) for w in ws)
    p = _PLANS.get(pk)
    if p is None:
        p = _make_plan(x, ws, kind, config)
        if all(w.is_contiguous() for w in ws):      # a copied weight must not be kept (its source may change)
            if len(_PLANS) > 8192:
                _PLANS.clear()
            _PLANS[pk] = p
    return p


def a_operand(x: torch.Tensor, lp: _Launch) -> tuple:
    """(x as this launch loads it: a TMA descriptor of x, or of a 16-byte-aligned copy, or x itself; whether that
    base is 16-byte aligned). x: [M, K] contiguous."""
    if lp.use_tma:
        x = x if x.data_ptr() % 16 == 0 else x.clone()
        return descriptor(x, [lp.cfg.block_m, lp.cfg.block_k]), True
    return x, x.data_ptr() % 16 == 0


def split_call(x: torch.Tensor, w: torch.Tensor, fits, config: GemmConfig | None = None,
               row_counts: bool = False) -> tuple | None:
    """The parts of x [M, K] @ w [N, K]^T as one launch of triton_split's programs whose last ones do more
    (triton_router, triton_dense_norm): (launch, x as it loads it, whether that base is aligned, partials
    [split_k, M, N] fp32, counts, output tiles), the counts holding one per tile and, with ``row_counts``, one per
    block of rows after them. None where the call is empty, runs no split programs, ``fits(cfg)`` refuses its
    placement's config or no counts serve. ValueError from _check for shapes, dtypes or devices that do not match."""
    p = plan_for(x, (w,), "linear", config)
    M = x.shape[0]
    if M == 0 or p.K == 0:
        return None
    lp = next(lp for rows, lp in p.launches if M <= rows)
    row_blocks = cdiv(M, lp.cfg.block_m)
    tiles = row_blocks * cdiv(p.N, lp.cfg.block_n)
    if not (triton_split.takes_split(lp, M, p.N) and fits(lp.cfg)):
        return None
    counts = triton_split.split_counts(x.device, tiles + (row_blocks if row_counts else 0))
    if counts is None:
        return None
    a, aligned = a_operand(x if x.is_contiguous() else x.contiguous(), lp)
    return lp, a, aligned, torch.empty(lp.cfg.split_k, M, p.N, dtype=torch.float32, device=x.device), counts, tiles


def _run(x: torch.Tensor, ws: tuple[torch.Tensor, ...], kind: str, config: GemmConfig | None,
         wide: bool = False) -> torch.Tensor:
    p = plan_for(x, ws, kind, config)
    if not x.is_contiguous():
        x = x.contiguous()
    M = x.shape[0]
    lp = next(lp for rows, lp in p.launches if M <= rows)
    split = M > 0 and p.N > 0 and p.K > 0 and triton_split.takes_split(lp, M, p.N)
    code = triton_split.WIDE.get(x.dtype, 0) if wide and split else 0
    out = torch.empty(M, p.N, dtype=torch.float32 if code else x.dtype, device=x.device)   # [M, N]
    if M == 0 or p.N == 0:
        return out
    if p.K == 0:                                    # an empty sum: no kernel needed (nor defined for split runs)
        return out.zero_()
    a, aligned = a_operand(x, lp)
    key = lp.key if lp.use_tma else (lp.key, aligned)
    if split:
        triton_split.run_split(lp, a, out, M, p.N, p.K, key, code)
        return out
    tiles = cdiv(M, lp.cfg.block_m) * cdiv(p.N, lp.cfg.block_n)
    args = (a, lp.b, lp.b2 if lp.b2 is not None else out, out, M, p.N, p.K, p.K, p.K, p.N)   # contiguous strides
    grid = (min(lp.sms, tiles),) if lp.cfg.persistent else (tiles,)
    launch(lp.kernel, grid, args, lp.consts, key=key, **lp.opts)
    return out


def linear(x: torch.Tensor, w: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """y = x @ w^T, batch-invariant (see the module docstring).

    Args:
        x: [M, K] bf16/fp16/fp32 on a CUDA device (or CPU under TRITON_INTERPRET=1).
        w: [N, K] same dtype and device.
        config: run this config as given, without placements (benchmarks and tests; a config must not depend
            on M).
    Returns:
        [M, N] in x's dtype: fp32 accumulation over K in ascending BLOCK_K chunks, rounded once.
    Raises:
        ValueError: shapes, dtypes or devices that do not match.
    """
    return _run(x, (w,), "linear", config)


def logits(x: torch.Tensor, w: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """linear(x, w, config).float(): the lm_head's logits [M, N] fp32, the storage-dtype result widened; a 16-bit
    call that runs its splits in parallel programs stores them widened in its own launch (no launch for the copy).

    Args and errors as linear."""
    return _run(x, (w,), "linear", config, wide=True).float()


def gate_up(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
            config: GemmConfig | None = None) -> torch.Tensor:
    """SiLU(x @ w_gate^T) * (x @ w_up^T) in one kernel, batch-invariant, rounding points as experts.gate_up_invariant.

    Args:
        x: [M, H]; w_gate, w_up: [I, H]; one dtype (bf16/fp16/fp32), one device.
        config: run this config as given, without placements (benchmarks and tests).
    Returns:
        [M, I] in x's dtype.
    Raises:
        ValueError: shapes, dtypes or devices that do not match.
    """
    return _run(x, (w_gate, w_up), "gate_up", config)
