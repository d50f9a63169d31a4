"""Batch-invariant Triton GEMMs for CUDA: ``linear`` (y = x @ w^T) and the fused expert ``gate_up``.

Invariance device: a row's arithmetic is fixed per weight shape. The shape's config (from (N, K), the dtype and the
GPU architecture, never from M) fixes BLOCK_K and split_k: each output tile's K chunks are accumulated in ascending
order in fp32, either in one run or, where split_k > 1, in split_k fixed runs whose partials (each from zero) are
added in run order -- by parallel programs for small M (triton_split: each tile's last run to finish adds them),
by one program in turn for large M: the same operations, hence the same bytes. ``M`` is marked
``do_not_specialize``, so one binary serves M = 1 and M = 16384 alike. A row's bytes therefore depend only on the
row and the weights: a decode call (M = 1) reproduces the row of a prompt call (M rows) bit for bit.

Tile placement may depend on M: which program computes which tile, the persistent grid, and on sm_90 the tile's
rows and columns, warps and pipeline stages (PLACEMENTS: small-M bf16 calls take smaller tiles). A placement
carries no BLOCK_K or split_k of its own (it overrides only PLACEMENT_FIELDS of the shape's config). That it changes
no byte is a property of the GPU's MMA, measured on sm_90 (``tl.dot`` gave each output element the same bytes from
16-row ``mma.sync`` tiles as from 64- and 128-row ``wgmma`` tiles), not a guarantee: every entry must pass the GPU
test tests/test_cuda_kernels.py runs on its architecture (each placement gives every row the shape config's bytes).

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

from dataclasses import dataclass, replace

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import triton_split
from .triton_rows import INTERPRET, _spec, capability, cdiv, intern_key, launch
from .triton_tiles import _gemm_kernel, _gemm_persistent_kernel, _gemm_split_kernel

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


SPLIT_LOOPS = ("runs", "fold", "flat")   # GemmConfig.split_loop; the index is the kernels' SPLIT_LOOP


@dataclass(frozen=True)
class GemmConfig:
    """One tile configuration: a weight shape's config (chosen per shape and architecture, never per M), or one of
    its placements (the same BLOCK_K and split_k; PLACEMENTS).

    Attributes:
        block_m, block_n, block_k: tile sizes (rows of x, rows of w, reduction step); powers of two >= 16.
        num_stages: software-pipelining depth; num_warps: warps per program.
        persistent: one program per SM looping over tiles (True) or one program per tile (False).
        group_m: tiles of this many M-blocks are walked N-first (L2 reuse; no effect on any tile's bytes).
        tma: load through TMA tensor descriptors (sm_90+ only).
        warp_specialize: ask Triton to warp-specialize the persistent loop (experimental on Hopper).
        split_k: K is cut into this many runs of whole BLOCK_K chunks; each run's partial is accumulated from zero
            and the partials are added in run order in fp32 (no atomic adds), whether the runs go to parallel programs
            (small M: more programs than tiles) or one program does them in turn (large M: no partial buffer).
            Part of the shape's fixed config, so decode and prompt rows share it.
        split_loop: how one program does its runs in turn (the same operations in the same order, so the same
            bytes): ``"runs"`` one K loop per run; ``"fold"`` one K loop over every chunk, the running partial
            added to the total at each run's last chunk (one software pipeline across the runs); ``"flat"`` the run
            loop and its K loops flattened into one by Triton (``tl.range(flatten=True)``).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    num_warps: int = 8
    persistent: bool = False
    group_m: int = 8
    tma: bool = True
    warp_specialize: bool = False
    split_k: int = 1
    split_loop: str = "runs"

    def __post_init__(self) -> None:
        if not isinstance(self.split_k, int) or self.split_k < 1:
            raise ValueError(f"split_k must be an int >= 1, got {self.split_k!r}")
        if self.split_loop not in SPLIT_LOOPS:
            raise ValueError(f"split_loop must be one of {', '.join(SPLIT_LOOPS)}; got {self.split_loop!r}")

    def label(self) -> str:
        """Short id such as ``128x128x64 s4 w8 P tma``."""
        flags = ("P" if self.persistent else "NP") + (" tma" if self.tma else " ptr")
        flags += " ws" if self.warp_specialize else ""
        if self.split_k > 1:
            flags += f" k/{self.split_k}" + (f" {self.split_loop}" if self.split_loop != "runs" else "")
        return f"{self.block_m}x{self.block_n}x{self.block_k} s{self.num_stages} w{self.num_warps} {flags}"

    def smem_bytes(self, elem: int, gate_up: bool = False) -> int:
        """Shared memory of the pipelined operand buffers (bytes; Triton adds a little for barriers/epilogue)."""
        per_stage = (self.block_m + self.block_n * (2 if gate_up else 1)) * self.block_k * elem
        return per_stage * self.num_stages


# Per (kind, N, K, dtype, arch) tile configs. Keys never contain M (that would break invariance). "sm90" = H100/
# H200, "sm120" = RTX 50xx class (99 KB shared memory per block, mma.sync), "other" = everything else (pointer
# loads, no TMA). Entries for the `small` preset's shapes were chosen on an H200 by benchmarks/bench_gpu_kernels.py.
_LINEAR_DEFAULTS: dict[tuple[str, str], GemmConfig] = {
    ("16bit", "sm90"): GemmConfig(128, 128, 64, 4, 8, persistent=True),
    ("16bit", "sm120"): GemmConfig(128, 128, 32, 3, 8),
    ("16bit", "other"): GemmConfig(128, 128, 32, 3, 8, tma=False),
    ("fp32", "sm90"): GemmConfig(64, 64, 32, 3, 4),
    ("fp32", "sm120"): GemmConfig(64, 64, 32, 2, 4),
    ("fp32", "other"): GemmConfig(64, 64, 32, 2, 4, tma=False),
    # CPU interpreter (tests): small tiles keep the interpreted programs cheap.
    ("16bit", "interp"): GemmConfig(32, 32, 16, 1, 4),
    ("fp32", "interp"): GemmConfig(32, 32, 16, 1, 4),
}
# The fused gate/up kernel loads two B tiles per stage: on the GPUs it takes the linear tile with half the block_n,
# the same shared memory (GemmConfig.smem_bytes); the interpreter's tiles are small already.
_DEFAULTS: dict[tuple[str, str, str], GemmConfig] = {
    **{("linear", *k): c for k, c in _LINEAR_DEFAULTS.items()},
    **{("gate_up", *k): c if k[1] == "interp" else replace(c, block_n=c.block_n // 2)
       for k, c in _LINEAR_DEFAULTS.items()},
}
# Chosen on an H200: the tiles by benchmarks/bench_gpu_kernels.py --tune (per shape, the candidate with the best
# GEMM/cuBLAS ratio at M = 4096 and 16384; its candidates have no split), split_k per shape by the decode-step time
# (bench_gpu_kernels.py --sections decode_step), and q, k/v and o's split_loop, program layout and q's stages by
# GPU time / cuBLAS at M = 1 to 16384 (benchmarks/bench_split_k.py --part configs). The split makes a decode row (one
# tile per BLOCK_N columns, a few programs for 132 SMs) run split_k times as many programs; it is part of
# the shape's config, so prompt rows use the same split (one program per tile running the runs in turn: q, k/v and
# o fold them into one K loop, one software pipeline across the runs), and the fused gate/up's tile by the decode
# step and the one-chunk prefill (benchmarks/bench_gpu_goals.py). Small calls take the shape's PLACEMENTS below
# instead of these tiles. The ratios this table reaches, with the commands that measure them, are in
# docs/figures.md.
SHAPE_CONFIGS: dict[tuple[str, int, int, str, str], GemmConfig] = {
    ("linear", 4096, 2048, "16bit", "sm90"): GemmConfig(128, 128, 64, 5, 8, split_k=4, split_loop="fold"),  # q
    ("linear", 512, 2048, "16bit", "sm90"): GemmConfig(128, 128, 64, 4, 8, split_k=8, split_loop="fold"),   # k, v
    ("linear", 2048, 4096, "16bit", "sm90"): GemmConfig(128, 128, 64, 4, 8, split_k=8, split_loop="fold"),  # o
    ("linear", 768, 2048, "16bit", "sm90"): GemmConfig(128, 256, 64, 3, 8, persistent=True),    # gate|up alone
    ("linear", 2048, 768, "16bit", "sm90"): GemmConfig(128, 256, 64, 3, 8, persistent=True),    # down
    ("linear", 128, 2048, "16bit", "sm90"): GemmConfig(128, 128, 64, 4, 8, split_k=8),                   # router
    ("linear", 258, 2048, "16bit", "sm90"): GemmConfig(128, 64, 64, 4, 4, split_k=4),                    # lm_head
    ("gate_up", 768, 2048, "16bit", "sm90"): GemmConfig(128, 64, 64, 4, 8),                     # fused gate/up
}


# What a placement may change: how a tile is laid out and run, never BLOCK_K or split_k (the row's arithmetic).
PLACEMENT_FIELDS = ("block_m", "block_n", "num_warps", "num_stages", "persistent", "group_m", "warp_specialize")
_SMALL = dict(num_warps=4, num_stages=4, persistent=False)
# Per (kind, N, K, "bf16", arch): (rows, overrides) in ascending rows; a call of at most ``rows`` rows takes the
# shape's config with those fields replaced, a larger call the config itself. The shape's config has 128-row tiles
# for prompts; a small call in them does a 128-row tile's MMA work on few programs. Chosen on an H200 by GPU time at
# M = 1 to 512 (benchmarks/bench_split_k.py --part placements, which also compares every candidate's bytes with the
# config's; docs/figures.md has the figures); the router's and lm_head's 16-row entries by a decode step's GPU time.
PLACEMENTS: dict[tuple[str, int, int, str, str], tuple[tuple[int, dict], ...]] = {
    ("linear", 4096, 2048, "bf16", "sm90"): ((16, dict(_SMALL, block_m=16)), (512, dict(_SMALL, block_m=64))),
    ("linear", 512, 2048, "bf16", "sm90"): ((16, dict(_SMALL, block_m=16, block_n=64)),
                                           (512, dict(_SMALL, block_m=64, block_n=64))),
    ("linear", 2048, 4096, "bf16", "sm90"): ((16, dict(_SMALL, block_m=16)), (512, dict(_SMALL, block_m=64))),
    ("linear", 768, 2048, "bf16", "sm90"): ((512, dict(_SMALL, block_m=64, block_n=64)),),
    ("linear", 2048, 768, "bf16", "sm90"): ((512, dict(_SMALL, block_m=64, block_n=64)),),
    ("linear", 128, 2048, "bf16", "sm90"): ((16, dict(_SMALL, block_m=16, block_n=128)),    # one tile: triton_router
                                           (512, dict(_SMALL, block_m=64, block_n=64))),
    ("linear", 258, 2048, "bf16", "sm90"): ((16, dict(_SMALL, block_m=16)), (256, dict(_SMALL, block_m=64))),
    ("gate_up", 768, 2048, "bf16", "sm90"): ((512, dict(_SMALL, block_m=64, block_n=32)),),
}


def _pkey(dtype: torch.dtype) -> str | None:
    """The dtype key of the placement tables: bf16 only (the dtype their bytes were measured in)."""
    return "bf16" if dtype == torch.bfloat16 else None


def check_placement(where: str, rows: list, overrides: list[dict], fields: tuple = PLACEMENT_FIELDS) -> None:
    """Raise ValueError (naming ``where``, a table entry) unless ``rows`` ascend as positive ints and every override
    dict changes only ``fields`` (the rest fix a row's arithmetic). Shared by this module's, triton_moe's and
    triton_attention's placement tables."""
    if rows != sorted(set(rows)) or any(not isinstance(r, int) or r < 1 for r in rows):
        raise ValueError(f"{where}: rows must be ascending positive ints, got {rows}")
    bad = sorted(set().union(*overrides) - set(fields))
    if bad:
        raise ValueError(f"{where} overrides {bad}: a placement may change only {', '.join(fields)} "
                         "(the other fields fix a row's arithmetic)")


def _check_placements(table: dict) -> None:
    """Raise ValueError for an entry that overrides a field outside PLACEMENT_FIELDS or whose rows do not ascend."""
    for key, entries in table.items():
        check_placement(f"PLACEMENTS[{key}]", [r for r, _ in entries], [over for _, over in entries])


_check_placements(PLACEMENTS)


def placements(kind: str, N: int, K: int, dtype: torch.dtype, capability: tuple[int, int]
               ) -> tuple[tuple[int, GemmConfig], ...]:
    """(rows, config) per placement of a weight shape, rows ascending: the shape's config (config_for) with the
    placement's fields replaced; then (inf, the shape's config) for larger calls."""
    base = config_for(kind, N, K, dtype, capability)
    entries = PLACEMENTS.get((kind, N, K, _pkey(dtype), arch_of(capability)), ())
    return tuple((r, replace(base, **over)) for r, over in entries) + ((float("inf"), base),)


def arch_of(capability: tuple[int, int]) -> str:
    """``"sm90"`` for compute capability 9.x, ``"sm120"`` for 12.x, ``"interp"`` for (0, 0) (the CPU
    interpreter), else ``"other"``."""
    if capability == (0, 0):
        return "interp"
    return {9: "sm90", 12: "sm120"}.get(capability[0], "other")


def _dkey(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16bit"


def config_for(kind: str, N: int, K: int, dtype: torch.dtype, capability: tuple[int, int]) -> GemmConfig:
    """The fixed config of a weight shape: SHAPE_CONFIGS entry if any, else the (kind, dtype, arch) default.

    Args:
        kind: ``"linear"`` or ``"gate_up"``; N, K: weight rows and columns; capability: (major, minor).
    Raises:
        ValueError: unknown kind.
    """
    if kind not in ("linear", "gate_up"):
        raise ValueError(f"GEMM kind must be 'linear' or 'gate_up', got {kind!r}")
    arch, dk = arch_of(capability), _dkey(dtype)
    return SHAPE_CONFIGS.get((kind, N, K, dk, arch)) or _DEFAULTS[(kind, dk, arch)]


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


def with_config(kind: str, N: int, K: int, dtype: torch.dtype, arch: str, cfg: GemmConfig) -> None:
    """Pin ``cfg`` as one weight shape's config (what the tuned table below does); the key has no M by construction.
    Its placements (PLACEMENTS) still replace their fields for small calls. Plans made before keep the old config."""
    if arch not in ("sm90", "sm120", "other", "interp"):
        raise ValueError(f"arch must be 'sm90', 'sm120', 'other' or 'interp', got {arch!r}")
    SHAPE_CONFIGS[(kind, N, K, _dkey(dtype), arch)] = replace(cfg)
