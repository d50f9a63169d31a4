"""The Triton programs of triton_gemm's batch-invariant GEMMs: tile loads, the K loop (in one run or split_k runs
added in run order), the rounding epilogue, and the kernels built from them (one program per tile, persistent,
and the parallel split-K kernel, whose last program per tile adds the partials, with the reduce kernel that adds
them where no counts serve). triton_gemm.py holds the configs and the launch wrappers and documents the
invariance device, triton_split.py launches the parallel split-K programs; triton_moe.py builds its grouped expert
kernel from the same tile functions.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_rows import dot_operand, pdl_start, round_to


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    in_group = GROUP_M * num_pid_n
    first_m = (tile_id // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % in_group) % size_m
    pid_n = (tile_id % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _load_tile(src, off_r, off_k, n_rows, K, stride_r, BR: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):
    """[BR, BK] tile of a row-major [n_rows, K] operand; out-of-range rows/columns read as 0."""
    if TMA:
        t = src.load([off_r, off_k])
    else:
        r = off_r + tl.arange(0, BR)
        k = off_k + tl.arange(0, BK)
        t = tl.load(src + r[:, None] * stride_r + k[None, :], mask=(r[:, None] < n_rows) & (k[None, :] < K),
                    other=0.0)
    return t


@triton.jit
def _chunk_dot(a_src, b_src, b2_src, off_m, off_n, ki, acc, acc2, M, N, K, stride_am, stride_bn,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATE_UP: tl.constexpr,
               TMA: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """K chunk ki (BK columns) accumulated into the fp32 [BM, BN] accumulator(s) acc (and acc2 for gate_up)."""
    a = _load_tile(a_src, off_m, ki * BK, M, K, stride_am, BM, BK, TMA)              # [BM, BK]
    b = _load_tile(b_src, off_n, ki * BK, N, K, stride_bn, BN, BK, TMA)              # [BN, BK]
    acc = tl.dot(dot_operand(a, EMULATE), dot_operand(b, EMULATE).T, acc, input_precision=PRECISION)
    if GATE_UP:
        b2 = _load_tile(b2_src, off_n, ki * BK, N, K, stride_bn, BN, BK, TMA)
        acc2 = tl.dot(dot_operand(a, EMULATE), dot_operand(b2, EMULATE).T, acc2, input_precision=PRECISION)
    return acc, acc2


@triton.jit
def _k_range(a_src, b_src, b2_src, off_m, off_n, k_lo, k_hi, M, N, K, stride_am, stride_bn,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATE_UP: tl.constexpr,
             TMA: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 [BM, BN] accumulator(s) over the K chunks k_lo..k_hi-1 (of BK columns each) in ascending order."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(k_lo, k_hi):
        acc, acc2 = _chunk_dot(a_src, b_src, b2_src, off_m, off_n, ki, acc, acc2, M, N, K, stride_am, stride_bn,
                               BM, BN, BK, GATE_UP, TMA, PRECISION, EMULATE)
    return acc, acc2


@triton.jit
def _split_bounds(K, s, BK: tl.constexpr, SPLIT: tl.constexpr):
    """K chunks [lo, hi) of split s: the tl.cdiv(K, BK) chunks cut into SPLIT runs of equal length (the last
    shorter)."""
    nk = tl.cdiv(K, BK)
    per = tl.cdiv(nk, SPLIT)
    return tl.minimum(s * per, nk), tl.minimum((s + 1) * per, nk)


@triton.jit
def _tile_product(a_src, b_src, b2_src, off_m, off_n, M, N, K, stride_am, stride_bn,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATE_UP: tl.constexpr,
                  TMA: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr, SPLIT: tl.constexpr = 1,
                  SPLIT_LOOP: tl.constexpr = 0):
    """fp32 [BM, BN] accumulator(s) of one output tile. SPLIT = 1: all K chunks in ascending order. SPLIT > 1: each
    split's partial from zero (_k_range), added in split order to a zero total, the arithmetic of
    _gemm_split_kernel + _split_reduce_kernel (which run the splits in parallel) in one program. SPLIT_LOOP says
    how the program walks the splits (GemmConfig.split_loop; the same operations in the same order either way):
    0 one K loop per split, in turn; 1 one K loop over every chunk, folding the running partial into the total at
    each split's last chunk; 2 the split loop and its K loops flattened into one by Triton."""
    if SPLIT == 1:
        acc, acc2 = _k_range(a_src, b_src, b2_src, off_m, off_n, 0, tl.cdiv(K, BK), M, N, K, stride_am, stride_bn,
                             BM, BN, BK, GATE_UP, TMA, PRECISION, EMULATE)
    elif SPLIT_LOOP == 1:
        acc, acc2 = _folded_splits(a_src, b_src, b2_src, off_m, off_n, M, N, K, stride_am, stride_bn,
                                   BM, BN, BK, GATE_UP, TMA, PRECISION, EMULATE, SPLIT)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.range(0, SPLIT, flatten=SPLIT_LOOP == 2):
            lo, hi = _split_bounds(K, s, BK, SPLIT)
            p, p2 = _k_range(a_src, b_src, b2_src, off_m, off_n, lo, hi, M, N, K, stride_am, stride_bn,
                             BM, BN, BK, GATE_UP, TMA, PRECISION, EMULATE)
            acc = acc + p
            acc2 = acc2 + p2
    return acc, acc2


