"""The invariant set's Triton kernels: prompt rows equal decode (M = 1) bytes, and the values are right.

GPU tests (skipped without CUDA) call the kernels on the ``small`` preset's shapes. CPU tests run the same kernels
under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess so that flag is set before Triton compiles anything)
on small shapes; they are skipped when Triton is not installed. Byte claims compare ``.view(int16/int32)``; error
claims compare ||out - ref|| / ||ref|| against a bound (fp64 reference).
Every exactness check has a negative control that must be caught. A check of the kernels' source (no Triton needed)
holds every kernel to programmatic dependent launch's rule: the wait before anything else.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from interpreted import HAS_TRITON, NEEDS_TRITON, interpreted_rows

GPU = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA device and Triton")
_IV = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers (for bitwise comparison)."""
    t = t.contiguous()
    return t.view(_IV[t.dtype]) if t.dtype in _IV else t


def row_mismatches(full: torch.Tensor, parts: list[torch.Tensor]) -> int:
    """Rows of ``full`` whose bytes differ from the concatenation of ``parts`` (same rows, other calls)."""
    other = torch.cat(parts, dim=0)
    return int((bits(full) != bits(other)).reshape(full.shape[0], -1).any(dim=1).sum())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def chunked(fn, M: int, sizes, *row_args, extra=()):
    """fn over consecutive chunks of the row arguments with the chunk sizes cycling through ``sizes``."""
    out, a, i = [], 0, 0
    while a < M:
        n = sizes[i % len(sizes)]
        out.append(fn(*(r[a:a + n] for r in row_args), *extra))
        a, i = a + n, i + 1
    return out


# ------------------------------------------------------------------------------------------------ GPU

SMALL = {"q": (4096, 2048), "k/v": (512, 2048), "o": (2048, 4096), "gate|up": (768, 2048), "down": (2048, 768),
         "router": (128, 2048), "lm_head": (258, 2048)}


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_linear_prompt_rows_equal_decode_rows(dtype):
    from exactness.kernels import triton_gemm as tg
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (N, K) in SMALL.items():
        w = (torch.randn(N, K, generator=g, device="cuda") / K ** 0.5).to(dtype)
        x = torch.randn(777, K, generator=g, device="cuda").to(dtype)
        full = tg.linear(x, w)                                                              # [777, N]
        assert rel_err(full, x.double() @ w.double().T) < (1e-2 if dtype == torch.bfloat16 else 1e-5), name
        assert row_mismatches(full, [tg.linear(x[m:m + 1], w) for m in range(full.shape[0])]) == 0, name
        assert row_mismatches(full, chunked(tg.linear, 777, (1, 7, 64, 100, 129, 300), x, extra=(w,))) == 0, name


@GPU
@pytest.mark.gpu
def test_gpu_linear_negative_control_is_caught():
    """A prompt GEMM that splits K in two (fp32 partials added, then rounded) must differ from decode rows."""
    from exactness.kernels import triton_gemm as tg
    N, K = SMALL["q"]
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(N, K, generator=g, device="cuda") / K ** 0.5).bfloat16()
    x = torch.randn(256, K, generator=g, device="cuda").bfloat16()
    h = K // 2
    split = (x[:, :h].float() @ w[:, :h].float().T + x[:, h:].float() @ w[:, h:].float().T).bfloat16()
    assert row_mismatches(split, [tg.linear(x[m:m + 1], w) for m in range(256)]) > 0


@GPU
@pytest.mark.gpu
def test_gpu_split_sums_in_each_tiles_last_split_equal_a_sum_launch_and_a_planted_count_is_caught():
    """Split calls sum their partials in each tile's last split (triton_split.split_counts): over 30 rounds of every
    split shape of the small preset at M = 1, 3, 16, 64 and 200, alone, the k/v pair grouped and q in the group
    (its own tile columns and split_k), each call gives the bytes of the sum in a second launch, and the counts are
    back at zero after each round. Control: a count planted at split_k for tile 0 (no split of it counts last)
    leaves that tile unsummed in an output filled with NaN."""
    from exactness.kernels import triton_gemm as tg
    from exactness.kernels import triton_group as tgr
    from exactness.kernels import triton_split as ts
    g = torch.Generator(device="cuda").manual_seed(5)
    ws = {n: (torch.randn(*SMALL[n], generator=g, device="cuda") / SMALL[n][1] ** 0.5).bfloat16()
          for n in ("q", "k/v", "o", "router", "lm_head")}
    kv2 = (torch.randn(*SMALL["k/v"], generator=g, device="cuda") * 0.02).bfloat16()
    xs = {K: torch.randn(200, K, generator=g, device="cuda").bfloat16() for K in (2048, 4096)}

    def run() -> list:
        out = []
        for M in (1, 3, 16, 64, 200):
            out += [tg.linear(xs[w.shape[1]][:M], w) for w in ws.values()]
            out += list(tgr.linear_group(xs[2048][:M], (ws["k/v"], kv2)) or [])
            out += list(tgr.linear_group(xs[2048][:M], (ws["k/v"], ws["q"], kv2)) or [])    # q its own tiles
        return out
    slots, ts.COUNT_SLOTS = ts.COUNT_SLOTS, 0
    try:
        ref = run()                                                           # the sums in second launches
    finally:
        ts.COUNT_SLOTS = slots
    counts = ts.split_counts(xs[2048].device, 1)
    for _ in range(30):
        got = run()
        assert len(got) == len(ref) and [row_mismatches(a, [b]) for a, b in zip(got, ref)] == [0] * len(ref)
        assert int(counts.count_nonzero()) == 0
    w, M, N, K = ws["q"], 1, *SMALL["q"]
    plan = tg.plan_for(xs[K][:M], (w,), "linear", None)
    lp = next(lp for rows, lp in plan.launches if M <= rows)
    assert ts.takes_split(lp, M, N)
    a, aligned = tg.a_operand(xs[K][:M].contiguous(), lp)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    counts[0] = lp.cfg.split_k                              # planted: no split of tile 0 counts split_k - 1
    try:
        ts.run_split(lp, a, out, M, N, K, lp.key if lp.use_tma else (lp.key, aligned))
    finally:
        counts.zero_()
    assert row_mismatches(out, [tg.linear(xs[K][:M], w)]) > 0


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_logits_widened_in_the_split_launch_equal_linear_then_float_and_a_fault_is_caught(dtype):
    """triton_gemm.logits of the lm_head shape at M = 1 to 600 against linear(...).float() (int32 views); the split
    calls store fp32 from their own launch (no copy launch), with the counts and with the sum in a second launch.
    Control: one weight element changed changes exactly its column."""
    from exactness.kernels import triton_gemm as tg
    from exactness.kernels import triton_split as ts
    g = torch.Generator(device="cuda").manual_seed(11)
    N, K = SMALL["lm_head"]
    w = (torch.randn(N, K, generator=g, device="cuda") / K ** 0.5).to(dtype)
    x = torch.randn(600, K, generator=g, device="cuda").to(dtype)
    for M in (1, 3, 16, 64, 200, 600):
        ref = tg.linear(x[:M], w).float()
        assert torch.equal(tg.logits(x[:M], w).view(torch.int32), ref.view(torch.int32)), M
    assert tg._run(x[:1], (w,), "linear", None, wide=True).dtype == torch.float32
    slots, ts.COUNT_SLOTS = ts.COUNT_SLOTS, 0
    try:
        summed = tg.logits(x[:3], w)
    finally:
        ts.COUNT_SLOTS = slots
    assert torch.equal(summed.view(torch.int32), tg.linear(x[:3], w).float().view(torch.int32))
    bad_w = w.clone()
    bad_w[7, 0] += 1.0
    cols = (tg.logits(x[:1], bad_w).view(torch.int32) != tg.logits(x[:1], w).view(torch.int32)).any(dim=0)
    assert cols.tolist() == [j == 7 for j in range(N)]

