"""The Triton programs of triton_attention's batch-invariant attention: a block of keys (masked or, where every row
sees it whole, not), a chunk's online-softmax state, the two-state merge, and the kernels built from them (one
program per (query head, tile), the split-KV chunk programs and their combine). triton_attention.py holds the
configs and the launch wrappers and documents the invariance device and the arithmetic.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_rows import dot_operand, pdl_start, round_to


@triton.jit
def _kv_block(src, slot, b0, kvh, kv_off, keys, d, T, sk_t, D: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
              KV_TMA: tl.constexpr):
    """Keys/values b0..b0+BN-1 of (slot, kv head) as [BN, BD]; positions >= T read as 0."""
    if KV_TMA:
        blk = src.load([slot, b0, kvh * D]).reshape(BN, BD)      # 3-D box [1, BN, D]; TMA zero-fills t >= T
    else:
        mask = (keys[:, None] < T) & (d[None, :] < D)
        blk = tl.load(src + kv_off + keys[:, None] * sk_t + d[None, :], mask=mask, other=0.0)
    return blk


@triton.jit
def _tile_rows(pos_ptr, rows_ptr, tstart_ptr, tlen_ptr, tslot_ptr, t, M, j, RPT: tl.constexpr,
               GROUPED: tl.constexpr):
    """Row ids, validity and positions (-1 where not valid) of tile t's lanes, lane i holding the tile's row j[i]
    (of RPT rows per tile), and the tile's cache slot.

    GROUPED: 0 = one slot, tile t holds rows t*RPT..; 1 = rows grouped by slot (_tiles: rows, tstart, tlen,
    tslot); 2 = one row per tile, row t, its slot read from tslot_ptr[t] (no host read)."""
    if GROUPED == 2:
        rows = t + j * 0
        valid = j == 0
        slot = tl.load(tslot_ptr + t).to(tl.int32)
    elif GROUPED == 1:
        start = tl.load(tstart_ptr + t)
        valid = j < tl.load(tlen_ptr + t)
        slot = tl.load(tslot_ptr + t).to(tl.int32)
        rows = tl.load(rows_ptr + start + j, mask=valid, other=0).to(tl.int32)
    else:
        rows = t * RPT + j
        valid = rows < M
        slot = 0
    pos = tl.load(pos_ptr + rows, mask=valid, other=-1).to(tl.int32)           # [BM] (int32: fewer registers)
    return rows, valid, pos, slot


@triton.jit
def _row_sum(pv, BN: tl.constexpr, PRECISION: tl.constexpr):
    """[BM] fp32 sums of the rows of pv [BM, BN] (the rounded softmax weights) as pv @ ones [BN, 16] (the smallest
    MMA width), so the sum keeps the MMA's order whatever the tile's warps (triton_attention's Precision); its 16
    columns are equal and max picks one exactly."""
    ones = tl.full((BN, 16), 1.0, dtype=pv.dtype)
    return tl.max(tl.dot(pv, ones, input_precision=PRECISION), axis=1)


@triton.jit
def _block_step(q, k_src, v_src, slot, kvh, kv_off, pos, b0, m_i, l_i, acc, d, T, sk_t, scale, D: tl.constexpr,
                BD: tl.constexpr, BN: tl.constexpr, KV_TMA: tl.constexpr, PRECISION: tl.constexpr,
                EMULATE: tl.constexpr, MASKED: tl.constexpr):
    """The online-softmax state after keys b0..b0+BN-1. MASKED = False only for a block whose keys every lane may see:
    there the masks select every element unchanged (s stays s, m is finite so m_safe = m, every lane is active), so
    leaving them out gives the masked step's bytes."""
    keys = b0 + tl.arange(0, BN)
    k = _kv_block(k_src, slot, b0, kvh, kv_off, keys, d, T, sk_t, D, BN, BD, KV_TMA)              # [BN, BD]
    s = tl.dot(dot_operand(q, EMULATE), dot_operand(k, EMULATE).T, input_precision=PRECISION) * scale
    if MASKED:
        s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))                          # [BM, BN] fp32
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = m_new
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    v = _kv_block(v_src, slot, b0, kvh, kv_off, keys, d, T, sk_t, D, BN, BD, KV_TMA)              # [BN, BD]
    pv = dot_operand(round_to(p, v.dtype, EMULATE), EMULATE)                                   # 0 if inactive
    l_new = l_i * alpha + _row_sum(pv, BN, PRECISION)
    active = pos >= b0                                                                         # a key here
    if MASKED:
        alpha = tl.where(active, alpha, 1.0)
    acc = tl.dot(pv, dot_operand(v, EMULATE), acc * alpha[:, None], input_precision=PRECISION)
    if MASKED:
        m_new = tl.where(active, m_new, m_i)
        l_new = tl.where(active, l_new, l_i)
    return m_new, l_new, acc