@triton.jit
def _folded_splits(a_src, b_src, b2_src, off_m, off_n, M, N, K, stride_am, stride_bn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATE_UP: tl.constexpr,
                   TMA: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr, SPLIT: tl.constexpr):
    """_tile_product's split arithmetic in one K loop: the running partial p (from zero, chunks in ascending order,
    as _k_range) is added to the total at the last chunk of its split (every per-th chunk, and the last one) and
    restarts from zero. Splits that hold no chunk (when SPLIT runs of tl.cdiv(nk, SPLIT) chunks overshoot nk) add
    their +0.0 partials in _split_reduce_kernel; one + 0.0 here mirrors them (no byte can change: the total starts
    at +0.0 and a sum is -0.0 only when both addends are). K >= 1 (the wrapper answers K = 0 without a kernel)."""
    nk = tl.cdiv(K, BK)
    per = tl.cdiv(nk, SPLIT)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    p = tl.zeros((BM, BN), dtype=tl.float32)
    p2 = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(0, nk):
        p, p2 = _chunk_dot(a_src, b_src, b2_src, off_m, off_n, ki, p, p2, M, N, K, stride_am, stride_bn,
                           BM, BN, BK, GATE_UP, TMA, PRECISION, EMULATE)
        if ((ki + 1) % per == 0) | (ki + 1 == nk):
            acc = acc + p
            acc2 = acc2 + p2
            p = tl.zeros((BM, BN), dtype=tl.float32)
            p2 = tl.zeros((BM, BN), dtype=tl.float32)
    if tl.cdiv(nk, per) < SPLIT:
        acc = acc + 0.0
        acc2 = acc2 + 0.0
    return acc, acc2


