"""Batch-invariant causal GQA attention over the KV cache in Triton (CUDA), one kernel for decode and prompt rows.

Signature as attention.attention_invariant: ``attention(q [M, Hq, D], k_cache [S, T, Hkv, D], v_cache, slots [M],
positions [M]) -> o [M, Hq, D]`` in the storage dtype; row m attends to keys 0..positions[m] of slot slots[m].

Invariance device: rows are grouped by slot into tiles of BLOCK_M rows (on the device, over a bound on the tile
count, so no call reads the slots on the host; a single-slot cache needs no grouping, and a call with no more rows
than the cache has slots, a decode step of concurrent streams, runs one row per tile with its slot read by the
kernel, a launch fixed by the row count that a CUDA graph records). Keys are cut into fixed chunks of CHUNK keys from
key 0, and each chunk into BLOCK_N-key blocks. A row's chunk state (m, l, acc) is computed from a fresh start over
the chunk's blocks in ascending order with the online softmax (Milakov & Gimelshein 2018, arXiv 1805.02867) in fp32,
in base 2 as FlashAttention-2 computes it: s = (q k^T) * (log2(e)/sqrt(D)) in one multiply by that constant rounded
once to fp32 (Vaswani et al. 2017's scale), so exp2(s - m) = e^((q k^T)/sqrt(D) - m ln 2), keys after the row's
position masked to -inf, m/l/acc rescaled per block with exp2; the chunk states are then merged in ascending chunk
order by the two-state combine (m = max(m1, m2), l = l1 2^(m1-m) + l2 2^(m2-m), acc likewise), and o = acc / l is
rounded once. Prompt calls run one program per (query head, tile), last tile first, that merges each chunk as it
ends; decode-sized calls run one program per (tile, KV head, chunk), the KV head's G query heads packed into the
tile's lanes beside its rows (split-KV: a 4,096-key decode row becomes 8 parallel programs instead of one serial one,
each reading its keys once for G heads) and a combine kernel that merges the stored fp32 states with the same
operations in the same order. In a block holding none of a row's keys (one a tile visits only for its later rows) the
row keeps m and l (as the CPU kernel's ``active`` mask), its rescale factor is exactly 1 and all its probabilities
are exactly 0, so its state's bytes stay unchanged; a chunk holding none of a row's keys is not merged. A block every
row of the tile sees whole runs without the masks, whose selections would leave every value as it is there, so a row
gets the same bytes whether a call masks its block (a prompt tile's diagonal) or not (a decode row). The tile config
and chunk size are fixed per (D, dtype, arch) (a split call of few rows may run its programs in other lanes and
warps, SPLIT_PLACEMENTS: the same bytes, as no sum over keys crosses a warp; Precision), the row count is not
specialized and floating-point contraction is off, so a one-row decode call and an M-row prompt call give every
row the same bytes whichever of the two kernels runs (tests/test_cuda_kernels.py compares them). With one chunk
(contexts up to CHUNK keys) the merge returns the chunk state itself: the plain online softmax.

Precision: q k^T on tensor cores with fp32 accumulation; the probabilities are rounded to the storage dtype for
the p @ v product (as FlashAttention-2 does; fp32 storage keeps fp32 with ``input_precision="ieee"``), and a block's
softmax sum adds those same rounded probabilities through the MMA (p @ ones; FlashAttention-2 adds the unrounded ones
with a row reduction): numerator and denominator weigh the values alike, and each lane's sum runs over the keys in
the MMA's K order inside one warp, so the tile's warps and lanes cannot reorder it. exp2 is Triton's (ex2.approx);
the final division is IEEE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .triton_attn_programs import _attn_kernel, _attn_split_kernel, _combine_kernel
from .gemm_configs import arch_of, check_placement
from .triton_rows import _NO_FMA, INTERPRET, capability, cdiv, launch, next_pow2


@dataclass(frozen=True)
class AttnConfig:
    """Fixed attention tiling: query rows per tile, keys per online-softmax block, warps, pipeline stages."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    chunk: int = 512

    def __post_init__(self) -> None:
        if self.chunk % self.block_n:
            raise ValueError(f"chunk={self.chunk} must be a multiple of block_n={self.block_n}")

    def label(self) -> str:
        """Short id such as ``m64 n128 w4 s3 c512``."""
        return f"m{self.block_m} n{self.block_n} w{self.num_warps} s{self.num_stages} c{self.chunk}"


