"""Kernel class ``attention``: causal grouped-query attention over the KV cache, scores and values.

Signature: ``attention(q [M, Hq, D], k_cache [S, T, Hkv, D], v_cache [S, T, Hkv, D], slots [M] int64,
positions [M] int64) -> o [M, Hq, D]`` in the storage dtype. Row m attends to the keys at positions 0..positions[m]
of cache slot slots[m]; the cache already holds the rows' own keys. Scale 1/sqrt(D) (Vaswani et al. 2017).

An fp8 KV cache (cache.py: kv_dtype ``fp8_e4m3`` / ``fp8_e4m3_block``) is uint8 ``[S, T, Hkv, D + 4]`` (codes, then
each row's fp32 scale); every kernel here dequantizes the rows it reads (cache.kv_rows) and is otherwise unchanged,
so the invariant kernel reads an fp8 cache with the same KV blocks for prompt and decode rows. Slots are attended
separately, so rows of different sequences in one call (a packed prefill, a decode batch) never see each other.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..cache import kv_rows
from .tiles import pad_rows

KV_BLOCK = 256  # keys per online-softmax block, shared by the invariant prompt and decode kernels

# The backends the fast set lets scaled_dot_product_attention choose from: all but cuDNN's, which builds an
# execution plan for every new key length (host time far above the attention's own), and a decode loop or a
# chunked prefill meets a new key length at every call.
FAST_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def _groups(slots: torch.Tensor):
    """(slot, row indices) in ascending slot order."""
    for s in torch.unique(slots).tolist():
        yield s, (slots == s).nonzero().flatten()


def attention_fast_decode(q, k_cache, v_cache, slots, positions):
    """One scaled_dot_product_attention call per row over that row's keys (the library picks its algorithm among
    FAST_SDPA_BACKENDS)."""
    out = torch.empty_like(q)
    with sdpa_kernel(list(FAST_SDPA_BACKENDS)):
        for m in range(q.shape[0]):
            s, p = int(slots[m]), int(positions[m])
            k = kv_rows(k_cache[s, :p + 1], q.dtype).transpose(0, 1)[None]          # [1, Hkv, p+1, D]
            v = kv_rows(v_cache[s, :p + 1], q.dtype).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q[m][None, :, None, :], k, v, enable_gqa=True)  # [1, Hq, 1, D]
            out[m] = o[0, :, 0, :]
    return out


def attention_fast_prompt(q, k_cache, v_cache, slots, positions):
    """One scaled_dot_product_attention call per slot with a boolean causal mask built from the positions (the
    library picks its algorithm among FAST_SDPA_BACKENDS).

    The KV heads are repeated to the query heads rather than passed with ``enable_gqa``: on CUDA, of the backends
    allowed, only the math one takes a mask together with ``enable_gqa``, and it materialises the fp32 scores
    [Hq, m, T] (quadratic in the chunk's rows); with repeated heads the memory-efficient backend takes the mask and
    keeps no scores. On the CPU both forms give the same bytes."""
    out = torch.empty_like(q)
    g = q.shape[1] // k_cache.shape[2]                             # query heads per KV head
    with sdpa_kernel(list(FAST_SDPA_BACKENDS)):
        for s, rows in _groups(slots):
            pos = positions[rows]                                  # [m]
            T = int(pos.max()) + 1
            k = kv_rows(k_cache[s, :T], q.dtype).transpose(0, 1)[None]              # [1, Hkv, T, D]
            v = kv_rows(v_cache[s, :T], q.dtype).transpose(0, 1)[None]
            mask = torch.arange(T, device=q.device)[None, :] <= pos[:, None]   # [m, T] bool
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)      # [1, Hq, T, D]
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k, v, attn_mask=mask)
            out[rows] = o[0].transpose(0, 1)
    return out


ATT_ROWS = 8  # query rows per invariant attention tile (a decode row is padded to this many)
# fp32 temporaries of the tiles attended in one call, at most (_tile_groups): each tile beyond the first repeats the
# blocks' keys and values, so tiles share a call where their op overhead outweighs that copy (small heads, short
# contexts) and run one by one where it does not; past a few MiB the temporaries leave the CPU's caches and a
# shared call is slower than its tiles one by one (benchmarks/bench_invariant_cpu.py --budgets).
ATT_BATCH_BYTES = 4 << 20


def _blocks(x: torch.Tensor, nblk: int, g: int) -> torch.Tensor:
    """Cache rows x [T, Hkv, D] (or packed fp8 [T, Hkv, D + 4]) -> fp32 [nblk, Hq, KV_BLOCK, D] (zero-padded, kv
    heads repeated for GQA)."""
    x = pad_rows(kv_rows(x[:nblk * KV_BLOCK], torch.float32), KV_BLOCK)[:nblk * KV_BLOCK]   # [nblk*B, Hkv, D']
    _, hkv, d = x.shape
    out = torch.empty(nblk, hkv, g, KV_BLOCK, d, dtype=torch.float32, device=x.device)
    out.copy_(x.view(nblk, KV_BLOCK, hkv, 1, d).permute(0, 2, 3, 1, 4).expand_as(out))   # widened in the copy
    return out.view(nblk, hkv * g, KV_BLOCK, d)                                        # query head h*g + j


def _attend_tiles(q, kb, vb, pos):
    """Softmax attention of t query rows, in ceil(t / ATT_ROWS) tiles of ATT_ROWS rows, over KV_BLOCK-key blocks,
    with every reduction fixed.

    q [t, Hq, D] storage dtype; kb, vb [nblk, Hq, B, D] fp32 (see _blocks); pos [t]. Per tile and block, scores and
    values are batched GEMMs of fixed item shape [8, D] x [D, B] and [8, B] x [B, D] (every tile's items in one
    call, the blocks' keys and values repeated per tile); the row max is exact; the per-block partial sums (fixed
    length B) are combined across blocks by a sequential cumulative sum in block order. Blocks past a row's position
    contribute exact zeros, so a row's bytes depend on neither the tile mates, the place in the tile, how many blocks
    the tile spans, nor how many tiles share the call. Scale 1/sqrt(D).
    """
    t, Hq, D = q.shape
    nblk, B, n = kb.shape[0], KV_BLOCK, -(-t // ATT_ROWS)
    qh = pad_rows(q, ATT_ROWS).float().view(n, ATT_ROWS, Hq, D).transpose(1, 2)       # [n, Hq, 8, D] fp32
    pos_p = pad_rows(pos, ATT_ROWS)                                                   # padded rows attend to key 0
    qx = qh[:, None].expand(n, nblk, Hq, ATT_ROWS, D).reshape(-1, ATT_ROWS, D)        # [n*nblk*Hq, 8, D]
    kx = kb.view(1, -1, B, D).expand(n, -1, B, D).reshape(-1, B, D)                   # [n*nblk*Hq, B, D]
    s = torch.bmm(qx, kx.transpose(1, 2))                                             # [n*nblk*Hq, 8, B]
    s = (s.view(n, nblk, Hq, ATT_ROWS, B).permute(0, 2, 3, 1, 4).reshape(n, Hq, ATT_ROWS, nblk * B)
         * (1.0 / math.sqrt(D)))
    valid = torch.arange(nblk * B, device=q.device)[None, :] <= pos_p[:, None]       # [n*8, nblk*B] bool
    s = s.masked_fill(~valid.view(n, 1, ATT_ROWS, nblk * B), -math.inf)
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))                                  # [n, Hq, 8, nblk*B] fp32
    pb = p.view(n, Hq, ATT_ROWS, nblk, B)
    l = torch.cumsum(pb.sum(dim=-1), dim=-1)[..., -1]                                # [n, Hq, 8]
    vx = vb.view(1, -1, B, D).expand(n, -1, B, D).reshape(-1, B, D)                   # [n*nblk*Hq, B, D]
    ob = torch.bmm(pb.permute(0, 3, 1, 2, 4).reshape(-1, ATT_ROWS, B), vx)           # [n*nblk*Hq, 8, D]
    o = torch.cumsum(ob.view(n, nblk, Hq, ATT_ROWS, D), dim=1)[:, -1]                # [n, Hq, 8, D]
    out = (o / l[..., None]).transpose(1, 2).reshape(n * ATT_ROWS, Hq, D)
    return out[:t].to(q.dtype)                                                        # [t, Hq, D]


def _tile_groups(pos: torch.Tensor, Hq: int, D: int):
    """The call's rows (positions pos [m], in order) as (start, stop, blocks): runs of whole ATT_ROWS-row tiles
    that need the same number of key blocks, each run's fp32 temporaries (scores, probabilities, repeated keys and
    values: about 4 Hq nb B (4 ATT_ROWS + 2 D) bytes a tile) at most ATT_BATCH_BYTES where a tile fits."""
    m = pos.numel()
    need = (pad_rows(pos, ATT_ROWS).view(-1, ATT_ROWS).amax(dim=1) // KV_BLOCK + 1).tolist()   # per tile
    start = 0
    while start < len(need):
        nb = need[start]
        cap = max(1, ATT_BATCH_BYTES // (4 * Hq * nb * KV_BLOCK * (4 * ATT_ROWS + 2 * D)))   # tiles per call
        stop = start + 1
        while stop < len(need) and need[stop] == nb and stop - start < cap:
            stop += 1
        yield start * ATT_ROWS, min(stop * ATT_ROWS, m), nb
        start = stop


def attention_invariant(q, k_cache, v_cache, slots, positions):
    """Per slot, rows in ATT_ROWS-row tiles over fixed KV_BLOCK key blocks (decode = a one-row tile), the tiles
    that span as many blocks attended in one call."""
    out = torch.empty_like(q)
    g = q.shape[1] // k_cache.shape[2]
    for s, rows in _groups(slots):
        pos = positions[rows]
        nblk = int(pos.max()) // KV_BLOCK + 1
        kb, vb = _blocks(k_cache[s], nblk, g), _blocks(v_cache[s], nblk, g)          # [nblk, Hq, B, D] fp32
        groups = [(0, pos.numel(), nblk)] if pos.numel() <= ATT_ROWS else _tile_groups(pos, *q.shape[1:])
        for lo, hi, nb in groups:
            r = rows[lo:hi]
            out[r] = _attend_tiles(q[r], kb[:nb], vb[:nb], pos[lo:hi])
    return out


def reads_fp8(fn):
    """``fn`` (an attention kernel for caches in the model dtype) that also reads an fp8 cache, dequantized to fp32
    as every kernel here reads it (cache.kv_rows). On CUDA ``fn`` runs in fp32 on the whole cache dequantized (an
    elementwise map, so every call sees the same key and value bytes whatever its rows; no host sync, so it can be
    recorded in a graph) and its output is rounded once to q's dtype; elsewhere attention_invariant runs."""
    def attention(q, k_cache, v_cache, slots, positions):
        if k_cache.dtype != torch.uint8:
            return fn(q, k_cache, v_cache, slots, positions)
        if q.device.type == "cuda":
            f32 = torch.float32
            return fn(q.to(f32), kv_rows(k_cache, f32), kv_rows(v_cache, f32), slots, positions).to(q.dtype)
        return attention_invariant(q, k_cache, v_cache, slots, positions)
    attention.__doc__ = fn.__doc__
    attention.__name__ = getattr(fn, "__name__", "attention")
    captures = getattr(fn, "captures", None)
    if captures is not None:   # an fp8 cache is read through its dequantized copy, made outside any graph
        attention.captures = lambda k_cache, rows: k_cache.dtype != torch.uint8 and captures(k_cache, rows)
    return attention