@triton.jit
def _store_tile(c_ptr, acc, acc2, off_m, off_n, M, N, stride_cm, BM: tl.constexpr, BN: tl.constexpr,
                GATE_UP: tl.constexpr, EMULATE: tl.constexpr):
    """Round to the storage dtype (gate_up: SiLU(g) * u with storage-dtype rounding points) and store."""
    dt = c_ptr.dtype.element_ty
    if GATE_UP:
        g = round_to(acc, dt, EMULATE).to(tl.float32)
        u = round_to(acc2, dt, EMULATE).to(tl.float32)
        s = round_to(tl.math.div_rn(g, 1.0 + tl.exp(-g)), dt, EMULATE).to(tl.float32)
        out = round_to(s * u, dt, EMULATE)
    else:
        out = round_to(acc, dt, EMULATE)
    rm = off_m + tl.arange(0, BM)
    rn = off_n + tl.arange(0, BN)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], out, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(a_src, b_src, b2_src, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 GATE_UP: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
                 SPLIT: tl.constexpr, SPLIT_LOOP: tl.constexpr, PDL: tl.constexpr):
    """One program per output tile."""
    pdl_start(PDL)
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    acc, acc2 = _tile_product(a_src, b_src, b2_src, pid_m * BM, pid_n * BN, M, N, K, stride_am, stride_bn,
                              BM, BN, BK, GATE_UP, TMA, PRECISION, EMULATE, SPLIT, SPLIT_LOOP)
    _store_tile(c_ptr, acc, acc2, pid_m * BM, pid_n * BN, M, N, stride_cm, BM, BN, GATE_UP, EMULATE)


@triton.jit(do_not_specialize=["M"])
def _gemm_persistent_kernel(a_src, b_src, b2_src, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                            GATE_UP: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
                            SPLIT: tl.constexpr, SPLIT_LOOP: tl.constexpr, NUM_SMS: tl.constexpr,
                            WS: tl.constexpr, PDL: tl.constexpr):
    """One program per SM, walking tiles start, start + NUM_SMS, ...; each tile computed as in _gemm_kernel."""
    pdl_start(PDL)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True, warp_specialize=WS):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc, acc2 = _tile_product(a_src, b_src, b2_src, pid_m * BM, pid_n * BN, M, N, K, stride_am, stride_bn,
                                  BM, BN, BK, GATE_UP, TMA, PRECISION, EMULATE, SPLIT, SPLIT_LOOP)
        _store_tile(c_ptr, acc, acc2, pid_m * BM, pid_n * BN, M, N, stride_cm, BM, BN, GATE_UP, EMULATE)


@triton.jit
def _group_member(M, N0, N1, BM: tl.constexpr, BN0: tl.constexpr, BN: tl.constexpr, SPLIT0: tl.constexpr,
                  SPLIT: tl.constexpr):
    """(weight b, output tile, split) of _gemm_split_group_kernel's program: weight 0's (tile, split) programs
    first (BN0 columns, SPLIT0 splits), then weight 1's and weight 2's (BN, SPLIT); a weight's splits of one tile
    side by side."""
    p = tl.program_id(0)
    p0 = tl.cdiv(M, BM) * tl.cdiv(N0, BN0) * SPLIT0
    p1 = tl.cdiv(M, BM) * tl.cdiv(N1, BN) * SPLIT
    b = (p >= p0).to(tl.int32) + (p >= p0 + p1).to(tl.int32)
    q = p - tl.where(b > 0, p0, 0) - tl.where(b > 1, p1, 0)
    split = tl.where(b == 0, SPLIT0, SPLIT)
    return b, q // split, q % split