_DEFAULTS: dict[tuple[str, str], AttnConfig] = {
    ("16bit", "sm90"): AttnConfig(128, 64, 8, 3),       # 128-key blocks exceed 232 KB of shared memory
    ("16bit", "sm120"): AttnConfig(64, 64, 8, 2),       # offline ptxas: 192 registers, no spill (4 warps spill)
    ("16bit", "other"): AttnConfig(64, 64, 4, 2),
    ("fp32", "sm90"): AttnConfig(32, 32, 4, 2),
    ("fp32", "sm120"): AttnConfig(32, 32, 4, 2),
    ("fp32", "other"): AttnConfig(32, 32, 4, 2),
    ("16bit", "interp"): AttnConfig(16, 16, 4, 1, 32),  # CPU interpreter (tests): chunks of 2 blocks
    ("fp32", "interp"): AttnConfig(16, 16, 4, 1, 32),
}
SHAPE_CONFIGS: dict[tuple[int, str, str], AttnConfig] = {}
LOG2E = 1.0 / math.log(2.0)  # scores in base 2: exp2(s log2(e)) = e^s
SPLIT_BELOW_PROGRAMS = 264   # (tile, head) programs under which the chunks run in parallel (2 per H200 SM)
# Rows per program of the chunk combine: the call's rows up to COMBINE_ROWS (combine_rows), so a decode row's program
# has no idle lanes, which halved a decode step's combine time on the H200 (docs/figures.md); a merge is per row, so
# the rows per program change no byte.
COMBINE_ROWS = 16
COMBINE_STAGES = 3           # chunk states the combine loads ahead (software pipelining; the merges stay in order)
# Per (D, dtype key, arch): (rows, overrides) in ascending rows; a split call of at most ``rows`` rows runs its chunk
# programs with the config's fields replaced by the overrides (only PLACEMENT_FIELDS: the lanes of a tile, its warps
# and stages; never block_n or chunk, the arithmetic). A decode row's G packed heads fill 8 of a 128-lane tile; a
# 16-lane tile does an eighth of the MMA work for them. A placement changes no byte (the module docstring's
# Precision: the maximum over keys is exact in any order, every sum over keys runs inside one warp's MMA); every
# entry must still pass the GPU test that compares each lane's fp32 chunk state (m, l, acc) with the config's
# (tests/test_cuda_kernels.py).
# Chosen on an H200 by the split kernel's GPU time at 4,096 keys: 4 warps for one row, 1 for up to 8 (streams).
PLACEMENT_FIELDS = ("block_m", "num_warps", "num_stages")
SPLIT_PLACEMENTS: dict[tuple[int, str, str], tuple[tuple[int, dict], ...]] = {
    (128, "16bit", "sm90"): ((1, dict(block_m=16, num_warps=4)), (8, dict(block_m=16, num_warps=1))),
}


def _check_split_placements(table: dict) -> None:
    """Raise ValueError for an entry that overrides a field outside PLACEMENT_FIELDS or whose rows do not ascend."""
    for key, entries in table.items():
        check_placement(f"SPLIT_PLACEMENTS[{key}]", [r for r, _ in entries], [o for _, o in entries], PLACEMENT_FIELDS)


_check_split_placements(SPLIT_PLACEMENTS)


def _key(D: int, dtype: torch.dtype, capability: tuple[int, int]) -> tuple[int, str, str]:
    """The tables' key: (D, dtype key, arch) (gemm_configs.arch_of)."""
    return D, "fp32" if dtype == torch.float32 else "16bit", arch_of(capability)


def config_for(D: int, dtype: torch.dtype, capability: tuple[int, int]) -> AttnConfig:
    """The fixed config for head dim D, dtype and (major, minor) capability; never depends on the row count."""
    key = _key(D, dtype, capability)
    return SHAPE_CONFIGS.get(key) or _DEFAULTS[key[1:]]


def split_placement(D: int, dtype: torch.dtype, capability: tuple[int, int], M: int) -> AttnConfig:
    """The config a split call of M rows runs its chunk programs in: config_for's, with the fields of the first
    SPLIT_PLACEMENTS entry whose rows hold M replaced (none: the config itself)."""
    cfg = config_for(D, dtype, capability)
    over = next((o for rows, o in SPLIT_PLACEMENTS.get(_key(D, dtype, capability), ()) if M <= rows), {})
    return replace(cfg, **over)