@GPU
@pytest.mark.gpu
def test_gpu_gate_up_rows_and_rounding_points():
    from exactness.kernels import triton_gemm as tg
    N, K = SMALL["gate|up"]
    g = torch.Generator(device="cuda").manual_seed(2)
    wg, wu = ((torch.randn(N, K, generator=g, device="cuda") / K ** 0.5).bfloat16() for _ in range(2))
    x = torch.randn(600, K, generator=g, device="cuda").bfloat16()
    full = tg.gate_up(x, wg, wu)
    gl, ul = tg.linear(x, wg), tg.linear(x, wu)
    emulated = ((gl.float() / (1 + torch.exp(-gl.float()))).bfloat16().float() * ul.float()).bfloat16()
    diff = (full.float() - emulated.float()).abs()
    # exp differs in the last fp32 bits (Triton's ex2 vs expf): allow a 1-ulp bf16 flip of the SiLU on few elements
    assert int((bits(full) != bits(emulated)).sum()) <= full.numel() // 100, float(diff.max())
    assert row_mismatches(full, [tg.gate_up(x[m:m + 1], wg, wu) for m in range(600)]) == 0
    assert row_mismatches(full, chunked(tg.gate_up, 600, (3, 64, 65, 200), x, extra=(wg, wu))) == 0