@triton.jit
def _seen_by_all(pos, BN: tl.constexpr):
    """The end of the leading blocks of BN keys that every valid lane (pos >= 0) may see whole: BN * floor((min pos
    + 1) / BN); 2^30 where no lane is valid (a tile that runs no block)."""
    lo = tl.min(tl.where(pos >= 0, pos, 1 << 30), axis=0)
    return (lo + 1) // BN * BN


@triton.jit
def _chunk_state(q, k_src, v_src, slot, kvh, kv_off, pos, c0, c1, full, d, T, sk_t, scale, D: tl.constexpr,
                 BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KV_TMA: tl.constexpr,
                 PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """Online-softmax state (m [BM], l [BM], acc [BM, BD], fp32) of keys c0..c1-1 from a fresh start, in BN-key
    blocks ascending; a block holding none of a row's keys leaves the row's state bytes unchanged. Blocks before
    ``full`` (_seen_by_all) run without masks."""
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BD), dtype=tl.float32)
    split = tl.maximum(c0, tl.minimum(c1, full))
    for b0 in range(c0, split, BN):
        m_i, l_i, acc = _block_step(q, k_src, v_src, slot, kvh, kv_off, pos, b0, m_i, l_i, acc, d, T, sk_t, scale,
                                    D, BD, BN, KV_TMA, PRECISION, EMULATE, False)
    for b0 in range(split, c1, BN):
        m_i, l_i, acc = _block_step(q, k_src, v_src, slot, kvh, kv_off, pos, b0, m_i, l_i, acc, d, T, sk_t, scale,
                                    D, BD, BN, KV_TMA, PRECISION, EMULATE, True)
    return m_i, l_i, acc


@triton.jit
def _merge(m_g, l_g, acc_g, m_c, l_c, acc_c, active):
    """Fold a chunk's state into the running one (rows where ``active``; the others keep theirs): the two-state
    combine of the online softmax (Milakov & Gimelshein 2018), the same fp32 operations wherever it runs."""
    m_new = tl.maximum(m_g, m_c)
    a_g = tl.exp2(m_g - m_new)
    a_c = tl.exp2(m_c - m_new)
    l_new = l_g * a_g + l_c * a_c
    acc_new = acc_g * a_g[:, None] + acc_c * a_c[:, None]
    return tl.where(active, m_new, m_g), tl.where(active, l_new, l_g), tl.where(active[:, None], acc_new, acc_g)


@triton.jit(do_not_specialize=["M", "n_tiles", "T"])
def _attn_kernel(q_ptr, k_src, v_src, o_ptr, pos_ptr, rows_ptr, tstart_ptr, tlen_ptr, tslot_ptr, M, n_tiles, T,
                 sq_m, sq_h, sk_s, sk_t, sk_h, scale, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr, GROUPED: tl.constexpr,
                 KV_TMA: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr):
    """One program per (query head, tile), on one grid axis (no 65,535 limit on the tiles) with the heads fastest:
    the chunks of CH keys in ascending order, each merged as it ends. Tiles run last first (in a causal prompt the
    last rows see the most keys: the longest programs start first)."""
    pdl_start(PDL)
    hq = tl.num_programs(0) // n_tiles
    h = tl.program_id(0) % hq
    t = n_tiles - 1 - tl.program_id(0) // hq
    rows, valid, pos, slot = _tile_rows(pos_ptr, rows_ptr, tstart_ptr, tlen_ptr, tslot_ptr, t, M,
                                        tl.arange(0, BM), BM, GROUPED)
    d = tl.arange(0, BD)
    dmask = d[None, :] < D
    q = tl.load(q_ptr + rows[:, None] * sq_m + h * sq_h + d[None, :], mask=valid[:, None] & dmask, other=0.0)
    kvh = h // G
    kv_off = slot * sk_s + kvh * sk_h
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BD), dtype=tl.float32)
    hi = tl.max(pos, axis=0) + 1
    full = _seen_by_all(pos, BN)
    for c0 in range(0, hi, CH):
        m_c, l_c, acc_c = _chunk_state(q, k_src, v_src, slot, kvh, kv_off, pos, c0, tl.minimum(c0 + CH, hi), full, d,
                                       T, sk_t, scale, D, BD, BM, BN, KV_TMA, PRECISION, EMULATE)
        m_i, l_i, acc = _merge(m_i, l_i, acc, m_c, l_c, acc_c, pos >= c0)
    out = tl.math.div_rn(acc, l_i[:, None])
    tl.store(o_ptr + rows[:, None] * sq_m + h * sq_h + d[None, :], round_to(out, o_ptr.dtype.element_ty, EMULATE),
             mask=valid[:, None] & dmask)