def _tiles(slots: torch.Tensor, n_slots: int, bm: int):
    """Rows grouped by slot (stable), cut into tiles of <= bm rows, on the device: (rows [M], start, len, slot
    [n]) int64 for a bound on the tile count that needs no host read of the slots, n = M // bm + min(S, M) (every
    slot holding rows adds at most one partial tile); tiles past the last have length 0 and no valid row."""
    M = slots.numel()
    order = torch.sort(slots, stable=True).indices                                             # [M] int64
    counts = torch.zeros(n_slots, dtype=torch.int64, device=slots.device).index_add_(0, slots, torch.ones_like(slots))
    per = (counts + bm - 1) // bm                                                              # [S] tiles per slot
    ends = torch.cumsum(per, 0)                                                                # [S] inclusive
    t = torch.arange(M // bm + min(n_slots, M), device=slots.device)                           # [n] tile ids
    slot = torch.searchsorted(ends, t, right=True).clamp_(max=n_slots - 1)                     # [n]
    local = t - (ends - per)[slot]                                                             # tile in its slot
    start = (torch.cumsum(counts, 0) - counts)[slot] + local * bm
    length = torch.where(t < ends[-1], (counts[slot] - local * bm).clamp(0, bm), 0)
    return order, start, length, slot


_KV_DESC: dict[tuple, TensorDescriptor] = {}


def _kv_descriptor(c: torch.Tensor, block_n: int) -> TensorDescriptor:
    """TMA descriptor of a contiguous cache [S, T, Hkv, D] viewed as [S, T, Hkv*D] with a [1, block_n, D] box.

    Kept per cache tensor (a descriptor is base address, shape, strides and box: one describing the same memory the
    same way is interchangeable, and it reads whatever the memory holds at launch); at most 64 are kept.
    """
    S, T, Hkv, D = c.shape
    key = (c.data_ptr(), S, T, Hkv, D, c.dtype, c.device, block_n)
    d = _KV_DESC.get(key)
    if d is None:
        if len(_KV_DESC) >= 64:
            _KV_DESC.clear()
        d = _KV_DESC[key] = TensorDescriptor(c.view(S, T, Hkv * D), [S, T, Hkv * D], [T * Hkv * D, Hkv * D, 1],
                                             [1, block_n, D])
    return d


def _check(q, k_cache, v_cache, slots, positions) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected q [M, Hq, D], k/v cache [S, T, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    M, Hq, D = q.shape
    if k_cache.shape[3] != D or Hq % k_cache.shape[2]:
        raise ValueError(f"head dim {D} vs cache {k_cache.shape[3]}, or Hq={Hq} not a multiple of "
                         f"Hkv={k_cache.shape[2]}")
    if slots.shape != (M,) or positions.shape != (M,):
        raise ValueError(f"slots and positions must be [{M}], got {tuple(slots.shape)}, {tuple(positions.shape)}")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"q {q.dtype} and cache {k_cache.dtype}/{v_cache.dtype} must share one dtype")


def split_chunks(n_tiles: int, Hq: int, T: int, cfg: AttnConfig) -> bool:
    """Whether a call of ``n_tiles`` row tiles runs chunk by chunk in parallel (_attn_split_kernel +
    _combine_kernel) rather than one program per (tile, head): when the (tile, head) grid alone would leave most SMs
    idle and the cache holds more than one chunk. Either way every row gets the same bytes (the module docstring),
    so this may depend on the row count."""
    return T > cfg.chunk and n_tiles * Hq < SPLIT_BELOW_PROGRAMS


def one_row_per_tile(S: int, M: int) -> bool:
    """Whether a call of M rows over S > 1 slots runs one row per tile, each tile's slot read on the device (a decode
    step of concurrent streams); else its rows are grouped by slot (_tiles). One slot needs neither."""
    return 1 < S and M <= S


def _row_tiles(slots: torch.Tensor, pos: torch.Tensor, S: int, rpt: int) -> tuple:
    """The call's row tiles of <= rpt rows: (mode, rows, tstart, tlen, tslot, n_tiles), mode as _tile_rows's
    GROUPED (unused tensors are ``pos``)."""
    M = pos.numel()
    if S == 1:
        return 0, pos, pos, pos, pos, cdiv(M, rpt)
    if one_row_per_tile(S, M):
        return 2, pos, pos, pos, slots.contiguous(), M
    rows, tstart, tlen, tslot = _tiles(slots, S, rpt)
    return 1, rows, tstart, tlen, tslot, tstart.numel()


def _launch_parts(qc, kc, vc, slots, pos, cfg: AttnConfig, hpp: int, scale: float) -> tuple:
    """What both attention kernels take (tiles of cfg.block_m // hpp rows; ``scale`` the softmax scale, passed
    times log2(e) in fp32): (grid's tile count, the row and KV arguments after the output(s), constexprs, launch
    options)."""
    M, Hq, D = qc.shape
    S, T, Hkv, _ = kc.shape
    cap = capability(qc.device)
    grouped, rows, tstart, tlen, tslot, n_tiles = _row_tiles(slots, pos, S, cfg.block_m // hpp)
    kv_tma = ((qc.device.type != "cuda" or cap[0] >= 9) and D == next_pow2(D)
              and D * qc.element_size() >= 16)                                     # TMA box rules
    srcs = tuple(_kv_descriptor(c, cfg.block_n) for c in (kc, vc)) if kv_tma else (kc, vc)
    tiles = (pos, rows, tstart, tlen, tslot, M, n_tiles, T)
    strides = (qc.stride(0), qc.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), scale * LOG2E)
    consts = dict(G=Hq // Hkv, D=D, BD=next_pow2(D), BM=cfg.block_m, BN=cfg.block_n, CH=cfg.chunk,
                  GROUPED=grouped, KV_TMA=kv_tma, PRECISION="ieee" if qc.dtype == torch.float32 else "tf32",
                  EMULATE=INTERPRET)
    return n_tiles, srcs, tiles, strides, consts, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_NO_FMA)