@triton.jit
def _split_partial(a_src, b_src, ws_ptr, c_ptr, cnt_ptr, tile, s, M, N, K, stride_am, stride_bn, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
                   PRECISION: tl.constexpr, EMULATE: tl.constexpr, SPLIT: tl.constexpr, SUM: tl.constexpr,
                   WIDE: tl.constexpr = 0):
    """Output tile ``tile``'s split s: its fp32 partial (_k_range from zero) stored to ws[s]; with SUM, the tile's
    last split to finish also sums the partials into c (_sum_if_last, count at cnt_ptr[tile]; WIDE as _sum_tile).
    Returns whether this program summed the tile (False without SUM)."""
    pid_m, pid_n = _tile_coords(tile, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    lo, hi = _split_bounds(K, s, BK, SPLIT)
    acc, _ = _k_range(a_src, b_src, b_src, pid_m * BM, pid_n * BN, lo, hi, M, N, K, stride_am, stride_bn,
                      BM, BN, BK, False, TMA, PRECISION, EMULATE)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    tl.store(ws_ptr + (s * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))
    last = False
    if SUM:
        last = _sum_if_last(ws_ptr, c_ptr, cnt_ptr + tile, pid_m * BM, pid_n * BN, M, N, BM, BN, SPLIT, EMULATE,
                            WIDE)
    return last


@triton.jit
def _sum_if_last(ws_ptr, c_ptr, cnt_ptr, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr,
                 SPLIT: tl.constexpr, EMULATE: tl.constexpr, WIDE: tl.constexpr = 0):
    """Count this program's stored partial at cnt_ptr (int32, 0 before the tile's first split counts); the program
    that counts SPLIT - 1 sees every split's partial and sums them (_sum_tile, the reduce kernel's arithmetic), then
    sets the count back to 0 for the next call. The barrier puts every thread's stores before the count, whose
    acq_rel at GPU scope publishes them to (and, in the last program, acquires the others' from) the other SMs; the
    sum's loads bypass L1 (.cg), which other SMs' stores do not update. Returns whether this program summed."""
    tl.debug_barrier()
    n = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    last = n == SPLIT - 1
    if last:
        _sum_tile(ws_ptr, c_ptr, off_m, off_n, M, N, BM, BN, SPLIT, EMULATE, 16, WIDE)
        tl.store(cnt_ptr, 0)
    return last


@triton.jit(do_not_specialize=["M"])
def _gemm_split_kernel(a_src, b_src, ws_ptr, c_ptr, cnt_ptr, M, N, K, stride_am, stride_bn, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
                       PRECISION: tl.constexpr, EMULATE: tl.constexpr, SPLIT: tl.constexpr, SUM: tl.constexpr,
                       WIDE: tl.constexpr, PDL: tl.constexpr):
    """One program per (output tile, split): the split's fp32 partial (_k_range from zero) stored to ws[split];
    with SUM the tile's last split sums them into c (else _split_reduce_kernel does); WIDE as _sum_tile."""
    pdl_start(PDL)
    _split_partial(a_src, b_src, ws_ptr, c_ptr, cnt_ptr, tl.program_id(0), tl.program_id(1), M, N, K, stride_am,
                   stride_bn, BM, BN, BK, GROUP_M, TMA, PRECISION, EMULATE, SPLIT, SUM, WIDE)


@triton.jit(do_not_specialize=["M"])
def _gemm_split_group_kernel(a_src, b0_src, b1_src, b2_src, ws_ptr, c0_ptr, c1_ptr, c2_ptr, cnt_ptr, M, N0, N1, N2,
                             K, BM: tl.constexpr, BN0: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                             GROUP_M: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr,
                             EMULATE: tl.constexpr, SPLIT0: tl.constexpr, SPLIT: tl.constexpr, NB: tl.constexpr,
                             SUM: tl.constexpr, PDL: tl.constexpr):
    """_gemm_split_kernel for NB (2 or 3) weights [N_i, K] of x, one program per (weight, tile, split) on one axis
    (_group_member): weight 0 in tiles of BN0 columns and SPLIT0 splits, the others in BN and SPLIT (the rest of
    the config is one). Weight i's partials follow weight i-1's in ws, its tiles' counts follow its tiles'."""
    pdl_start(PDL)
    b, tile, s = _group_member(M, N0, N1, BM, BN0, BN, SPLIT0, SPLIT)
    tiles0 = tl.cdiv(M, BM) * tl.cdiv(N0, BN0)
    if b == 0:
        _split_partial(a_src, b0_src, ws_ptr, c0_ptr, cnt_ptr, tile, s, M, N0, K, K, K, BM, BN0, BK, GROUP_M, TMA,
                       PRECISION, EMULATE, SPLIT0, SUM)
    elif b == 1:
        _split_partial(a_src, b1_src, ws_ptr + (SPLIT0 * M * N0).to(tl.int64), c1_ptr, cnt_ptr + tiles0, tile, s, M,
                       N1, K, K, K, BM, BN, BK, GROUP_M, TMA, PRECISION, EMULATE, SPLIT, SUM)
    elif NB > 2:
        _split_partial(a_src, b2_src, ws_ptr + (SPLIT0 * M * N0 + SPLIT * M * N1).to(tl.int64), c2_ptr,
                       cnt_ptr + tiles0 + tl.cdiv(M, BM) * tl.cdiv(N1, BN), tile, s, M, N2, K, K, K, BM, BN, BK,
                       GROUP_M, TMA, PRECISION, EMULATE, SPLIT, SUM)


@triton.jit
def _sum_tile(ws_ptr, c_ptr, off_m, off_n, M, N, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
              EMULATE: tl.constexpr, SLAB: tl.constexpr, WIDE: tl.constexpr = 0):
    """The [BM, BN] tile at (off_m, off_n), SLAB rows at a time (fewer live registers than the whole tile): the
    splits' partials ws [SPLIT, M, N] added in split order to a zero total (as _tile_product), rounded once and
    stored to c [M, N]; WIDE = 1 / 2: rounded to bf16 / fp16 and stored widened to c's fp32 (exact), the bytes of
    the storage-dtype result then ``.float()``."""
    rn = off_n + tl.arange(0, BN)
    for r0 in tl.static_range(0, BM, SLAB):
        rm = off_m + r0 + tl.arange(0, SLAB)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        acc = tl.zeros((SLAB, BN), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc = acc + tl.load(ws_ptr + (s * M + rm[:, None]).to(tl.int64) * N + rn[None, :], mask=mask,
                                other=0.0, cache_modifier=".cg")
        if WIDE == 1:
            out = round_to(acc, tl.bfloat16, EMULATE).to(tl.float32)
        elif WIDE == 2:
            out = round_to(acc, tl.float16, EMULATE).to(tl.float32)
        else:
            out = round_to(acc, c_ptr.dtype.element_ty, EMULATE)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _split_reduce_kernel(ws_ptr, c_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                         EMULATE: tl.constexpr, WIDE: tl.constexpr, PDL: tl.constexpr):
    """The splits' partials added in split order to a zero total (as _tile_product), rounded once and stored
    (WIDE as _sum_tile)."""
    pdl_start(PDL)
    _sum_tile(ws_ptr, c_ptr, tl.program_id(0) * BM, tl.program_id(1) * BN, M, N, BM, BN, SPLIT, EMULATE, BM, WIDE)


@triton.jit(do_not_specialize=["M"])
def _split_reduce_group_kernel(ws_ptr, c0_ptr, c1_ptr, c2_ptr, M, N0, N1, N2, BM: tl.constexpr, BN: tl.constexpr,
                               SPLIT0: tl.constexpr, SPLIT: tl.constexpr, EMULATE: tl.constexpr, NB: tl.constexpr,
                               PDL: tl.constexpr):
    """_split_reduce_kernel for _gemm_split_group_kernel's partials (weight 0's SPLIT0, the others' SPLIT), weight
    program_id(2) into its output c_i."""
    pdl_start(PDL)
    b = tl.program_id(2)
    om, on = tl.program_id(0) * BM, tl.program_id(1) * BN
    if b == 0:
        _sum_tile(ws_ptr, c0_ptr, om, on, M, N0, BM, BN, SPLIT0, EMULATE, BM)
    elif b == 1:
        _sum_tile(ws_ptr + (SPLIT0 * M * N0).to(tl.int64), c1_ptr, om, on, M, N1, BM, BN, SPLIT, EMULATE, BM)
    elif NB > 2:
        _sum_tile(ws_ptr + (SPLIT0 * M * N0 + SPLIT * M * N1).to(tl.int64), c2_ptr, om, on, M, N2, BM, BN, SPLIT,
                  EMULATE, BM)