@triton.jit(do_not_specialize=["M", "n_tiles", "T"])
def _attn_split_kernel(q_ptr, k_src, v_src, ws_ptr, ml_ptr, pos_ptr, rows_ptr, tstart_ptr, tlen_ptr, tslot_ptr, M,
                       n_tiles, T, NC, sq_m, sq_h, sk_s, sk_t, sk_h, scale, G: tl.constexpr, D: tl.constexpr,
                       BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr,
                       GROUPED: tl.constexpr, KV_TMA: tl.constexpr, PRECISION: tl.constexpr,
                       EMULATE: tl.constexpr, HPP: tl.constexpr, PDL: tl.constexpr):
    """One program per (tile, head group, chunk): the chunk's state of each lane, stored for _combine_kernel (fp32).

    A head group is HPP query heads of one KV head (HPP = 1: one head; HPP = G: a KV head's whole GQA group, packed
    into the tile's lanes, lane i = (row i // HPP, head i % HPP), so the tile holds BM / HPP rows and reads its keys
    once for all G heads). Each lane's operations are those of an unpacked lane: its state has the same bytes."""
    pdl_start(PDL)
    t = tl.program_id(0)
    lane = tl.arange(0, BM)
    h = tl.program_id(1) * HPP + lane % HPP                                                    # [BM] query head
    c0 = tl.program_id(2) * CH
    rows, valid, pos, slot = _tile_rows(pos_ptr, rows_ptr, tstart_ptr, tlen_ptr, tslot_ptr, t, M, lane // HPP,
                                        BM // HPP, GROUPED)
    hi = tl.max(pos, axis=0) + 1
    if c0 < hi:
        d = tl.arange(0, BD)
        q = tl.load(q_ptr + rows[:, None] * sq_m + h[:, None] * sq_h + d[None, :],
                    mask=valid[:, None] & (d[None, :] < D), other=0.0)
        kvh = tl.program_id(1) * HPP // G
        m_c, l_c, acc_c = _chunk_state(q, k_src, v_src, slot, kvh, slot * sk_s + kvh * sk_h, pos, c0,
                                       tl.minimum(c0 + CH, hi), _seen_by_all(pos, BN), d, T, sk_t, scale, D, BD,
                                       BM, BN, KV_TMA, PRECISION, EMULATE)
        idx = (rows * (tl.num_programs(1) * HPP) + h) * NC + tl.program_id(2)                  # [BM]
        tl.store(ml_ptr + idx * 2, m_c, mask=valid)
        tl.store(ml_ptr + idx * 2 + 1, l_c, mask=valid)
        tl.store(ws_ptr + idx[:, None] * BD + d[None, :], acc_c, mask=valid[:, None])


@triton.jit(do_not_specialize=["M"])
def _combine_kernel(ws_ptr, ml_ptr, o_ptr, pos_ptr, M, NC, sq_m, sq_h, D: tl.constexpr, BD: tl.constexpr,
                    BR: tl.constexpr, CH: tl.constexpr, STAGES: tl.constexpr, EMULATE: tl.constexpr,
                    PDL: tl.constexpr):
    """BR rows of one query head: their chunk states merged in ascending chunk order as _attn_kernel merges them
    (STAGES chunks' loads in flight)."""
    pdl_start(PDL)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    valid = r < M
    pos = tl.load(pos_ptr + r, mask=valid, other=-1).to(tl.int32)
    d = tl.arange(0, BD)
    m_i = tl.full((BR,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BR,), dtype=tl.float32)
    acc = tl.zeros((BR, BD), dtype=tl.float32)
    for c in tl.range(0, tl.cdiv(tl.max(pos, axis=0) + 1, CH), num_stages=STAGES):
        act = valid & (pos >= c * CH)
        idx = (r * tl.num_programs(1) + h) * NC + c
        m_c = tl.load(ml_ptr + idx * 2, mask=act, other=float("-inf"))
        l_c = tl.load(ml_ptr + idx * 2 + 1, mask=act, other=0.0)
        acc_c = tl.load(ws_ptr + idx[:, None] * BD + d[None, :], mask=act[:, None], other=0.0)
        m_i, l_i, acc = _merge(m_i, l_i, acc, m_c, l_c, acc_c, act)
    out = tl.math.div_rn(acc, l_i[:, None])
    tl.store(o_ptr + r[:, None] * sq_m + h * sq_h + d[None, :], round_to(out, o_ptr.dtype.element_ty, EMULATE),
             mask=valid[:, None] & (d[None, :] < D))
