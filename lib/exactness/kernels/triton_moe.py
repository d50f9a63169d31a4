"""Grouped MoE experts in Triton (CUDA): all of a layer's routed experts in one launch per projection.

``experts(h [M, H], idx [M, k], w_gate [E, I, H], w_up [E, I, H], w_down [E, H, I]) -> y [M, k, H]``: y[m, j] is
expert idx[m, j]'s SwiGLU of row h[m], as experts.gate_up_invariant then experts.down_invariant compute it; the
combine over slots stays with the moe_combine kernel (fp32, slot order).

Layout: the (row, slot) pairs are sorted by expert (stable), each expert's run is padded to a whole number of
BLOCK_M-row tiles, and every tile belongs to one expert. A route kernel copies each tile's member rows of h into a
padded buffer (padding rows are not written: each GEMM row depends on its own row only, and a padding row's result
is never stored) and records where each padded row's result goes; the fused gate/up GEMM and
the down GEMM then run one program per (tile, BLOCK_N columns), the tile's expert read from the route table, and
the down GEMM stores each row straight into its (row, slot) place of y. A one-row call (a decode step of one
stream, ONE_ROW) needs no route: tile j is the row's slot j, whose expert the GEMMs read from idx itself, gate/up
reads the row from h (tile rows past it read as zero), and down stores tile j's first row to slot j.

Invariance device: the tile arithmetic is triton_gemm's (its _tile_product and rounding points, BLOCK_K and
split_k of gemm_configs.config_for for the expert's weight shape, never chosen from M or from the counts): one
row's output depends only on that row and its expert's weights, not on how many rows its expert received, which
tile or which tile row it landed in, or what the padding rows hold. As in triton_gemm, the placement may follow the
call: where the pairs average few rows per expert (a decode step) the tiles have fewer rows and columns
(EXPERT_PLACEMENTS), which changes no byte. A decode step (M = 1: k experts with one row
each) and a prompt chunk therefore give a row the same bytes, and these equal the per-expert kernels'
(triton_gemm.gate_up / linear) rows; tests/test_cuda_kernels.py compares them as bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .gemm_configs import DTYPES, _pkey, arch_of, check_placement, config_for
from .triton_gemm import _check as _check_gemm
from .triton_gemm import _spec, capability, descriptor
from .triton_tiles import _store_tile, _tile_product
from .triton_rows import INTERPRET, cdiv, intern_key, launch, next_pow2, pdl_start, round_to


@triton.jit
def _bisect_step(sorted_ptr, lo, hi, ee, E, UPPER: tl.constexpr):
    """One step of a vector binary search for the first index whose id is >= ee (UPPER: > ee)."""
    act = lo < hi
    mid = (lo + hi) // 2
    v = tl.load(sorted_ptr + mid, mask=act, other=E)
    right = (v <= ee) if UPPER else (v < ee)
    return tl.where(act & right, mid + 1, lo), tl.where(act & (right == 0), mid, hi)


@triton.jit
def _pair_counts(ids_ptr, sorted_ptr, n_pairs, n_iter, ee, E, SMALL: tl.constexpr, BP: tl.constexpr):
    """[BE] pairs per expert and [BE] index of each expert's first pair in the sorted order.

    SMALL: counted from the unsorted ids (BP >= n_pairs lanes). Otherwise: binary search of ee and ee + 1 in
    the sorted ids, n_iter = bit length of n_pairs steps.
    """
    if SMALL:
        p = tl.arange(0, BP)
        ids = tl.load(ids_ptr + p, mask=p < n_pairs, other=E)
        counts = tl.sum((ids[None, :] == ee[:, None]).to(tl.int32), axis=1)
        lo = tl.cumsum(counts, axis=0) - counts
    else:
        lo = tl.zeros(ee.shape, dtype=tl.int32)
        hi = tl.zeros(ee.shape, dtype=tl.int32) + n_pairs
        lo1 = lo
        hi1 = hi
        for _ in range(n_iter):
            lo, hi = _bisect_step(sorted_ptr, lo, hi, ee, E, False)
            lo1, hi1 = _bisect_step(sorted_ptr, lo1, hi1, ee, E, True)
        counts = lo1 - lo
    return tl.where(ee < E, counts, 0), lo


@triton.jit
def _tile_pairs(ids_ptr, order_ptr, n_pairs, e, first_pair, local, valid, SMALL: tl.constexpr, BP: tl.constexpr):
    """[BM] pair index (row * k + slot) of each tile row: the local-th pair of expert e in pair order."""
    if SMALL:
        p = tl.arange(0, BP)
        match = tl.load(ids_ptr + p, mask=p < n_pairs, other=-1) == e
        rank = tl.cumsum(match.to(tl.int32), axis=0) - 1                                  # stable order
        sel = match[None, :] & (rank[None, :] == local[:, None])                           # [BM, BP]
        pair = tl.sum(tl.where(sel, p[None, :], 0), axis=1)
    else:
        pair = tl.load(order_ptr + first_pair + local, mask=valid, other=0).to(tl.int32)
    return tl.where(valid, pair, -1)


@triton.jit(do_not_specialize=["n_pairs", "n_iter"])
def _route_kernel(h_ptr, ids_ptr, sorted_ptr, order_ptr, xs_ptr, dest_ptr, tile_e_ptr, n_pairs, n_iter, E, H,
                  TOPK: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr, SMALL: tl.constexpr,
                  BP: tl.constexpr, PDL: tl.constexpr):
    """Program (t, c): tile t's expert (or -1) and its rows' (row, slot) destinations (or -1), written by c = 0,
    and columns c*BH.. of h's member rows copied to xs. Padding rows of xs are left as they are: a GEMM row reads
    only its own row of xs, and a padding row's result is never stored (dest -1)."""
    pdl_start(PDL)
    t = tl.program_id(0)
    c0 = tl.program_id(1) * BH
    ee = tl.arange(0, BE)
    counts, first = _pair_counts(ids_ptr, sorted_ptr, n_pairs, n_iter, ee, E, SMALL, BP)
    ntiles = (counts + BM - 1) // BM
    ends = tl.cumsum(ntiles, axis=0)                                                       # inclusive
    e = tl.sum((ends <= t).to(tl.int32), axis=0)                                           # this tile's expert
    i = tl.arange(0, BM)
    if c0 == 0:
        tl.store(tile_e_ptr + t, tl.where(e < E, e, -1))
    if e < E:
        first_tile = tl.sum(tl.where(ee < e, ntiles, 0), axis=0)
        first_pair = tl.sum(tl.where(ee == e, first, 0), axis=0)
        n_e = tl.sum(tl.where(ee == e, counts, 0), axis=0)
        local = (t - first_tile) * BM + i
        valid = local < n_e
        pair = _tile_pairs(ids_ptr, order_ptr, n_pairs, e, first_pair, local, valid, SMALL, BP)
        if c0 == 0:
            tl.store(dest_ptr + t * BM + i, pair)
        row = tl.where(valid, pair // TOPK, 0)
        cols = c0 + tl.arange(0, BH)
        m = valid[:, None] & (cols[None, :] < H)
        x = tl.load(h_ptr + row[:, None] * H + cols[None, :], mask=m, other=0.0)
        tl.store(xs_ptr + (t * BM + i)[:, None] * H + cols[None, :], x, mask=m)
    elif c0 == 0:
        tl.store(dest_ptr + t * BM + i, tl.full((BM,), -1, dtype=tl.int32))


@triton.jit
def _scatter_tile(c_ptr, acc, dest_ptr, off_m, off_n, N, stride_cm, BM: tl.constexpr, BN: tl.constexpr,
                  EMULATE: tl.constexpr, ONE_ROW: tl.constexpr):
    """Round to the storage dtype and store each row at its (row, slot) place; padding rows (-1) are dropped.
    ONE_ROW: tile off_m / BM holds one row, pair off_m / BM (the only row's slot), and no route table."""
    out = round_to(acc, c_ptr.dtype.element_ty, EMULATE)
    if ONE_ROW:
        d = tl.where(tl.arange(0, BM) == 0, off_m // BM, -1)
    else:
        d = tl.load(dest_ptr + off_m + tl.arange(0, BM))
    rn = off_n + tl.arange(0, BN)
    tl.store(c_ptr + d[:, None].to(tl.int64) * stride_cm + rn[None, :], out, mask=(d[:, None] >= 0) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["n_rows"])
def _grouped_kernel(a_src, b_src, b2_src, c_ptr, tile_e_ptr, dest_ptr, n_rows, N, K, stride_am, stride_bn,
                    stride_cm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATE_UP: tl.constexpr,
                    SCATTER: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
                    SPLIT: tl.constexpr, ONE_ROW: tl.constexpr, PDL: tl.constexpr):
    """One program per (tile, BLOCK_N columns); the expert's weights are rows e*N.. of the stacked [E*N, K].
    ONE_ROW: tile_e_ptr is the one row's expert ids (tile t = slot t), gate/up reads that row (row 0 of a, n_rows
    = 1) and stores tile t's first row; down scatters it without dest_ptr."""
    pdl_start(PDL)
    num_pid_n = tl.cdiv(N, BN)
    t = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    e = tl.load(tile_e_ptr + t).to(tl.int32)                                   # ONE_ROW: int64 ids
    off_a = t * BM
    n_out = n_rows
    if ONE_ROW and not SCATTER:
        off_a = t * 0
        n_out = t * BM + 1
    if e >= 0:
        if TMA:
            b, b2, off_b = b_src, b2_src, e * N + pid_n * BN       # rows of the stacked [E*N, K] descriptor
        else:
            b = b_src + e.to(tl.int64) * N * stride_bn              # the expert's [N, K] block
            b2 = b2_src + e.to(tl.int64) * N * stride_bn
            off_b = pid_n * BN
        acc, acc2 = _tile_product(a_src, b, b2, off_a, off_b, n_rows, N, K, stride_am, stride_bn,
                                  BM, BN, BK, GATE_UP, TMA, PRECISION, EMULATE, SPLIT)
        if SCATTER:
            _scatter_tile(c_ptr, acc, dest_ptr, t * BM, pid_n * BN, N, stride_cm, BM, BN, EMULATE, ONE_ROW)
        else:
            _store_tile(c_ptr, acc, acc2, t * BM, pid_n * BN, n_out, N, stride_cm, BM, BN, GATE_UP, EMULATE)


@dataclass
class _Plan:
    """Launch state of one layer's stacked expert weights (depends on the weights, never on M): per placement
    (rows per expert, gate/up state, down state), rows ascending, the last for any count; a state is (config,
    use_tma, b, b2, consts, opts, key)."""

    states: tuple
    E: int
    I: int
    H: int
    weights: tuple


_PLANS: dict[tuple, _Plan] = {}
SMALL_PAIRS = 256   # up to this many (row, slot) pairs the route kernel groups them itself (no torch.sort launch)
ONE_ROW = True      # a one-row call runs its k slots as k tiles without the route launch (module docstring)
ROUTE_COLUMNS = 128  # columns of h per route program: [BLOCK_M, 128] stays in registers (wider tiles spill)
# Per (I, H, "bf16", arch): (rows per expert, gate/up overrides, down overrides) in ascending rows; a call whose pairs
# average at most that many rows per expert takes the shapes' configs with those fields replaced (one block_m for
# both: a tile holds one expert's rows in both GEMMs). Chosen on an H200 by GPU time at 1, 8 and 64 rows of top-8
# over 128 experts, at most 4 rows per expert (benchmarks/bench_split_k.py --part experts), the pipeline depth by
# the decode step's wall time (--part stages; docs/figures.md); the GPU test compares bytes up to 16 rows per
# expert.
_TILE16 = dict(block_m=16, num_warps=4, num_stages=6)
EXPERT_PLACEMENTS: dict[tuple[int, int, str, str], tuple[tuple[int, dict, dict], ...]] = {
    (768, 2048, "bf16", "sm90"): ((16, dict(_TILE16, block_n=64), dict(_TILE16, block_n=128)),),
}


def _check_expert_placements(table: dict) -> None:
    """Raise ValueError for an entry that overrides a field outside PLACEMENT_FIELDS, gives the two GEMMs different
    block_m, or whose rows do not ascend."""
    for key, entries in table.items():
        check_placement(f"EXPERT_PLACEMENTS[{key}]", [e[0] for e in entries],
                        [o for _, gu, dn in entries for o in (gu, dn)])
        for _, gu, dn in entries:
            if "block_m" not in gu or gu["block_m"] != dn.get("block_m"):
                raise ValueError(f"EXPERT_PLACEMENTS[{key}]: both GEMMs must name one block_m, got "
                                 f"{gu.get('block_m')} (gate/up) and {dn.get('block_m')} (down)")


_check_expert_placements(EXPERT_PLACEMENTS)


def expert_placements(I: int, H: int, dtype: torch.dtype, capability: tuple[int, int]) -> tuple:
    """(rows per expert, gate/up config, down config) per placement, rows ascending, then (inf, the shapes'
    configs)."""
    gu, dn = config_for("gate_up", I, H, dtype, capability), config_for("linear", H, I, dtype, capability)
    entries = EXPERT_PLACEMENTS.get((I, H, _pkey(dtype), arch_of(capability)), ())
    return tuple((r, replace(gu, **g), replace(dn, **d)) for r, g, d in entries) + ((float("inf"), gu, dn),)


def _gemm_state(kind: str, w: torch.Tensor, w2: torch.Tensor | None, dtype, device, scatter: bool,
                cfg) -> tuple:
    E, N, K = w.shape
    cap = capability(device)
    use_tma = cfg.tma and (device.type != "cuda" or cap[0] >= 9) and (K * w.element_size()) % 16 == 0 \
        and w.data_ptr() % 16 == 0 and (w2 is None or w2.data_ptr() % 16 == 0)
    flat = [t.view(E * N, K) for t in (w, w2) if t is not None]
    bs = [descriptor(t, [cfg.block_n, cfg.block_k]) for t in flat] if use_tma else flat
    consts = dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GATE_UP=kind == "gate_up", SCATTER=scatter,
                  TMA=use_tma, PRECISION="ieee" if dtype == torch.float32 else "tf32", EMULATE=INTERPRET,
                  SPLIT=cfg.split_k)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    key = intern_key((_grouped_kernel, tuple(consts.items()), tuple(opts.items()), dtype, N, K,
                      tuple(_spec(b) for b in bs), device))
    return cfg, use_tma, bs[0], bs[-1], consts, opts, key


def _plan(h, w_gate, w_up, w_down) -> _Plan:
    pk = (h.dtype, h.device) + tuple((w.data_ptr(), w.shape, w.stride(), w.dtype, w.device)
                                     for w in (w_gate, w_up, w_down))
    p = _PLANS.get(pk)
    if p is not None:
        return p
    if w_gate.dim() != 3 or w_gate.shape != w_up.shape or w_down.shape != (w_gate.shape[0], w_gate.shape[2],
                                                                            w_gate.shape[1]):
        raise ValueError(f"expected w_gate, w_up [E, I, H] and w_down [E, H, I]; got {tuple(w_gate.shape)}, "
                         f"{tuple(w_up.shape)}, {tuple(w_down.shape)}")
    E, I, H = w_gate.shape
    _check_gemm(h, (w_gate[0], w_up[0]))
    _check_gemm(h.new_empty(0, I), (w_down[0],))
    if not all(w.is_contiguous() for w in (w_gate, w_up, w_down)):
        raise ValueError("grouped experts need contiguous stacked weights")
    placed = expert_placements(I, H, h.dtype, capability(h.device))
    if not _one_block_m(placed):
        raise ValueError(f"grouped experts need one BLOCK_M for gate/up and down in every placement, got "
                         f"{[(gu.block_m, dn.block_m) for _, gu, dn in placed]}")
    states = tuple((r, _gemm_state("gate_up", w_gate, w_up, h.dtype, h.device, False, gu),
                    _gemm_state("linear", w_down, None, h.dtype, h.device, True, dn)) for r, gu, dn in placed)
    p = _Plan(states, E, I, H, (w_gate, w_up, w_down))
    if len(_PLANS) > 1024:
        _PLANS.clear()
    _PLANS[pk] = p
    return p


def supported(h: torch.Tensor, w_gate: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether the grouped kernels serve this call: a float storage dtype shared by h and the weights, both
    projections' configs share BLOCK_M in every placement (a tile must hold rows of one expert for both GEMMs) and
    the stacked weights are contiguous."""
    if h.dtype not in DTYPES or w_gate.dtype != h.dtype or w_down.dtype != h.dtype or w_gate.dim() != 3:
        return False
    E, I, H = w_gate.shape
    return (_one_block_m(expert_placements(I, H, h.dtype, capability(h.device)))
            and w_gate.is_contiguous() and w_down.is_contiguous())


def _one_block_m(placed: tuple) -> bool:
    """Whether gate/up and down share BLOCK_M in every placement (a tile holds one expert's rows in both GEMMs)."""
    return all(gu.block_m == dn.block_m for _, gu, dn in placed)


def _launch_gemm(state: tuple, a: torch.Tensor, out: torch.Tensor, tile_e, dest, n_tiles: int, N: int, K: int,
                 one_row: bool = False):
    """One grouped GEMM launch; one_row: tile_e is the one row's expert ids [k] int64 (dest unused)."""
    cfg, use_tma, b, b2, consts, opts, key = state
    if use_tma:
        a_src = descriptor(a, [cfg.block_m, cfg.block_k])
    else:
        a_src, key = a, (key, a.data_ptr() % 16 == 0)
    if one_row:
        key = (key, tile_e.data_ptr() % 16 == 0)
    args = (a_src, b, b2, out, tile_e, dest, a.shape[0], N, K, K, K, out.stride(0))
    launch(_grouped_kernel, (n_tiles * cdiv(N, cfg.block_n),), args, dict(consts, ONE_ROW=one_row), key=key, **opts)


def experts(h: torch.Tensor, idx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
            w_down: torch.Tensor) -> torch.Tensor:
    """Every routed expert's SwiGLU of its rows, one launch per projection (module docstring).

    Args:
        h: [M, H] normalised rows, bf16/fp16/fp32; idx: [M, k] int64 expert ids in 0..E-1 (the router's).
        w_gate, w_up: [E, I, H]; w_down: [E, H, I]; contiguous, h's dtype and device.
    Returns:
        y [M, k, H] in h's dtype: y[m, j] = down_e(SiLU(h[m] w_gate_e^T) * (h[m] w_up_e^T)), e = idx[m, j], with
        the rounding points of triton_gemm.gate_up then triton_gemm.linear.
    Raises:
        ValueError: shapes, dtypes or devices that do not match, or non-contiguous weights.
    """
    p = _plan(h, w_gate, w_up, w_down)
    M, k = idx.shape
    if idx.shape[0] != h.shape[0] or idx.dtype != torch.int64:
        raise ValueError(f"idx must be [{h.shape[0]}, k] int64, got {tuple(idx.shape)} {idx.dtype}")
    y = torch.empty(M, k, p.H, dtype=h.dtype, device=h.device)                      # [M, k, H]
    if M == 0:
        return y
    n_pairs = M * k
    _, gate_up, down = next(st for st in p.states if n_pairs <= st[0] * p.E)
    bm = gate_up[0].block_m
    ids = idx.view(-1) if idx.is_contiguous() else idx.reshape(-1)                 # [M*k], pair = row*k + slot
    hc = h if h.is_contiguous() else h.contiguous()
    if M == 1 and ONE_ROW:                                                         # tile j = slot j
        g = torch.empty(k * bm, p.I, dtype=h.dtype, device=h.device)             # row j*bm: slot j's SiLU * up
        _launch_gemm(gate_up, hc, g, ids, ids, k, p.I, p.H, one_row=True)
        _launch_gemm(down, g, y.view(k, p.H), ids, ids, k, p.H, p.I, one_row=True)
        return y
    n_tiles = cdiv(n_pairs, bm) + min(p.E, n_pairs)                          # bound: no sync for counts
    small = n_pairs <= SMALL_PAIRS
    srt, order = (ids, ids) if small else torch.sort(ids, stable=True)             # by expert, stable
    xs = torch.empty(n_tiles * bm, p.H, dtype=h.dtype, device=h.device)            # padded member rows
    route = torch.empty(n_tiles * (bm + 1), dtype=torch.int32, device=h.device)
    dest, tile_e = route[:n_tiles * bm], route[n_tiles * bm:]
    bh = min(ROUTE_COLUMNS, next_pow2(p.H))
    launch(_route_kernel, (n_tiles, cdiv(p.H, bh)), (hc, ids, srt, order, xs, dest, tile_e, n_pairs,
                                                     n_pairs.bit_length(), p.E, p.H),
           dict(TOPK=k, BM=bm, BE=next_pow2(p.E), BH=bh,
                SMALL=small, BP=next_pow2(n_pairs) if small else 1), num_warps=4)
    g = torch.empty(n_tiles * bm, p.I, dtype=h.dtype, device=h.device)             # SiLU(gate) * up per row
    _launch_gemm(gate_up, xs, g, tile_e, dest, n_tiles, p.I, p.H)
    _launch_gemm(down, g, y.view(n_pairs, p.H), tile_e, dest, n_tiles, p.H, p.I)
    return y
