"""Row kernels that run several kernel classes' calls in one Triton launch (CUDA), with the bytes of those calls:

- ``qk_norm_rope``: per-head query/key RMSNorm then RoPE, triton_rows.rmsnorm then triton_rows.rope on the queries
  and on the keys, where those take four launches;
- ``residual_norm``: the residual add then the next RMSNorm (norm.residual_add, then triton_rows.rmsnorm of the
  sum), where those take two;
- ``combine_residual_norm``: the MoE combine of the experts' outputs (triton_moe_rows.combine), then the residual add
  and the next RMSNorm, where those take two (the combine, then residual_norm).

Each normalises a row on the rmsnorm kernel's block (triton_rows._row_block of the row width: the same rows per
program, block width and warps, loads of the same shape and the same ``tl.sum``), so that its mean of squares is
summed in that kernel's order; that Triton lays both out alike is checked, not guaranteed: the GPU tests compare
every row's bytes (tests/test_fused_options.py). Everything after that sum is elementwise with contraction off,
so its bytes follow from the operations. qk_norm_rope rounds and weights the normalised halves as rmsnorm does and
rotates them with the rope kernel's products and sums; the queries' and the keys' programs share one launch (the
first programs take query rows, the rest key rows). residual_norm rounds each sum to the storage dtype as the add
does (fp32 sum, rounded once), stores it, and normalises it; combine_residual_norm first sums each row's experts'
outputs as the combine kernel does (elementwise, so any lane order gives its bytes) and rounds that sum once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_cache
from .triton_rows import (_NO_FMA, INTERPRET, _row_block, cdiv, launch, pdl_start, rms_scale, rotate_half,
                          round_to, scale_rows)


@triton.jit
def _head_rows(x_ptr, w_ptr, o_ptr, pos_ptr, cos_ptr, sin_ptr, tile, R, NH, D, L, eps,
               BR: tl.constexpr, BD: tl.constexpr, EMULATE: tl.constexpr):
    """Rows tile*BR .. of x [R = M*NH, D]: rmsnorm (as triton_rows._rmsnorm_kernel) then rope (as _rope_kernel),
    stored to o; returns the two halves stored ([BR, BD/2] each, o's dtype)."""
    rows = tile * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    dt = o_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)   # [BR, BD]
    r = rms_scale(x, D, eps)                                                                   # [BR, 1]
    HALF = D // 2
    d = tl.arange(0, BD // 2)
    hmask = (rows[:, None] < R) & (d[None, :] < HALF)
    base = rows[:, None] * D + d[None, :]
    w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    x1 = tl.load(x_ptr + base, mask=hmask, other=0.0).to(tl.float32)                    # [BR, D/2]
    x2 = tl.load(x_ptr + base + HALF, mask=hmask, other=0.0).to(tl.float32)
    n1 = scale_rows(x1, r, w1, dt, EMULATE).to(tl.float32)
    n2 = scale_rows(x2, r, w2, dt, EMULATE).to(tl.float32)
    p = tl.load(pos_ptr + rows // NH, mask=rows < R, other=0)                                  # [BR]
    ok = (p >= 0) & (p < L)
    p = tl.where(ok, p, 0)[:, None]
    c1 = tl.load(cos_ptr + p * D + d[None, :], mask=hmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + p * D + HALF + d[None, :], mask=hmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + p * D + d[None, :], mask=hmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + p * D + HALF + d[None, :], mask=hmask, other=0.0).to(tl.float32)
    o1, o2 = rotate_half(n1, n2, c1, c2, s1, s2, dt, EMULATE)
    nan = float("nan")
    o1 = round_to(tl.where(ok[:, None], o1, nan), dt, EMULATE)
    o2 = round_to(tl.where(ok[:, None], o2, nan), dt, EMULATE)
    tl.store(o_ptr + base, o1, mask=hmask)
    tl.store(o_ptr + base + HALF, o2, mask=hmask)
    return o1, o2


@triton.jit
def _cache_rows(s_ptr, pos_ptr, rows, R, NH, D, S, T):
    """[BR] int64 offset of each head row's (slot, position, head) in a cache [S, T, NH, D], and [BR] whether it is
    stored: a row of the call whose slot and position are inside the cache (as triton_cache's store)."""
    m = rows // NH
    slot = tl.load(s_ptr + m, mask=rows < R, other=-1)
    pos = tl.load(pos_ptr + m, mask=rows < R, other=-1)
    keep = (rows < R) & (slot >= 0) & (slot < S) & (pos >= 0) & (pos < T)
    return ((slot * T + pos) * NH + rows % NH) * D, keep


@triton.jit(do_not_specialize=["M", "S", "T"])
def _qk_norm_rope_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr, v_ptr, kc_ptr,
                         vc_ptr, s_ptr, M, HQ, HK, D, L, S, T, eps, BR: tl.constexpr, BD: tl.constexpr,
                         STORE: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr):
    """Query tiles, then key tiles; with STORE each key row also goes to the key cache kc [S, T, HK, D] at its (slot,
    position), and value tiles after them copy v's rows (integers: bytes unchanged) to vc."""
    pdl_start(PDL)
    tile = tl.program_id(0)
    q_tiles = tl.cdiv(M * HQ, BR)
    k_tiles = tl.cdiv(M * HK, BR)
    if tile < q_tiles:
        _head_rows(q_ptr, wq_ptr, qo_ptr, pos_ptr, cos_ptr, sin_ptr, tile, M * HQ, HQ, D, L, eps, BR, BD, EMULATE)
    elif tile < q_tiles + k_tiles:
        o1, o2 = _head_rows(k_ptr, wk_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr, tile - q_tiles, M * HK, HK, D, L, eps,
                            BR, BD, EMULATE)
        if STORE:
            dst, keep = _cache_rows(s_ptr, pos_ptr, (tile - q_tiles) * BR + tl.arange(0, BR), M * HK, HK, D, S, T)
            half = tl.arange(0, BD // 2)
            hm = keep[:, None] & (half[None, :] < D // 2)
            tl.store(kc_ptr + dst[:, None] + half[None, :], o1, mask=hm)
            tl.store(kc_ptr + dst[:, None] + D // 2 + half[None, :], o2, mask=hm)
    elif STORE:
        rows = (tile - q_tiles - k_tiles) * BR + tl.arange(0, BR)
        vdst, vkeep = _cache_rows(s_ptr, pos_ptr, rows, M * HK, HK, D, S, T)
        col = tl.arange(0, BD)
        vm = vkeep[:, None] & (col[None, :] < D)
        tl.store(vc_ptr + vdst[:, None] + col[None, :], tl.load(v_ptr + rows[:, None] * D + col[None, :], mask=vm),
                 mask=vm)


def serves(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, positions: torch.Tensor,
           cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether qk_norm_rope takes these: q [M, Hq, D] and k [M, Hk, D] (D even) of one float dtype on one CUDA device
    (the CPU under the interpreter), weights [D] and tables cos, sin [L, D] of that dtype, positions [M] int64."""
    if q.dim() != 3 or k.dim() != 3:
        return False
    M, _, D = q.shape
    ts = (q, k, wq, wk, cos, sin)
    return ((q.is_cuda or INTERPRET) and all(t.device == q.device and t.dtype == q.dtype for t in ts)
            and q.dtype in (torch.bfloat16, torch.float16, torch.float32) and D % 2 == 0 and k.shape[0] == M
            and k.shape[2] == D and wq.shape == (D,) and wk.shape == (D,) and cos.dim() == 2 and cos.shape[1] == D
            and sin.shape == cos.shape and positions.shape == (M,) and positions.dtype == torch.int64
            and positions.device == q.device)


def _store_args(store: tuple, k: torch.Tensor, positions: torch.Tensor) -> tuple | None:
    """(v, key cache, value cache, slots) for the launch (the values and their cache as integers: a copy), or None
    where triton_cache's store would not take the caches with these rows (triton_cache.serves)."""
    k_cache, v_cache, slots, v = store
    if not triton_cache.serves(k_cache, v_cache, slots, positions, k, v):
        return None
    it = triton_cache._INTS[k.element_size()]
    return v.contiguous().view(it), k_cache, v_cache.view(it), slots.contiguous()


def try_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                     positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, store: tuple | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """qk_norm_rope where serves() takes the tensors (and _store_args the store), else None (nothing launched)."""
    if not serves(q, k, wq, wk, positions, cos, sin):
        return None
    st = None if store is None else _store_args(store, k, positions)
    if store is not None and st is None:
        return None
    M, HQ, D = q.shape
    HK = k.shape[1]
    qc, kc = q.contiguous(), k.contiguous()
    qo, ko = torch.empty_like(qc), torch.empty_like(kc)
    if M:
        br, bd, warps = _row_block(D)
        v, k_cache, v_cache, slots = st or (qc, qc, qc, positions)           # unread without a store
        args = (qc, kc, wq.contiguous(), wk.contiguous(), qo, ko, positions.contiguous(), cos, sin, v, k_cache,
                v_cache, slots, M, HQ, HK, D, cos.shape[0], k_cache.shape[0], k_cache.shape[1], float(eps))
        key = (_qk_norm_rope_kernel, q.dtype, HQ, HK, D, cos.shape[0] % 16 == 0, cos.shape[0] == 1,
               st is None) + tuple(t.data_ptr() % 16 == 0 for t in args[:13])            # M, S, T: any
        k_tiles = cdiv(M * HK, br)
        launch(_qk_norm_rope_kernel, (cdiv(M * HQ, br) + k_tiles * (1 if st is None else 2),), args,
               dict(BR=br, BD=bd, STORE=st is not None, EMULATE=INTERPRET), key=key, num_warps=warps, **_NO_FMA)
    return qo, ko


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                 positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, store: tuple | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(rmsnorm(q, wq, eps)), rope(rmsnorm(k, wk, eps))) of triton_rows, bytes and all, in one launch.

    Args:
        q: [M, Hq, D]; k: [M, Hk, D]; wq, wk: [D]; positions: [M] int64; cos, sin: [L, D] tables (rope._table); a
            position outside 0..L-1 yields NaN rows, as triton_rows.rope.
        store: None, or (k_cache, v_cache [S, T, Hk, D] contiguous, slots [M] int64, v [M, Hk, D]) of k's dtype:
            the same launch also writes the normalised, rotated keys and v to the caches at (slots, positions), as
            triton_cache.store would (a row outside the cache is not stored).
    Returns:
        q, k normalised and rotated, [M, Hq, D] and [M, Hk, D] in q's dtype.
    Raises:
        ValueError: tensors serves() does not take, or a store of other shapes, dtypes or devices (their shapes,
            dtypes and devices named).
    """
    out = try_qk_norm_rope(q, k, wq, wk, eps, positions, cos, sin, store)
    if out is None:
        named = (("q", q), ("k", k), ("wq", wq), ("wk", wk), ("positions", positions), ("cos", cos), ("sin", sin))
        named += tuple(zip(("k_cache", "v_cache", "slots", "v"), store or ()))
        got = ", ".join(f"{n} {tuple(t.shape)} {t.dtype} {t.device}" for n, t in named)
        raise ValueError("qk_norm_rope takes q [M, Hq, D] and k [M, Hk, D] (D even) of one float dtype on one CUDA "
                         "device, weights [D], positions [M] int64 and cos/sin [L, D] of that dtype, and a store "
                         "of contiguous caches [S, T, Hk, D] and v [M, Hk, D] of that dtype and slots [M] int64; "
                         f"got {got}")
    return out


@triton.jit
def _add_norm_rows(a, b, w_ptr, x_ptr, h_ptr, offs, mask, cols, H, eps, EMULATE: tl.constexpr):
    """Store x = a + b rounded to the storage dtype (norm.residual_add) and h = rmsnorm(x) (triton_rows'), given a
    and b [BR, BH] fp32 on the rmsnorm kernel's block."""
    dt = x_ptr.dtype.element_ty
    s = round_to(a + b, dt, EMULATE)
    tl.store(x_ptr + offs, s, mask=mask)
    x = s.to(tl.float32)
    r = rms_scale(x, H, eps)                                                                   # [BR, 1]
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, scale_rows(x, r, w[None, :], dt, EMULATE), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _residual_norm_kernel(a_ptr, b_ptr, w_ptr, x_ptr, h_ptr, R, H, eps, BR: tl.constexpr, BH: tl.constexpr,
                          EMULATE: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BH)
    mask = (rows[:, None] < R) & (cols[None, :] < H)
    offs = rows[:, None] * H + cols[None, :]
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)                           # [BR, BH]
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _add_norm_rows(a, b, w_ptr, x_ptr, h_ptr, offs, mask, cols, H, eps, EMULATE)


@triton.jit(do_not_specialize=["R"])
def _combine_residual_norm_kernel(y_ptr, c_ptr, s_ptr, a_ptr, w_ptr, x_ptr, h_ptr, R, H, eps, K: tl.constexpr,
                                  HAS_SHARED: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                                  EMULATE: tl.constexpr, PDL: tl.constexpr):
    """As _residual_norm_kernel with b the MoE combine of each row (triton_moe_rows._combine_kernel's operations):
    fp32 sum over slots 0..K-1 of c * y (no contraction), + shared, rounded to the storage dtype."""
    pdl_start(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BH)
    mask = (rows[:, None] < R) & (cols[None, :] < H)
    offs = rows[:, None] * H + cols[None, :]
    acc = tl.zeros((BR, BH), dtype=tl.float32)
    for j in tl.static_range(K):
        cj = tl.load(c_ptr + rows * K + j, mask=rows < R, other=0.0).to(tl.float32)          # [BR]
        yo = (rows.to(tl.int64)[:, None] * K + j) * H + cols[None, :]
        acc = acc + cj[:, None] * tl.load(y_ptr + yo, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc = acc + tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = round_to(acc, x_ptr.dtype.element_ty, EMULATE).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _add_norm_rows(a, b, w_ptr, x_ptr, h_ptr, offs, mask, cols, H, eps, EMULATE)


def try_residual_norm(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """residual_norm where it takes the tensors (see there), else None (nothing launched)."""
    if not (a.shape == b.shape and a.dim() >= 1 and w.shape == a.shape[-1:] and (a.is_cuda or INTERPRET)
            and all(t.dtype == a.dtype and t.device == a.device for t in (b, w))
            and a.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return None
    H = a.shape[-1]
    ac, bc = a.reshape(-1, H).contiguous(), b.reshape(-1, H).contiguous()                       # [R, H]
    x, h = torch.empty_like(ac), torch.empty_like(ac)
    R = ac.shape[0]
    if R:
        br, bh, warps = _row_block(H)
        wc = w.contiguous()
        key = (_residual_norm_kernel, a.dtype, H) + tuple(t.data_ptr() % 16 == 0 for t in (ac, bc, wc))  # R: any
        launch(_residual_norm_kernel, (cdiv(R, br),), (ac, bc, wc, x, h, R, H, float(eps)),
               dict(BR=br, BH=bh, EMULATE=INTERPRET), key=key, num_warps=warps, **_NO_FMA)
    return x.reshape(a.shape), h.reshape(a.shape)


def residual_norm(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, h) = (a + b, rmsnorm(a + b, w, eps)), the bytes of norm.residual_add then triton_rows.rmsnorm, in one
    launch.

    Args:
        a, b: [..., H] of one float dtype on one CUDA device (the CPU under the interpreter); w: [H] of that dtype.
    Returns:
        x and h, both of a's shape and dtype.
    Raises:
        ValueError: tensors of other shapes, dtypes or devices (named).
    """
    out = try_residual_norm(a, b, w, eps)
    if out is None:
        got = ", ".join(f"{n} {tuple(t.shape)} {t.dtype} {t.device}" for n, t in (("a", a), ("b", b), ("w", w)))
        raise ValueError(f"residual_norm takes a and b [..., H] and w [H] of one float dtype on one CUDA device; "
                         f"got {got}")
    return out


def try_combine_residual_norm(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None, a: torch.Tensor,
                              w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """combine_residual_norm where it takes the tensors (see there), else None (nothing launched)."""
    if y.dim() != 3 or a.dim() != 2:
        return None
    M, k, H = y.shape
    ts = (y, weights, a, w) + (() if shared is None else (shared,))
    if not (weights.shape == (M, k) and a.shape == (M, H) and w.shape == (H,) and k >= 1
            and (shared is None or shared.shape == (M, H)) and (y.is_cuda or INTERPRET)
            and all(t.dtype == y.dtype and t.device == y.device for t in ts)
            and y.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return None
    yc, cc, ac, wc = y.contiguous(), weights.contiguous(), a.contiguous(), w.contiguous()
    sc = ac if shared is None else shared.contiguous()
    x, h = torch.empty_like(ac), torch.empty_like(ac)
    if M:
        br, bh, warps = _row_block(H)
        key = (_combine_residual_norm_kernel, y.dtype, H, k, shared is None) + tuple(
            t.data_ptr() % 16 == 0 for t in (yc, cc, sc, ac, wc))                                  # M: any
        launch(_combine_residual_norm_kernel, (cdiv(M, br),), (yc, cc, sc, ac, wc, x, h, M, H, float(eps)),
               dict(K=k, HAS_SHARED=shared is not None, BR=br, BH=bh, EMULATE=INTERPRET), key=key,
               num_warps=warps, **_NO_FMA)
    return x, h


def combine_residual_norm(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None, a: torch.Tensor,
                          w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, h) = (a + combine(y, weights, shared), rmsnorm(x, w, eps)), the bytes of triton_moe_rows.combine, then
    norm.residual_add, then triton_rows.rmsnorm, in one launch.

    Args:
        y: [M, k, H] the experts' outputs; weights: [M, k] routing weights; shared: [M, H] or None; a: [M, H] the
            residual stream; w: [H]; one float dtype on one CUDA device (the CPU under the interpreter).
    Returns:
        x and h, [M, H] in a's dtype.
    Raises:
        ValueError: tensors of other shapes, dtypes or devices (named).
    """
    out = try_combine_residual_norm(y, weights, shared, a, w, eps)
    if out is None:
        named = (("y", y), ("weights", weights), ("shared", shared), ("a", a), ("w", w))
        got = ", ".join(f"{n} {tuple(t.shape)} {t.dtype} {t.device}" for n, t in named if t is not None)
        raise ValueError("combine_residual_norm takes y [M, k, H], weights [M, k], shared [M, H] or None, a [M, H] "
                         f"and w [H] of one float dtype on one CUDA device; got {got}")
    return out