def chunk_states(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor, cfg: AttnConfig, pack: bool | None = None,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's and head's chunk states, one program per (tile, head group, chunk) (_attn_split_kernel).

    Args as ``attention`` (checked there), contiguous; cfg: the tiling to run (split_placement's); pack: as
    attention's; scale: the score scale (default 1/sqrt(D)).
    Returns:
        (acc [M * Hq * NC, BD] fp32, (m, l) [M * Hq * NC * 2] fp32, m in base-2 units: scores times log2(e)),
        entry (row * Hq + head) * NC + chunk, NC = ceil(T / chunk); entries of chunks past a row's position are not
        written.
    """
    M, Hq, D = q.shape
    G = Hq // k_cache.shape[2]
    hpp = G if pack is not False and cfg.block_m % G == 0 else 1
    n_tiles, (k_src, v_src), tiles, strides, consts, opts = _launch_parts(
        q, k_cache, v_cache, slots, positions, cfg, hpp, 1.0 / math.sqrt(D) if scale is None else scale)
    nc = cdiv(k_cache.shape[1], cfg.chunk)
    ws = torch.empty(M * Hq * nc, next_pow2(D), dtype=torch.float32, device=q.device)   # chunk accumulators
    ml = torch.empty(M * Hq * nc * 2, dtype=torch.float32, device=q.device)             # chunk (m, l)
    launch(_attn_split_kernel, (n_tiles, Hq // hpp, nc), (q, k_src, v_src, ws, ml) + tiles + (nc,) + strides,
           dict(consts, HPP=hpp), **opts)
    return ws, ml


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor, config: AttnConfig | None = None, split: bool | None = None,
              pack: bool | None = None) -> torch.Tensor:
    """Causal GQA attention, batch-invariant (module docstring).

    Args:
        q: [M, Hq, D]; k_cache, v_cache: [S, T, Hkv, D] (the rows' own keys already written); slots, positions:
            [M] int64 with 0 <= positions < T. One dtype (bf16/fp16/fp32), one device.
        config: run this config as given, without split placements (benchmarks only; never choose it from M).
        split: run the chunks in parallel (True) or in one program per (tile, head) (False); None = split_chunks.
        pack: in a split call, pack each KV head's G query heads into one tile's lanes (True: where block_m is a
            multiple of G) or run one program per query head (False); None = pack where it can.
            All of these give the same bytes.
    Returns:
        [M, Hq, D] in q's dtype.
    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    _check(q, k_cache, v_cache, slots, positions)
    M, Hq, D = q.shape
    S, T, Hkv, _ = k_cache.shape
    cfg = config or config_for(D, q.dtype, capability(q.device))
    qc, kc, vc, pos = q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), positions.contiguous()
    out = torch.empty_like(qc)
    if M == 0:
        return out
    if split is None:
        split = split_chunks(M if one_row_per_tile(S, M) else cdiv(M, cfg.block_m), Hq, T, cfg)
    if not split:
        n_tiles, srcs, tiles, strides, consts, opts = _launch_parts(qc, kc, vc, slots, pos, cfg, 1,
                                                                    1.0 / math.sqrt(D))
        launch(_attn_kernel, (Hq * n_tiles,), (qc, *srcs, out) + tiles + strides, consts, **opts)
        return out
    placed = config or split_placement(D, q.dtype, capability(q.device), M)
    ws, ml = chunk_states(qc, kc, vc, slots, pos, placed, pack)
    br = combine_rows(M)
    launch(_combine_kernel, (cdiv(M, br), Hq), (ws, ml, out, pos, M, cdiv(T, cfg.chunk), qc.stride(0), qc.stride(1)),
           dict(D=D, BD=next_pow2(D), BR=br, CH=cfg.chunk, STAGES=COMBINE_STAGES, EMULATE=INTERPRET),
           num_warps=4, **_NO_FMA)
    return out


def combine_rows(M: int) -> int:
    """Rows per program of the chunk combine of an M-row split call: the power of two >= M, at most
    COMBINE_ROWS."""
    return min(COMBINE_ROWS, next_pow2(M))
