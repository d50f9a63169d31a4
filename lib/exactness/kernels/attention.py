"""Kernel class ``attention``: causal grouped-query attention over the KV cache, scores and values.

Signature: ``attention(q [M, Hq, D], k_cache [S, T, Hkv, D], v_cache [S, T, Hkv, D], slots [M] int64,
positions [M] int64) -> o [M, Hq, D]`` in the storage dtype. Row m attends to the keys at positions 0..positions[m]
of cache slot slots[m]; the cache already holds the rows' own keys. Scale 1/sqrt(D) (Vaswani et al. 2017).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .tiles import TILE_ROWS, pad_rows

KV_BLOCK = 256  # keys per online-softmax block, shared by the invariant prompt and decode kernels


def _groups(slots: torch.Tensor):
    """(slot, row indices) in ascending slot order."""
    for s in torch.unique(slots).tolist():
        yield s, (slots == s).nonzero().flatten()


def attention_fast_decode(q, k_cache, v_cache, slots, positions):
    """One scaled_dot_product_attention call per row over that row's keys (the library picks its algorithm)."""
    out = torch.empty_like(q)
    for m in range(q.shape[0]):
        s, p = int(slots[m]), int(positions[m])
        k = k_cache[s, :p + 1].transpose(0, 1)[None]          # [1, Hkv, p+1, D]
        v = v_cache[s, :p + 1].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q[m][None, :, None, :], k, v, enable_gqa=True)  # [1, Hq, 1, D]
        out[m] = o[0, :, 0, :]
    return out


def attention_fast_prompt(q, k_cache, v_cache, slots, positions):
    """One scaled_dot_product_attention call per slot with a boolean causal mask built from the positions."""
    out = torch.empty_like(q)
    for s, rows in _groups(slots):
        pos = positions[rows]                                  # [m]
        T = int(pos.max()) + 1
        k = k_cache[s, :T].transpose(0, 1)[None]              # [1, Hkv, T, D]
        v = v_cache[s, :T].transpose(0, 1)[None]
        mask = torch.arange(T, device=q.device)[None, :] <= pos[:, None]   # [m, T] bool
        o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], k, v, attn_mask=mask, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out


def _attend_tile(q, k, v, pos):
    """Online softmax (Milakov & Gimelshein 2018, arXiv 1805.02867) over KV_BLOCK-key blocks in ascending order.

    q [t <= 64, Hq, D] storage dtype; k, v [T, Hkv, D]; pos [t]. Every call sees a [Hq, 64, D] x [Hq, D, KV_BLOCK]
    problem, so a row's bytes depend on neither its tile mates nor its place in the tile.
    """
    t, Hq, D = q.shape
    g = Hq // k.shape[1]
    qh = pad_rows(q).float().transpose(0, 1)                   # [Hq, 64, D] fp32
    pos_p = torch.cat([pos, pos.new_full((TILE_ROWS - t,), -1)])  # padded rows attend to nothing
    m = torch.full((Hq, TILE_ROWS, 1), -math.inf, device=q.device)
    l = torch.zeros(Hq, TILE_ROWS, 1, device=q.device)
    acc = torch.zeros(Hq, TILE_ROWS, D, device=q.device)
    scale = 1.0 / math.sqrt(D)
    for b0 in range(0, int(pos.max()) + 1, KV_BLOCK):
        kb = pad_rows(k[b0:b0 + KV_BLOCK], KV_BLOCK).float().repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq,B,D]
        vb = pad_rows(v[b0:b0 + KV_BLOCK], KV_BLOCK).float().repeat_interleave(g, dim=1).transpose(0, 1)
        keys = b0 + torch.arange(KV_BLOCK, device=q.device)
        valid = keys[None, :] <= pos_p[:, None]               # [64, B] bool
        s = torch.bmm(qh, kb.transpose(1, 2)) * scale          # [Hq, 64, B] fp32
        s = s.masked_fill(~valid[None], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new)
        l_new = l * alpha + p.sum(dim=-1, keepdim=True)
        acc_new = acc * alpha + torch.bmm(p, vb)
        active = (pos_p >= b0)[None, :, None]                  # rows with a key in this block
        m, l, acc = torch.where(active, m_new, m), torch.where(active, l_new, l), torch.where(active, acc_new, acc)
    return (acc / l).transpose(0, 1)[:t].to(q.dtype)          # [t, Hq, D]


def attention_invariant(q, k_cache, v_cache, slots, positions):
    """Per slot, rows in 64-row tiles, keys in fixed KV_BLOCK blocks in ascending order (decode = one-row tile)."""
    out = torch.empty_like(q)
    for s, rows in _groups(slots):
        for i in range(0, rows.numel(), TILE_ROWS):
            r = rows[i:i + TILE_ROWS]
            out[r] = _attend_tile(q[r], k_cache[s], v_cache[s], positions[r])
    return out