@GPU
@pytest.mark.gpu
def test_gpu_every_gemm_placement_gives_each_row_the_shape_configs_bytes():
    """Every placement of gemm_configs.PLACEMENTS (smaller tiles, other warps and stages for small calls, mma.sync
    for 16-row tiles where the shape's config runs wgmma) gives every row the bytes the shape's config gives it, and
    so does the wrapper's own choice by M. Control: the same placement with another split_k (a row's arithmetic)
    differs."""
    from dataclasses import replace
    from exactness.kernels import triton_gemm as tg
    cap = torch.cuda.get_device_capability()
    g = torch.Generator(device="cuda").manual_seed(11)
    checked, control = 0, None
    for kind, N, K, dk, arch in tg.PLACEMENTS:
        if arch != tg.arch_of(cap) or dk != "bf16":
            continue
        w, w2 = ((torch.randn(N, K, generator=g, device="cuda") / K ** 0.5).bfloat16() for _ in range(2))
        x = torch.randn(600, K, generator=g, device="cuda").bfloat16()

        def call(rows, c=None):
            return tg.gate_up(rows, w, w2, config=c) if kind == "gate_up" else tg.linear(rows, w, config=c)
        placed = tg.placements(kind, N, K, torch.bfloat16, cap)
        base = placed[-1][1]
        full = call(x, base)                                                       # [600, N]
        for rows, c in placed[:-1]:
            assert (c.block_k, c.split_k) == (base.block_k, base.split_k), c.label()
            for M in sorted({1, 5, 16, 64, 130, min(rows, 600)}):
                assert row_mismatches(full[:M], [call(x[:M], c)]) == 0, (kind, N, K, c.label(), M)
            checked += 1
            if control is None and kind == "linear" and base.split_k > 1:
                control = row_mismatches(full[:64], [call(x[:64], replace(c, split_k=base.split_k // 2))])
        for M in (1, 16, 64, 300, 512, 600):
            assert row_mismatches(full[:M], [call(x[:M])]) == 0, (kind, N, K, M)
    if not checked:
        pytest.skip(f"no GEMM placements for compute capability {cap}")
    assert control is not None and control > 0                                     # negative control


def _attn_inputs(P: int, S: int, dtype, seed: int, Hq=32, Hkv=4, D=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kc = torch.randn(S, P, Hkv, D, generator=g, device="cuda").to(dtype)
    vc = torch.randn(S, P, Hkv, D, generator=g, device="cuda").to(dtype)
    q = torch.randn(S * P, Hq, D, generator=g, device="cuda").to(dtype)
    slots = torch.arange(S, device="cuda").repeat_interleave(P)
    pos = torch.arange(P, device="cuda").repeat(S)
    return q, kc, vc, slots, pos


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_attention_prompt_rows_equal_decode_rows(dtype):
    from exactness.kernels import attention as cpu_attn
    from exactness.kernels import triton_attention as ta
    q, kc, vc, slots, pos = _attn_inputs(1300, 1, dtype, 3)                                # 3 key chunks
    full = ta.attention(q, kc, vc, slots, pos, split=False)                                 # [1300, 32, 128]
    rows = list(range(0, 1300, 13)) + [63, 64, 127, 128, 255, 256, 511, 512, 1023, 1024, 1299]
    dec = [ta.attention(q[m:m + 1], kc, vc, slots[m:m + 1], pos[m:m + 1]) for m in rows]    # split-KV (decode)
    assert row_mismatches(full[rows], dec) == 0
    assert row_mismatches(full, [ta.attention(q, kc, vc, slots, pos, split=True)]) == 0             # heads packed
    assert row_mismatches(full, [ta.attention(q, kc, vc, slots, pos, split=True, pack=False)]) == 0
    assert row_mismatches(full[rows[:8]], [ta.attention(q[rows[:8]], kc, vc, slots[:8], pos[rows[:8]])]) == 0
    segs = ((0, 1), (1, 50), (51, 129), (180, 300), (480, 220), (700, 600))                # prefill chunks
    assert row_mismatches(full, [ta.attention(q[a:a + n], kc, vc, slots[a:a + n], pos[a:a + n])
                                 for a, n in segs]) == 0
    fine = ta.AttnConfig(**{**ta.config_for(128, dtype, (9, 0)).__dict__, "chunk": 256})   # control: other merge
    assert row_mismatches(ta.attention(q, kc, vc, slots, pos, fine)[rows], dec) > 0
    ref = cpu_attn.attention_invariant(q.double().cpu(), kc.double().cpu(), vc.double().cpu(), slots.cpu(),
                                       pos.cpu())
    assert rel_err(full.cpu(), ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def _state_mismatches(a: tuple, b: tuple, pos: torch.Tensor, Hq: int, chunk: int) -> int:
    """(row, head, chunk) entries of two triton_attention.chunk_states results whose fp32 state (m, l, acc) bytes
    differ, over the chunks each row reaches (the others are never written)."""
    (wa, ma), (wb, mb) = a, b
    M = pos.numel()
    nc = wa.shape[0] // (M * Hq)
    reached = (torch.arange(nc, device=pos.device)[None, :] * chunk <= pos[:, None])             # [M, nc]
    reached = reached[:, None, :].expand(M, Hq, nc).reshape(-1)
    differ = (wa.view(torch.int32) != wb.view(torch.int32)).any(1)
    differ |= (ma.view(torch.int32) != mb.view(torch.int32)).view(-1, 2).any(1)
    return int((differ & reached).sum())


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("hkv", [4, 8])
def test_gpu_every_attention_placement_gives_each_lane_the_configs_chunk_state(hkv):
    """Every entry of triton_attention.SPLIT_PLACEMENTS (fewer lanes and warps for split calls of few rows), and
    placements outside it whose warps split the keys (16 lanes in 2 and 8 warps, 32 in 4), give every row, head and
    chunk the fp32 chunk state (m, l, acc) the config gives it, byte for byte: the softmax sum's order shows there
    before a bf16 output can hide it. One slot (4,100 rows, 9 chunks), one row per tile (two slots) and rows grouped
    by slot. Control: the placement with the score scale one part in 2^20 off differs."""
    from dataclasses import replace
    from exactness.kernels import triton_attention as ta
    cap = torch.cuda.get_device_capability()
    entries = ta.SPLIT_PLACEMENTS.get(ta._key(128, torch.bfloat16, cap), ())
    if not entries:
        pytest.skip(f"no attention placements for compute capability {cap}")
    base = ta.config_for(128, torch.bfloat16, cap)
    q, kc, vc, slots, pos = _attn_inputs(4100, 1, torch.bfloat16, 5, Hkv=hkv)
    q2, kc2, vc2, slots2, pos2 = _attn_inputs(1100, 2, torch.bfloat16, 6, Hkv=hkv)
    calls = [(q, kc, vc, slots, pos)] + [(q2[i], kc2, vc2, slots2[i], pos2[i])
                                         for i in (torch.tensor([1099, 1800]), torch.tensor([3, 1100, 1500, 600, 2199]))]
    outside = [dict(block_m=16, num_warps=2), dict(block_m=16, num_warps=8), dict(block_m=32, num_warps=4)]
    for rows, over in list(entries) + [(None, o) for o in outside]:
        c = replace(base, **over)
        assert (c.block_n, c.chunk) == (base.block_n, base.chunk)
        assert rows is None or ta.split_placement(128, torch.bfloat16, cap, rows) == c
        for qq, k, v, sl, ps in calls:
            want = ta.chunk_states(qq, k, v, sl, ps, base)
            assert _state_mismatches(ta.chunk_states(qq, k, v, sl, ps, c), want, ps, 32, base.chunk) == 0, \
                (c.label(), qq.shape[0])
    want = ta.chunk_states(q, kc, vc, slots, pos, base)
    fault = ta.chunk_states(q, kc, vc, slots, pos, c, scale=128 ** -0.5 * (1 + 2 ** -20))
    assert _state_mismatches(fault, want, pos, 32, base.chunk) > 0                           # negative control


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("per_row", [True, False])
def test_gpu_attention_fp8_cache_prompt_rows_equal_decode_rows(per_row):
    """The invariant set's attention over an fp8 cache (per-row or per-tensor scales): prompt calls of any size,
    one-row decode calls and multi-row decode calls give every row the same bytes, those of the fp32 Triton kernel
    over the cache dequantized to fp32, rounded once to bf16 (control: another chunk merge is caught)."""
    from exactness.cache import kv_rows, quantize
    from exactness.kernels import triton_attention as ta
    from exactness.kernels.registry import get_set
    P = 1300
    q, kc, vc, slots, pos = _attn_inputs(P, 2, torch.bfloat16, 7)
    kq, vq = (quantize(c, None if per_row else 0.01) for c in (kc, vc))                   # uint8 [2, P, 4, 132]
    ks = get_set("invariant")
    prompt, decode = ks.fn("attention", "prompt"), ks.fn("attention", "decode")
    full = prompt(q, kq, vq, slots, pos)                                                    # [2P, 32, 128]
    rows = list(range(0, 2 * P, 29)) + [255, 256, 511, 512, 1299, 1300, 2599]
    dec = [decode(q[m:m + 1], kq, vq, slots[m:m + 1], pos[m:m + 1]) for m in rows]
    assert row_mismatches(full[rows], dec) == 0
    r4 = torch.tensor(rows[:4 * (len(rows) // 4)], device="cuda").view(-1, 4)              # decode at M = 4
    assert row_mismatches(full[r4.flatten()], [decode(q[r], kq, vq, slots[r], pos[r]) for r in r4]) == 0
    segs = ((0, 1), (1, 63), (64, 300), (364, 1000), (1364, 1236))
    assert row_mismatches(full, [prompt(q[a:a + n], kq, vq, slots[a:a + n], pos[a:a + n]) for a, n in segs]) == 0
    q32, kd, vd = q.float(), kv_rows(kq, torch.float32), kv_rows(vq, torch.float32)
    assert row_mismatches(full, [ta.attention(q32, kd, vd, slots, pos).bfloat16()]) == 0
    fine = ta.AttnConfig(**{**ta.config_for(128, torch.float32, (9, 0)).__dict__, "chunk": 256})
    assert row_mismatches(ta.attention(q32, kd, vd, slots, pos, fine).bfloat16()[rows], dec) > 0


@GPU
@pytest.mark.gpu
def test_gpu_fast_prompt_attention_memory_and_error():
    """The fast set's prompt attention on 8,192 rows of one slot (small preset heads): its peak device memory stays
    below the fp32 scores [Hq, m, T] that the math backend would allocate (8.6 GB), and its error against the
    fp64 invariant attention is within bf16 rounding (relative 1e-2)."""
    from exactness.kernels import attention as cpu_attn
    P = 8192
    q, kc, vc, slots, pos = _attn_inputs(P, 1, torch.bfloat16, 5)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = cpu_attn.attention_fast_prompt(q, kc, vc, slots, pos)
    torch.cuda.synchronize()
    peak, scores = torch.cuda.max_memory_allocated() - base, 32 * P * P * 4
    assert peak < scores / 4, f"peak {peak / 1e9:.2f} GB against fp32 scores {scores / 1e9:.2f} GB"
    rows = torch.arange(0, P, 97, device="cuda")
    ref = cpu_attn.attention_invariant(q[rows].double().cpu(), kc.double().cpu(), vc.double().cpu(),
                                       slots[rows].cpu(), pos[rows].cpu())
    assert rel_err(out[rows].cpu(), ref) < 1e-2


@GPU
@pytest.mark.gpu
def test_gpu_attention_multi_slot_and_negative_control():
    from exactness.kernels import triton_attention as ta
    q, kc, vc, slots, pos = _attn_inputs(300, 3, torch.bfloat16, 4)
    perm = torch.randperm(900, generator=torch.Generator().manual_seed(0)).cuda()
    q, slots, pos = q[perm], slots[perm], pos[perm]
    full = ta.attention(q, kc, vc, slots, pos)
    dec = [ta.attention(q[m:m + 1], kc, vc, slots[m:m + 1], pos[m:m + 1]) for m in range(0, 900, 3)]
    assert row_mismatches(full[0::3], dec) == 0
    assert row_mismatches(full, [ta.attention(q, kc, vc, slots, pos, split=True)]) == 0    # packed, grouped by slot
    one = [int((slots == s).nonzero()[-1]) for s in range(3)]         # a decode step: a row of each slot, one per tile
    for split in (False, True):                                        # one chunk; chunks in parallel, heads packed
        step = ta.attention(q[one], kc, vc, slots[one], pos[one], split=split)
        assert row_mismatches(full[one], list(step.split(1))) == 0
    assert row_mismatches(full[one], list(ta.attention(q[one], kc, vc, slots[one].flip(0), pos[one]).split(1))) > 0
    other = ta.AttnConfig(64, 64, 4, 3) if ta.config_for(128, torch.bfloat16, (9, 0)).block_n != 64 \
        else ta.AttnConfig(64, 128, 8, 3)                                                   # another KV block
    assert row_mismatches(ta.attention(q, kc, vc, slots, pos, other)[0::3], dec) > 0


@GPU
@pytest.mark.gpu
def test_gpu_row_kernels_invariant_and_close_to_cpu():
    from exactness.kernels import experts, norm, rope, router
    from exactness.kernels import triton_moe_rows as mr
    from exactness.kernels import triton_rows as tr
    g = torch.Generator(device="cuda").manual_seed(5)
    M = 333
    x = torch.randn(M, 2048, generator=g, device="cuda").bfloat16()
    w = (1 + torch.randn(2048, device="cuda") / 10).bfloat16()
    r = tr.rmsnorm(x, w, 1e-6)
    assert row_mismatches(r, [tr.rmsnorm(x[m:m + 1], w, 1e-6) for m in range(M)]) == 0
    assert rel_err(r.cpu(), norm.rmsnorm_invariant(x.cpu(), w.cpu(), 1e-6)) < 1e-2
    qh = torch.randn(M, 32, 128, generator=g, device="cuda").bfloat16()
    pos = torch.randint(0, 30000, (M,), generator=g, device="cuda")
    cos, sin = rope._table(128, 1e6, 1, qh.device, torch.bfloat16)
    ro = tr.rope(qh, pos, cos, sin)
    assert torch.equal(bits(ro), bits(rope.rope_invariant(qh, pos, 1e6)))               # same rounding points
    y = torch.randn(M, 8, 2048, generator=g, device="cuda").bfloat16()
    wt = torch.rand(M, 8, device="cuda").bfloat16()
    c = mr.combine(y, wt, None)
    assert torch.equal(bits(c), bits(experts.combine_invariant(y, wt, None)))
    lg = (torch.randn(M, 128, generator=g, device="cuda") * 3).bfloat16()
    lg[:, 7] = lg[:, 3] = lg.max(dim=1).values + 1                                       # exact tie for first place
    wts, idx = mr.softmax_topk(lg, 8, True)
    assert bool((idx[:, 0] == 3).all() and (idx[:, 1] == 7).all())                        # lower id wins the tie
    cw, ci = router._softmax_topk_tile(lg, 8, True)
    assert torch.equal(idx, ci) and rel_err(wts, cw) < 1e-2
    w1 = [mr.softmax_topk(lg[m:m + 1], 8, True) for m in range(M)]
    assert row_mismatches(wts, [a for a, _ in w1]) == 0 and row_mismatches(idx, [b for _, b in w1]) == 0


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_gpu_paths_prompt_logits_equal_decode(preset):
    """decode vs batched vs deep on the invariant set: identical prompt-logit bytes and tokens (device weights)."""
    from exactness import model, paths
    from exactness.config import get_preset
    from exactness.weights import device_random_weights
    cfg = get_preset(preset)
    w = device_random_weights(cfg, torch.bfloat16, "cuda", seed=1)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(2))
    runs = [paths.generate(w, ids, 4, "invariant", paths.Schedule(p, s, deep_threshold=128))
            for p, s in (("decode", None), ("batched", 100), ("deep", 256), ("batched", None))]
    assert runs[2].served["deep"]["rows"] == 256                                          # deep plan really ran
    for r in runs[1:]:
        assert row_mismatches(r.prompt_logits, [runs[0].prompt_logits]) == 0, (r.path, r.step)
        assert torch.equal(r.gen_ids, runs[0].gen_ids)
    class Quiet:
        def record(self, **call):
            pass
    with model.tapping(Quiet()):                                    # taps: experts one by one (per-expert kernels)
        one_by_one = paths.generate(w, ids, 4, "invariant", paths.Schedule("batched", 100))
    assert row_mismatches(one_by_one.prompt_logits, [runs[0].prompt_logits]) == 0
    fast = paths.generate(w, ids, 4, "fast", paths.Schedule("batched", None))
    assert row_mismatches(fast.prompt_logits, [runs[0].prompt_logits]) > 0               # negative control


def _moe_inputs(E: int, I: int, H: int, dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = [(torch.randn(E, a, b, generator=g, device="cuda") / b ** 0.5).to(dtype) for a, b in ((I, H), (I, H), (H, I))]
    return g, w


def _moe_decode_rows(h, idx, wg, wu, wd) -> torch.Tensor:
    """y [M*k, H]: every (row, slot) through the set's decode expert kernels alone (M = 1 per call)."""
    from exactness.kernels import cuda
    out = []
    for m in range(h.shape[0]):
        for e in idx[m].tolist():
            out.append(cuda.down(cuda.gate_up(h[m:m + 1], wg[e], wu[e]), wd[e]))
    return torch.cat(out)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_grouped_experts_rows_equal_decode_kernel_rows(dtype):
    """Grouped MoE rows == the decode expert kernels' rows, whatever the tokens per expert (1 to > 2 tiles)."""
    from exactness.exact import differing_rows
    from exactness.kernels import triton_moe as tm
    E, I, H, k = (128, 768, 2048, 8) if dtype == torch.bfloat16 else (16, 768, 2048, 4)
    g, (wg, wu, wd) = _moe_inputs(E, I, H, dtype, 6)
    M = 300
    h = torch.randn(M, H, generator=g, device="cuda").to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(M)])   # [M, k] int64
    idx[:260, 0] = 5                                                        # expert 5: > 2 tiles of 128 members
    idx[:260, 1:] = torch.where(idx[:260, 1:] == 5, 6, idx[:260, 1:])
    idx[260:270] = torch.arange(k, device="cuda") + E - k                   # top experts: one member per row
    y = tm.experts(h, idx, wg, wu, wd)                                                        # [M, k, H]
    dec = _moe_decode_rows(h, idx, wg, wu, wd)
    assert int(differing_rows(y.reshape(M * k, H), dec).sum()) == 0
    for a, n in ((0, 1), (1, 2), (3, 61), (64, 236)):                       # other chunks: other counts per expert
        part = tm.experts(h[a:a + n], idx[a:a + n], wg, wu, wd)
        assert int(differing_rows(part.reshape(n * k, H), y[a:a + n].reshape(n * k, H)).sum()) == 0, (a, n)
    ref = torch.stack([h[m].double() for m in range(4)])                   # values: close to the fp64 SwiGLU
    e0 = idx[:4, 0]
    gg, uu = (torch.einsum("mh,mih->mi", ref, w[e0].double()) for w in (wg, wu))
    exact = torch.einsum("mi,mhi->mh", torch.nn.functional.silu(gg) * uu, wd[e0].double())
    assert rel_err(y[:4, 0], exact) < (3e-2 if dtype == torch.bfloat16 else 1e-5)


@GPU
@pytest.mark.gpu
def test_gpu_every_expert_placement_gives_each_row_the_shape_configs_bytes(monkeypatch):
    """Grouped experts: calls that take a placement (triton_moe.EXPERT_PLACEMENTS: few rows per expert, 16-row
    tiles) give every (row, slot) the bytes of the shapes' configs. Control: split_k 2 in both GEMMs differs."""
    from dataclasses import replace
    from exactness.exact import differing_rows
    from exactness.kernels import triton_moe as tm
    cap = torch.cuda.get_device_capability()
    I, H, E, k = 768, 2048, 128, 8
    placed = tm.expert_placements(I, H, torch.bfloat16, cap)
    if len(placed) == 1:
        pytest.skip(f"no expert placements for compute capability {cap}")
    g, (wg, wu, wd) = _moe_inputs(E, I, H, torch.bfloat16, 12)
    calls = {}
    for M in (1, 2, 8, 64, 250):                                  # 8 to 2,000 pairs: at most 16 rows per expert
        h = torch.randn(M, H, generator=g, device="cuda").bfloat16()
        calls[M] = (h, torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(M)]))
    got = {M: tm.experts(h, idx, wg, wu, wd) for M, (h, idx) in calls.items()}
    base = placed[-1]

    def only(*configs):
        monkeypatch.setattr(tm, "expert_placements", lambda *a: (configs,))
        tm._PLANS.clear()
    only(*base)
    for M, (h, idx) in calls.items():
        assert M * k <= placed[0][0] * E
        ref = tm.experts(h, idx, wg, wu, wd)
        assert int(differing_rows(got[M].reshape(M * k, H), ref.reshape(M * k, H)).sum()) == 0, M
    only(base[0], replace(base[1], split_k=2), replace(base[2], split_k=2))
    h, idx = calls[64]
    bad = tm.experts(h, idx, wg, wu, wd)
    tm._PLANS.clear()
    assert int(differing_rows(got[64].reshape(64 * k, H), bad.reshape(64 * k, H)).sum()) > 0   # negative control


@GPU
@pytest.mark.gpu
def test_gpu_one_row_experts_give_the_routed_bytes_without_the_route_launch(monkeypatch):
    """A one-row call (triton_moe.ONE_ROW: slot j as tile j, no route launch) gives every slot the routed call's
    bytes in two launches. Control: one expert's down weights changed in one element changes exactly its slot."""
    from exactness.exact import differing_rows
    from exactness.kernels import triton_moe as tm
    E, I, H, k = 128, 768, 2048, 8
    g, (wg, wu, wd) = _moe_inputs(E, I, H, torch.bfloat16, 9)
    calls = [(torch.randn(1, H, generator=g, device="cuda").bfloat16(),
              torch.randperm(E, generator=g, device="cuda")[:k][None]) for _ in range(5)]
    launched, launch = [], tm.launch
    monkeypatch.setattr(tm, "launch", lambda kernel, *a, **kw: (launched.append(kernel), launch(kernel, *a, **kw)))
    one = [tm.experts(h, idx, wg, wu, wd) for h, idx in calls]
    assert launched == [tm._grouped_kernel, tm._grouped_kernel] * len(calls)
    monkeypatch.setattr(tm, "ONE_ROW", False)
    routed = [tm.experts(h, idx, wg, wu, wd) for h, idx in calls]
    assert tm._route_kernel in launched
    assert [int(differing_rows(a[0], b[0]).sum()) for a, b in zip(one, routed)] == [0] * len(calls)
    monkeypatch.setattr(tm, "ONE_ROW", True)
    h, idx = calls[0]
    bad_w = wd.clone()
    bad_w[int(idx[0, 3]), 0, :] += 1.0
    assert differing_rows(tm.experts(h, idx, wg, wu, bad_w)[0], one[0][0]).tolist() == [j == 3 for j in range(k)]


@GPU
@pytest.mark.gpu
def test_gpu_grouped_experts_planted_fault_is_caught():
    """One expert's down weights changed in one element: exactly the rows routed to it (that slot) must differ."""
    from exactness.exact import differing_rows
    from exactness.kernels import triton_moe as tm
    E, I, H, k, M = 32, 768, 2048, 4, 64
    g, (wg, wu, wd) = _moe_inputs(E, I, H, torch.bfloat16, 7)
    h = torch.randn(M, H, generator=g, device="cuda").bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(M)])
    good = tm.experts(h, idx, wg, wu, wd).reshape(M * k, H)
    bad_w = wd.clone()
    bad_w[3, 0, :] += 1.0                                                    # expert 3, output column 0
    bad = tm.experts(h, idx, wg, wu, bad_w).reshape(M * k, H)
    diff = differing_rows(good, bad)
    routed = (idx.reshape(-1) == 3)
    assert int(diff.sum()) > 0 and bool((diff <= routed).all())


# ------------------------------------------------------------------------------------------------ CPU interpreter

def _interp_main() -> int:
    """Interpreter checks (run in a subprocess with TRITON_INTERPRET=1 and interpreted.py's shims: interpreted_rows,
    or this file as a script). Exit 0 pass, 1 fail."""
    from exactness.kernels import attention as cpu_attn
    from exactness.kernels import experts, rope
    from exactness.kernels import gemm_configs as gc
    from exactness.kernels import triton_attention as ta
    from exactness.kernels import triton_gemm as tg
    from exactness.kernels import triton_moe as tm
    from exactness.kernels import triton_moe_rows as mr
    from exactness.kernels import triton_rows as tr
    from exactness.kernels import triton_split as ts
    from dataclasses import replace
    torch.manual_seed(0)
    bf = torch.bfloat16
    x, w, w2 = torch.randn(37, 48).to(bf), (torch.randn(40, 48) / 7).to(bf), (torch.randn(40, 48) / 7).to(bf)
    y = tg.linear(x, w)
    checks = {
        "linear exact-rounded": torch.equal(bits(y), bits((x.double() @ w.double().T).to(bf))),
        "linear rows == M=1 rows": row_mismatches(y[[0, 31, 32, 36]],
                                                  [tg.linear(x[m:m + 1], w) for m in (0, 31, 32, 36)]) == 0,
        "linear chunks": row_mismatches(y, chunked(tg.linear, 37, (5, 32), x, extra=(w,))) == 0,
    }
    xf, wf = torch.randn(37, 96), torch.randn(40, 96) / 7                    # fp32: K = 96, 6 chunks of 16
    c3 = tg.GemmConfig(32, 32, 16, 1, 4, split_k=3)
    par = tg.linear(xf, wf, c3)                                                 # 4 tiles: runs in parallel
    below, ts.SPLIT_TILES_BELOW = ts.SPLIT_TILES_BELOW, 0
    try:
        turn = tg.linear(xf, wf, c3)                                            # one program per tile
    finally:
        ts.SPLIT_TILES_BELOW = below
    checks["split-K parallel == in turn"] = row_mismatches(par, [turn]) == 0
    slots, ts.COUNT_SLOTS = ts.COUNT_SLOTS, 0
    try:
        summed = tg.linear(xf, wf, c3)                                          # the sum in a second launch
    finally:
        ts.COUNT_SLOTS = slots
    checks["split-K sum by each tile's last split == sum launch"] = row_mismatches(par, [summed]) == 0
    xg, counts = torch.randn(37, 96), ts.split_counts(xf.device, 4)
    counts[0] = c3.split_k - 1                  # planted: tile 0's first split counts as its last, sums too early
    try:
        early = tg.linear(xg, wf, c3)
    finally:
        counts.zero_()
    checks["split-K sum before the partials (planted count) caught"] = row_mismatches(early, [tg.linear(xg, wf,
                                                                                                    c3)]) > 0
    checks["split-K M=1 rows"] = row_mismatches(turn, [tg.linear(xf[m:m + 1], wf, c3) for m in range(37)]) == 0
    checks.update(_interp_logits(tg, ts, c3))
    checks["split-K error < 1e-5"] = rel_err(par, xf.double() @ wf.double().T) < 1e-5
    checks["split-K control (one run) caught"] = row_mismatches(tg.linear(xf, wf, replace(c3, split_k=1)),
                                                                [par]) > 0
    c4 = replace(c3, split_k=4)                                                 # 6 chunks: runs of 2, one empty
    par4 = tg.linear(xf, wf, c4)
    x7, w7 = torch.randn(37, 112), torch.randn(40, 112) / 7                    # 7 chunks at split 3: 3, 3, 1
    par7 = tg.linear(x7, w7, c3)
    for loop in ("fold", "flat"):
        ts.SPLIT_TILES_BELOW = 0
        try:
            turns = [tg.linear(a, b, replace(c, split_loop=loop)) for a, b, c in ((xf, wf, c3), (xf, wf, c4),
                                                                                 (x7, w7, c3))]
        finally:
            ts.SPLIT_TILES_BELOW = below
        checks[f"split-K in turn, {loop} loop == parallel"] = row_mismatches(par, turns[:1]) == 0
        checks[f"split-K with an empty run, {loop} loop == parallel"] = row_mismatches(par4, turns[1:2]) == 0
        checks[f"split-K with a short last run, {loop} loop == parallel"] = row_mismatches(par7, turns[2:]) == 0
    gemm_key, expert_key = ("linear", 8, 8, "bf16", "sm90"), (8, 8, "bf16", "sm90")
    for name, check, table in (
            ("block_k", gc._check_placements, {gemm_key: ((16, {"block_k": 32}),)}),
            ("split_k", gc._check_placements, {gemm_key: ((16, {"split_k": 2}),)}),
            ("rows not ascending", gc._check_placements, {gemm_key: ((64, {}), (16, {}))}),
            ("two expert block_m", tm._check_expert_placements,
             {expert_key: ((16, {"block_m": 16}, {"block_m": 32}),)}),
            ("expert block_m unnamed", tm._check_expert_placements, {expert_key: ((16, {}, {}),)}),
            ("expert block_k", tm._check_expert_placements,
             {expert_key: ((16, {"block_m": 16, "block_k": 32}, {"block_m": 16}),)}),
            ("attention chunk", ta._check_split_placements, {(8, "16bit", "sm90"): ((8, {"chunk": 256}),)}),
            ("attention block_n", ta._check_split_placements, {(8, "16bit", "sm90"): ((8, {"block_n": 64}),)})):
        try:
            check(table)
            refused = False
        except ValueError:
            refused = True
        checks[f"placement table with {name} refused"] = refused
    checks["K = 0: zeros"] = torch.equal(tg.linear(xf[:, :0], wf[:, :0], c3), torch.zeros(37, 40))
    gu = tg.gate_up(x, w, w2)
    g, u = y.float(), tg.linear(x, w2).float()
    checks["gate_up rounding points"] = torch.equal(bits(gu), bits(((g / (1 + torch.exp(-g))).to(bf).float() * u
                                                                    ).to(bf)))
    checks["gate_up rows"] = row_mismatches(gu[[3, 33]], [tg.gate_up(x[m:m + 1], w, w2) for m in (3, 33)]) == 0
    split = (x[:, :24].double() @ w[:, :24].double().T).to(bf).double() + x[:, 24:].double() @ w[:, 24:].double().T
    checks["negative control caught"] = row_mismatches(split.to(bf), [y]) > 0
    kl, vl, ql = torch.randn(2, 100, 2, 16).to(bf), torch.randn(2, 100, 2, 16).to(bf), torch.randn(12, 4, 16).to(bf)
    sl, pl = torch.tensor([0, 1] * 6), torch.tensor([99, 98, 70, 64, 63, 33, 32, 31, 5, 0, 95, 40])
    whole = ta.attention(ql, kl, vl, sl, pl, split=False)                                  # 4 chunks of 32 keys
    checks["attention split-KV == one program per tile"] = row_mismatches(whole, [ta.attention(ql, kl, vl, sl, pl,
                                                                                                split=True)]) == 0
    checks["attention split-KV M=1 rows"] = row_mismatches(whole, [ta.attention(ql[m:m + 1], kl, vl, sl[m:m + 1],
                                                                                pl[m:m + 1], split=True)
                                                                   for m in range(12)]) == 0
    checks["attention chunks error < 1e-2"] = rel_err(whole, cpu_attn.attention_invariant(
        ql.double(), kl.double(), vl.double(), sl, pl)) < 1e-2
    other = ta.AttnConfig(16, 16, 4, 1, 16)
    checks["attention chunk-size control caught"] = row_mismatches(ta.attention(ql, kl, vl, sl, pl, other), [whole]) > 0
    kc, vc = torch.randn(2, 40, 2, 16).to(bf), torch.randn(2, 40, 2, 16).to(bf)
    q = torch.randn(30, 4, 16).to(bf)
    slots = torch.tensor([0, 1] * 15)
    pos = torch.arange(30) // 2 + 9
    o = ta.attention(q, kc, vc, slots, pos)
    checks["attention rows"] = row_mismatches(o[[0, 17, 29]], [ta.attention(q[m:m + 1], kc, vc, slots[m:m + 1],
                                                                            pos[m:m + 1]) for m in (0, 17, 29)]) == 0
    ref = cpu_attn.attention_invariant(q.double(), kc.double(), vc.double(), slots, pos)
    checks["attention error < 1e-2"] = rel_err(o, ref) < 1e-2
    s3 = torch.tensor([2, 0, 2, 2, 0] * 8)            # 40 rows over 3 slots, slot 1 empty: tiles of 16, 16 and 8 rows
    rows, start, length, tslot = ta._tiles(s3, 3, 16)
    checks["attention tiles grouped on the device"] = (
        torch.equal(rows, torch.sort(s3, stable=True).indices) and start[:3].tolist() == [0, 16, 32]
        and length.tolist() == [16, 16, 8, 0, 0] and tslot[:3].tolist() == [0, 2, 2])
    k3, v3, q3 = torch.randn(3, 40, 2, 16).to(bf), torch.randn(3, 40, 2, 16).to(bf), torch.randn(40, 4, 16).to(bf)
    p3 = torch.arange(40) % 37
    o3 = ta.attention(q3, k3, v3, s3, p3)
    checks["attention rows, several tiles per slot"] = row_mismatches(o3, [ta.attention(
        q3[m:m + 1], k3, v3, s3[m:m + 1], p3[m:m + 1]) for m in range(40)]) == 0
    xr, wr = torch.randn(5, 3, 24).to(bf), (1 + torch.randn(24) / 10).to(bf)
    checks["rmsnorm rows"] = row_mismatches(tr.rmsnorm(xr, wr, 1e-6), [tr.rmsnorm(xr[m:m + 1], wr, 1e-6)
                                                                      for m in range(5)]) == 0
    p = torch.tensor([0, 5, 300])
    cos, sin = rope._table(16, 1e4, 1, "cpu", bf)
    checks["rope == CPU bytes"] = torch.equal(bits(tr.rope(q[:3], p, cos, sin)), bits(rope.rope_invariant(q[:3], p,
                                                                                                          1e4)))
    yy, ww = torch.randn(4, 3, 24).to(bf), torch.rand(4, 3).to(bf)
    checks["combine == CPU bytes"] = torch.equal(bits(mr.combine(yy, ww, yy[:, 0])),
                                                 bits(experts.combine_invariant(yy, ww, yy[:, 0])))
    lg = torch.randn(6, 16).to(bf)
    lg[:, 9] = lg[:, 4] = lg.max(dim=1).values + 1
    _, idx = mr.softmax_topk(lg, 3, True)
    checks["top-k tie -> lower id"] = bool((idx[:, 0] == 4).all() and (idx[:, 1] == 9).all())
    from exactness.exact import differing_rows
    we = [(torch.randn(6, a, b) / 7).to(bf) for a, b in ((40, 48), (40, 48), (48, 40))]
    route = torch.stack([torch.randperm(6)[:2] for _ in range(37)])
    route[:20] = torch.tensor([1, 3])                                       # expert 1 and 3: > 1 tile of 32
    ye = tm.experts(x, route, *we).reshape(74, 48)
    dec = torch.cat([tg.linear(tg.gate_up(x[m:m + 1], we[0][e], we[1][e]), we[2][e]) for m in range(37)
                     for e in route[m].tolist()])
    checks["grouped experts == per-expert rows"] = int(differing_rows(ye, dec).sum()) == 0
    one = tm.experts(x[:1], route[:1], *we).reshape(2, 48)                 # one row: no route launch
    checks["grouped experts M=1 rows"] = int(differing_rows(one, ye[:2]).sum()) == 0
    bad = we[2].clone()
    bad[int(route[0, 1]), 0, :] += 1.0                                      # slot 1's expert: down column 0
    checks["grouped experts M=1 fault in slot 1 only"] = differing_rows(
        tm.experts(x[:1], route[:1], we[0], we[1], bad).reshape(2, 48), one).tolist() == [False, True]
    checks.update(_interp_placements(x, w, we, route, ye))
    for k, v in checks.items():
        print(f"{'ok  ' if v else 'FAIL'} {k}")
    return 0 if all(checks.values()) else 1


def _interp_logits(tg, ts, cfg) -> dict:
    """triton_gemm.logits in bf16 split calls (the sum widened in the split launch, and in the sum launch) against
    linear(...).float(), integer views; control: one weight element changed changes exactly its column."""
    xb, wb = torch.randn(37, 96).bfloat16(), (torch.randn(40, 96) / 7).bfloat16()
    ref = tg.linear(xb, wb, cfg).float()
    got = tg.logits(xb, wb, cfg)
    slots, ts.COUNT_SLOTS = ts.COUNT_SLOTS, 0
    try:
        launched = tg.logits(xb, wb, cfg)                                       # the sum in a second launch
    finally:
        ts.COUNT_SLOTS = slots
    bad_w = wb.clone()
    bad_w[5, 0] += 1.0
    cols = (tg.logits(xb, bad_w, cfg).view(torch.int32) != ref.view(torch.int32)).any(dim=0)
    return {"logits widened in the split launch == linear then float":
            tg._run(xb, (wb,), "linear", cfg, wide=True).dtype == torch.float32
            and torch.equal(got.view(torch.int32), ref.view(torch.int32)),
            "logits widened in the sum launch == linear then float": torch.equal(launched.view(torch.int32),
                                                                                   ref.view(torch.int32)),
            "logits M=1 rows": row_mismatches(got, [tg.logits(xb[m:m + 1], wb, cfg) for m in range(37)]) == 0,
            "logits weight fault caught in its column only": cols.tolist() == [j == 5 for j in range(40)]}


def _interp_placements(x, w, we, route, ye) -> dict:
    """An interpreter placement (16-row tiles for calls of up to 8 rows) patched into both tables: the wrapper picks
    it by M, and its rows have the shape config's bytes (``ye``: the grouped experts without placements)."""
    from exactness.exact import differing_rows
    from exactness.kernels import triton_gemm as tg
    from exactness.kernels import triton_moe as tm
    small = dict(block_m=16, block_n=16)
    full = tg.linear(x, w)                                                      # 37 rows: the shape's config
    saved = dict(tg.PLACEMENTS), dict(tm.EXPERT_PLACEMENTS)
    tg.PLACEMENTS[("linear", 40, 48, "bf16", "interp")] = ((8, small),)
    tm.EXPERT_PLACEMENTS[(40, 48, "bf16", "interp")] = ((1, small, small),)
    tg._PLANS.clear()
    tm._PLANS.clear()
    try:
        parts = [tg.linear(x[a:a + n], w) for a, n in ((0, 1), (1, 8), (9, 28))]
        plan = next(p for p in tg._PLANS.values() if p.N == 40 and p.K == 48)
        chosen = [next(lp for r, lp in plan.launches if m <= r).cfg.block_m for m in (1, 8, 9)]
        few = tm.experts(x[:2], route[:2], *we).reshape(4, 48)                  # 4 pairs over 6 experts: placed
        tiles = {p.states[0][1][0].block_m for p in tm._PLANS.values()}
    finally:
        tg.PLACEMENTS.clear()
        tg.PLACEMENTS.update(saved[0])
        tm.EXPERT_PLACEMENTS.clear()
        tm.EXPERT_PLACEMENTS.update(saved[1])
        tg._PLANS.clear()
        tm._PLANS.clear()
    return {"placement chosen by M (16-row tiles up to 8 rows)": chosen == [16, 16, 32],
            "placed linear rows == config rows": row_mismatches(full, parts) == 0,
            "placed grouped experts == config rows": tiles == {16} and int(differing_rows(few, ye[:4]).sum()) == 0}


@NEEDS_TRITON
def test_interpreter_kernels_row_invariant_and_exact():
    """Under TRITON_INTERPRET=1 on the CPU: rows of a block equal M=1 rows; rounding points as the CPU kernels."""
    rows = interpreted_rows("import test_cuda_kernels\nsys.exit(test_cuda_kernels._interp_main())")
    assert rows and all(r[0] == "ok" for r in rows), rows


@NEEDS_TRITON
def test_launch_settings_restore_both_on_error():
    """triton_rows.launch_settings sets FAST_LAUNCH and PDL for its block and restores both when the block raises,
    including changes the block made itself. Inside the block the values differ from the saved ones, so a block
    that did not restore them would fail the last assertion."""
    from exactness.kernels import triton_rows as tr
    before = tr.FAST_LAUNCH, tr.PDL
    with pytest.raises(RuntimeError):
        with tr.launch_settings(fast_launch=not before[0]):
            assert (tr.FAST_LAUNCH, tr.PDL) == (not before[0], before[1])
            tr.PDL = not before[1]
            raise RuntimeError("planted")
    assert (tr.FAST_LAUNCH, tr.PDL) == before


def pdl_violations(sources: dict[str, str]) -> tuple[list[str], set[str]]:
    """What breaks the rule that lets triton_rows.launch() use programmatic dependent launch: every kernel (a
    ``@triton.jit`` function that no jit function calls: what a launch starts) takes ``PDL`` as its last parameter
    and has ``pdl_start(PDL)`` as its first statement (after its docstring), so nothing is read or written before
    the wait. Returns (violations, the kernels' names)."""
    import ast
    jit, called = {}, set()
    for name, src in sources.items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                jit[name, node.name] = node
                called |= {ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)}
    kernels = {key for key in jit if key[1] not in called}
    bad = []
    for where, k in sorted(kernels):
        fn = jit[where, k]
        doc = fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
        body = fn.body[1:] if doc else fn.body
        if not fn.args.args or fn.args.args[-1].arg != "PDL":
            bad.append(f"{where}:{k}: PDL is not its last parameter")
        if not body or ast.unparse(body[0]) != "pdl_start(PDL)":
            bad.append(f"{where}:{k}: its first statement is not pdl_start(PDL)")
    return bad, {k for _, k in kernels}


def test_every_launched_kernel_waits_for_its_predecessor_first():
    """Read from the source (no Triton needed) of every Triton module (kernels/triton_*.py): every kernel takes PDL
    last and calls pdl_start(PDL) before anything else. Negative controls: a kernel with a statement moved above
    the wait, and one without the parameter, are named."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib", "exactness", "kernels")
    sources = {m: open(os.path.join(root, m)).read() for m in sorted(os.listdir(root))
               if m.startswith("triton_") and m.endswith(".py")}
    assert {"triton_attention.py", "triton_attn_programs.py", "triton_moe.py", "triton_moe_rows.py", "triton_rows.py",
            "triton_tiles.py"} <= set(sources)
    bad, kernels = pdl_violations(sources)
    assert bad == []
    assert {"_rmsnorm_kernel", "_gemm_kernel", "_gemm_persistent_kernel", "_gemm_split_kernel", "_grouped_kernel",
            "_attn_kernel", "_attn_split_kernel", "_combine_kernel", "_route_kernel", "_softmax_topk_kernel"} <= kernels
    rows = sources["triton_rows.py"]
    head = "    pdl_start(PDL)\n    rows = tl.program_id(0) * BR + tl.arange(0, BR)\n    cols = tl.arange(0, BH)\n"
    assert rows.count(head) == 1                                              # _rmsnorm_kernel's first lines
    late = rows.replace(head, "    rows = tl.program_id(0) * BR + tl.arange(0, BR)\n    pdl_start(PDL)\n"
                              "    cols = tl.arange(0, BH)\n")
    assert pdl_violations({**sources, "triton_rows.py": late})[0] == [
        "triton_rows.py:_rmsnorm_kernel: its first statement is not pdl_start(PDL)"]
    sig = "EMULATE: tl.constexpr,\n                    PDL: tl.constexpr):\n    pdl_start(PDL)\n    rows"
    assert rows.count(sig) == 1
    gone = rows.replace(sig, "EMULATE: tl.constexpr):\n    rows")
    assert pdl_violations({**sources, "triton_rows.py": gone})[0] == [
        "triton_rows.py:_rmsnorm_kernel: PDL is not its last parameter",
        "triton_rows.py:_rmsnorm_kernel: its first statement is not pdl_start(PDL)"]


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"            # before Triton compiles anything
    import interpreted
    interpreted.shims()
    sys.exit(_interp_main())


@GPU
@pytest.mark.gpu
def test_gpu_weights_cast_on_the_device_equal_a_cpu_cast():
    """weights.moved casts a CPU tensor on the CUDA device after the copy: the same bf16 bytes as a cast on the CPU,
    for normal, subnormal, signed-zero, infinite and tie-breaking values (weights hold no NaN)."""
    from exactness.weights import moved
    t = torch.randn(1000, 257, generator=torch.Generator().manual_seed(0)) * 3
    t[0, :6] = torch.tensor([float("inf"), -float("inf"), 1e-40, -0.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8])
    a = moved(t, "cuda", torch.bfloat16)
    b = t.to(torch.bfloat16)
    assert a.device.type == "cuda" and a.dtype == torch.bfloat16
    assert torch.equal(a.cpu().view(torch.int16), b.view(torch.int16))
    assert not torch.equal(moved(t * (1 + 2 ** -9), "cuda", torch.bfloat16).cpu().view(torch.int16),
                           b.view(torch.int16))   # negative control: every value scaled by 1 + 2^-9 shows
