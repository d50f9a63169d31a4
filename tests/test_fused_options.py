"""The invariant set's fused options (kernels/fused.py): a layer's q/k RMSNorm and RoPE in one launch (with the
KV cache store in the same launch), a residual add with the next RMSNorm in one, the MoE combine with both in one
(triton_fused), the attention's output projection with both in one (triton_dense_norm), and projections of one
input in a grouped pair of launches (triton_group) give the bytes of the kernels they stand in for, and the engine
uses an option only over a set's own kernels of those classes.

Byte claims compare integer views; every comparison has a planted fault (a norm weight one ULP off, a routing
weight doubled, a projection weight's element or row doubled) that the same comparison must catch. The GPU tests
run the small preset's shapes, the interpreter test the tiny shapes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from exactness.cache import KVCache
from exactness.kernels import fused, get_set, imported
from exactness.kernels import norm as _norm
from exactness.model import BATCHED, DECODE, forward, tapping
from interpreted import HAS_TRITON, NEEDS_TRITON, interpreted_rows

GPU = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA device and Triton")
_INTS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bytes differ (a and b of one float dtype and shape)."""
    return int((a.view(_INTS[a.dtype]) != b.view(_INTS[b.dtype])).sum())


def one_ulp_up(w: torch.Tensor, at: int = 0) -> torch.Tensor:
    """A copy of w with element ``at`` (flattened) one ULP up."""
    bad = w.clone()
    flat = bad.view(-1).view(_INTS[w.dtype])
    flat[at] += 1
    return bad


def qk_case(dtype, device, M=5, HQ=32, HK=4, D=128, seed=0):
    """(q [M, HQ, D], k [M, HK, D], wq [D], wk [D], positions [M]) with rows of several scales."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 2, M * HQ).view(M, HQ, 1)
    q = (torch.randn(M, HQ, D, generator=g) * scale).to(dtype).to(device)
    k = (torch.randn(M, HK, D, generator=g) * 3).to(dtype).to(device)
    wq, wk = (torch.randn(D, generator=g).to(dtype).to(device) for _ in range(2))
    pos = torch.randint(0, 30000, (M,), generator=g).to(device)
    return q, k, wq, wk, pos


def qk_mismatches(run_fused, run_rms, run_rope, case, cos, sin, fault: bool = False) -> int:
    """Elements where the fused q/k (weights with a planted fault if asked) differ from rmsnorm then rope."""
    q, k, wq, wk, pos = case
    rq = run_rope(run_rms(q, wq, 1e-6), pos, cos, sin)
    rk = run_rope(run_rms(k, wk, 1e-6), pos, cos, sin)
    fq, fk = run_fused(q, k, one_ulp_up(wq, 7) if fault else wq, wk, 1e-6, pos, cos, sin)
    return mismatches(fq, rq) + mismatches(fk, rk)


def qk_store_mismatches(run_fused, run_rms, run_rope, run_store, case, cos, sin, S=3, fault: str = "") -> int:
    """Elements where the fused q, k and the caches it writes differ from rmsnorm then rope then the cache store
    (caches [S, T = M + 8, Hk, D] of random bytes, rows at distinct (slot, position) pairs, the last of several
    rows' position past the cache: not stored); fault "key": a key norm weight one ULP up, "value": a value
    doubled."""
    q, k, wq, wk, _ = case
    M, HK, D = k.shape
    T = M + 8
    g = torch.Generator().manual_seed(M)
    pairs = torch.randperm(S * T, generator=g)[:M]
    slots, pos = (pairs // T).to(q.device), (pairs % T).to(q.device)
    if M > 1:
        pos[-1] = T + 3
    v = torch.randn(M, HK, D, generator=g).to(k.dtype).to(k.device)
    kc, vc = (torch.randn(S, T, HK, D, generator=g).to(k.dtype).to(k.device) for _ in range(2))
    rk = run_rope(run_rms(k, wk, 1e-6), pos, cos, sin)
    rkc, rvc = kc.clone(), vc.clone()
    assert run_store(rkc, rvc, slots, pos, rk, v)
    fq, fk = run_fused(q, k, wq, one_ulp_up(wk, 7) if fault == "key" else wk, 1e-6, pos, cos, sin,
                       store=(kc, vc, slots, doubled(v) if fault == "value" else v))
    return (mismatches(fq, run_rope(run_rms(q, wq, 1e-6), pos, cos, sin)) + mismatches(fk, rk)
            + mismatches(kc, rkc) + mismatches(vc, rvc))


def doubled(w: torch.Tensor, at: int = 5) -> torch.Tensor:
    """A copy of w with element ``at`` (flattened) doubled: one product of a column off by itself."""
    bad = w.clone()
    bad.view(-1)[at] *= 2
    return bad


def residual_case(dtype, device, R=5, H=2048, seed=0):
    """(a [R, H], b [R, H], w [H]): a residual stream and a block output of other scales."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(R, H, generator=g) * 4).to(dtype).to(device)
    b = (torch.randn(R, H, generator=g) * torch.logspace(-3, 1, R).view(R, 1)).to(dtype).to(device)
    return a, b, torch.randn(H, generator=g).to(dtype).to(device)


def residual_mismatches(run_fused, run_rms, case, fault: bool = False) -> int:
    """Elements where the fused (x, h) (norm weight with a planted fault if asked) differ from a + b then rmsnorm."""
    a, b, w = case
    x = _norm.residual_add(a, b)
    fx, fh = run_fused(a, b, one_ulp_up(w, 3) if fault else w, 1e-6)
    return mismatches(fx, x) + mismatches(fh, run_rms(x, w, 1e-6))


def combine_case(dtype, device, R=5, K=8, H=2048, shared=False, seed=0):
    """(y [R, K, H], weights [R, K], shared [R, H] or None, a [R, H], w [H]): experts' outputs, their routing
    weights (in (0, 1)), a residual stream and a norm weight."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(R, K, H, generator=g) * torch.logspace(1, -1, R).view(R, 1, 1)).to(dtype).to(device)
    c = torch.rand(R, K, generator=g).to(dtype).to(device)
    s = (torch.randn(R, H, generator=g) / 3).to(dtype).to(device) if shared else None
    return y, c, s, (torch.randn(R, H, generator=g) * 4).to(dtype).to(device), torch.randn(H, generator=g).to(
        dtype).to(device)


def combine_mismatches(run_fused, run_combine, run_rms, case, fault: str = "") -> int:
    """Elements where the fused (x, h) differ from combine, then a + that, then rmsnorm; fault "weight": the first
    row's first routing weight doubled, "norm": a norm weight one ULP up."""
    y, c, s, a, w = case
    x = _norm.residual_add(a, run_combine(y, c, s))
    fx, fh = run_fused(y, doubled(c, 0) if fault == "weight" else c, s, a,
                       one_ulp_up(w, 3) if fault == "norm" else w, 1e-6)
    return mismatches(fx, x) + mismatches(fh, run_rms(x, w, 1e-6))


def dense_norm_case(dtype, device, M=5, N=2048, K=4096, seed=0):
    """(x [M, K], w [N, K], a [M, N], wn [N]): an attention output, its projection weight, a residual stream and a
    norm weight."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(device)
    a = (torch.randn(M, N, generator=g) * 4).to(dtype).to(device)
    return x, w, a, torch.randn(N, generator=g).to(dtype).to(device)


def dense_norm_mismatches(run_fused, run_linear, run_residual_norm, case, fault: str = "") -> int:
    """Elements where the fused (x, h) differ from linear then residual_norm (-1: the fused launch did not serve);
    fault "weight": the projection's first output row of weights doubled (its column of x doubled, not lost in the
    residual's rounding), "norm": a norm weight one ULP up."""
    x, w, a, wn = case
    rx, rh = run_residual_norm(a, run_linear(x, w), wn, 1e-6)
    bad = w.clone()
    bad[0] *= 2
    out = run_fused(x, bad if fault == "weight" else w, a, one_ulp_up(wn, 3) if fault == "norm" else wn, 1e-6)
    return -1 if out is None else mismatches(out[0], rx) + mismatches(out[1], rh)


def group_mismatches(linear, linear_many, x, ws, fault: bool = False) -> int:
    """Elements where linear_many's outputs (the last weight with a planted fault if asked: doubled) differ from
    linear's."""
    got = linear_many(x, tuple(ws[:-1]) + ((doubled(ws[-1]),) if fault else (ws[-1],)))
    return sum(mismatches(g, linear(x, w)) for g, w in zip(got, ws))


# ------------------------------------------------------------------------------------------------ any machine

def test_options_serve_nothing_on_the_cpu():
    q, k, wq, wk, pos = qk_case(torch.bfloat16, "cpu", HQ=4, HK=2, D=16)
    assert fused.qk_norm_rope(q, k, wq, wk, 1e-6, pos, 10000.0) is None
    x, wt = torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(3, 16, dtype=torch.bfloat16)
    assert fused.dense_group(x, (wt,)) is None
    assert fused.residual_norm(x, x, wt[0], 1e-6) is None
    assert fused.combine_residual_norm(x[:, None], x[:, :1], None, x, wt[0], 1e-6) is None
    assert fused.dense_residual_norm(x, wt, x[:, :3], wt[0, :3], 1e-6) is None


def _recording(base, calls: list, **replaced):
    """``base`` with options that record each call and decline it (None: the kernels run) and the given classes'
    kernels replaced by equal-bytes wrappers (other callables)."""
    def rec(name, fn):
        def option(*args):
            calls.append(name)
            return None
        option.stands_for = fn.stands_for
        return option

    tabs = {r: {c: (dataclasses.replace(s, fn=lambda *a, _f=s.fn: _f(*a)) if c in replaced else s)
                for c, s in getattr(base, r).items()} for r in ("decode", "prompt")}
    opts = {**base.options, "qk_norm_rope": rec("qk", fused.qk_norm_rope),
            "dense_group": rec("group", fused.dense_group), "residual_norm": rec("res", fused.residual_norm),
            "combine_residual_norm": rec("comb", fused.combine_residual_norm),
            "dense_residual_norm": rec("dres", fused.dense_residual_norm)}
    return dataclasses.replace(base, name="invariant+recording", options=opts, **tabs)


@pytest.mark.parametrize("replaced, used", [((), {"qk", "group", "res", "comb", "dres"}), (("rmsnorm",), {"group"}),
                                            (("rope",), {"group", "res", "comb", "dres"}),
                                            (("dense",), {"qk", "res", "comb"}), (("residual",), {"qk", "group"}),
                                            (("moe_combine",), {"qk", "group", "res", "dres"})])
def test_the_engine_uses_an_option_only_over_the_sets_own_kernels(tiny_weights, replaced, used):
    w, inv = tiny_weights, get_set("invariant")
    ids = torch.arange(6) + 3
    ref_cache, cache = KVCache(w.cfg, 16, 1, w.dtype), KVCache(w.cfg, 16, 1, w.dtype)
    ref = forward(w, ids, torch.arange(6), ref_cache, inv, BATCHED).logits
    calls: list = []
    ks = _recording(inv, calls, **{c: True for c in replaced})
    out = forward(w, ids, torch.arange(6), cache, ks, BATCHED).logits
    per_forward = {"qk": 1, "group": 1, "res": 2, "comb": 1, "dres": 1}   # per layer: the residual after each
    # block, the MoE's end, the attention's output projection
    assert set(calls) == used and len(calls) == sum(per_forward[u] for u in used) * w.cfg.n_layers
    assert mismatches(out, ref) == 0
    n = len(calls)
    with tapping(type("R", (), {"record": lambda self, **k: None})()):
        forward(w, ids[:1], torch.tensor([6]), cache, ks, DECODE)
    assert len(calls) == n                                     # taps see every class's kernel: no option ran


def test_an_imported_set_with_its_own_rmsnorm_loses_the_fused_options():
    inv = get_set("invariant")
    own = {r: {**getattr(inv, r),
               "rmsnorm": dataclasses.replace(getattr(inv, r)["rmsnorm"], fn=_norm.rmsnorm_invariant)}
           for r in ("decode", "prompt")}
    ks, dropped = imported.drop_bypassing_options(dataclasses.replace(inv, name="user", **own))
    assert set(dropped) == {"qk_norm_rope", "residual_norm", "combine_residual_norm", "dense_residual_norm"}
    assert ks.options.qk_norm_rope is None
    assert ks.options.dense_group is fused.dense_group and ks.options.grouped_experts is inv.options.grouped_experts
    assert imported.drop_bypassing_options(inv)[1] == {}


# ------------------------------------------------------------------------------------------------ GPU

@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, M, D", [(torch.bfloat16, 1, 128), (torch.bfloat16, 333, 128),
                                         (torch.float32, 7, 128), (torch.bfloat16, 9, 64)])
def test_gpu_qk_norm_rope_gives_rmsnorm_then_rope_bytes_with_and_without_a_store_and_planted_faults_are_caught(
        dtype, M, D):
    from exactness.kernels import rope as _rope
    from exactness.kernels import triton_cache, triton_fused, triton_rows
    cos, sin = _rope._table(D, 1e6, 1, torch.device("cuda"), dtype)
    case = qk_case(dtype, "cuda", M=M, D=D, seed=M)
    args = (triton_fused.qk_norm_rope, triton_rows.rmsnorm, triton_rows.rope, case, cos, sin)
    assert qk_mismatches(*args) == 0
    assert qk_mismatches(*args, fault=True) > 0
    store = args[:3] + (triton_cache.store,) + args[3:]                 # the keys and values to the caches too
    assert qk_store_mismatches(*store) == 0
    assert qk_store_mismatches(*store, fault="key") > 0 and qk_store_mismatches(*store, fault="value") > 0


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, R, H", [(torch.bfloat16, 1, 2048), (torch.bfloat16, 333, 2048),
                                         (torch.float32, 7, 2048), (torch.bfloat16, 9, 64)])
def test_gpu_residual_norm_gives_the_add_then_rmsnorm_bytes_and_a_planted_fault_is_caught(dtype, R, H):
    from exactness.kernels import triton_fused, triton_rows
    case = residual_case(dtype, "cuda", R=R, H=H, seed=R)
    assert residual_mismatches(triton_fused.residual_norm, triton_rows.rmsnorm, case) == 0
    assert residual_mismatches(triton_fused.residual_norm, triton_rows.rmsnorm, case, fault=True) > 0


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, R, K, H, shared", [(torch.bfloat16, 1, 8, 2048, False),
                                                    (torch.bfloat16, 333, 8, 2048, True),
                                                    (torch.float32, 7, 8, 2048, False),
                                                    (torch.bfloat16, 9, 2, 64, True)])
def test_gpu_combine_residual_norm_gives_the_combine_add_then_rmsnorm_bytes_and_planted_faults_are_caught(
        dtype, R, K, H, shared):
    from exactness.kernels import triton_fused, triton_moe_rows, triton_rows
    case = combine_case(dtype, "cuda", R=R, K=K, H=H, shared=shared, seed=R)
    args = (triton_fused.combine_residual_norm, triton_moe_rows.combine, triton_rows.rmsnorm, case)
    assert combine_mismatches(*args) == 0
    assert combine_mismatches(*args, fault="weight") > 0 and combine_mismatches(*args, fault="norm") > 0


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("M, served", [(1, True), (3, True), (16, True), (17, True), (128, True), (200, False)])
def test_gpu_dense_residual_norm_gives_linear_then_residual_norm_bytes_and_planted_faults_are_caught(M, served):
    """The attention output projection's shape (2,048 x 4,096, bf16): served by one launch for the calls whose
    split programs take it (M <= 128), each with the bytes of triton_gemm.linear then triton_fused.residual_norm,
    three calls in a row (the counts back at zero between them); a larger call is refused (None)."""
    from exactness.kernels import triton_dense_norm, triton_fused, triton_gemm, triton_split
    case = dense_norm_case(torch.bfloat16, "cuda", M=M, seed=M)
    args = (triton_dense_norm.try_dense_residual_norm, triton_gemm.linear, triton_fused.residual_norm, case)
    assert [dense_norm_mismatches(*args) for _ in range(3)] == [0 if served else -1] * 3
    if served:
        assert int(triton_split.split_counts(case[0].device, 1).count_nonzero()) == 0
        assert dense_norm_mismatches(*args, fault="weight") > 0 and dense_norm_mismatches(*args, fault="norm") > 0


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 16, 17, 64, 512, 600])
def test_gpu_grouped_projections_give_each_weights_linear_bytes_and_a_planted_fault_is_caught(M):
    from exactness.kernels import triton_gemm, triton_group
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 2048, generator=g).to(torch.bfloat16).cuda()
    ws = [(torch.randn(n, 2048, generator=g) * 0.02).to(torch.bfloat16).cuda() for n in (4096, 512, 512)]
    if M == 1:
        assert triton_group.serves(x, tuple(ws))                              # q, k and v in one launch
    args = (triton_gemm.linear, triton_group.linear_many, x, ws)
    assert group_mismatches(*args) == 0
    assert group_mismatches(*args, fault=True) > 0


@GPU
@pytest.mark.gpu
def test_gpu_forward_with_the_fused_options_equals_the_forward_without():
    from exactness.config import get_preset
    from exactness.graphs import GraphDecoder
    from exactness.weights import device_random_weights
    w = device_random_weights(get_preset("small").replace(n_layers=2), torch.bfloat16, "cuda", seed=2)
    inv = get_set("invariant")
    plain = dataclasses.replace(inv, name="invariant-unfused",
                                options=inv.options.without("qk_norm_rope", "dense_group", "residual_norm",
                                                            "combine_residual_norm", "dense_residual_norm"))
    ids = torch.randint(0, 258, (300,), generator=torch.Generator().manual_seed(4)).cuda()
    res = {}
    for ks in (inv, plain):
        cache = KVCache(w.cfg, 320, 1, torch.bfloat16, w.device)
        pre = forward(w, ids, torch.arange(300, device="cuda"), cache, ks, BATCHED).logits
        dec = [forward(w, ids[i:i + 1], torch.tensor([300 + i], device="cuda"), cache, ks, DECODE).logits
               for i in range(2)]
        gd = GraphDecoder(w, cache, ks)
        graph = [gd.step(ids[i:i + 1], [302 + i], [0]).clone() for i in range(3)]
        res[ks.name] = (pre, *dec, *graph, *cache.k, *cache.v)
    a, b = res.values()
    assert [mismatches(x, y) for x, y in zip(a, b)] == [0] * len(a)
    bad = res[inv.name][0].clone()
    bad.view(torch.int32)[0, 0] += 1                                          # the comparison catches one ULP
    assert mismatches(bad, res[plain.name][0]) == 1


_INTERP = """
import torch
from test_fused_options import (qk_case, qk_mismatches, qk_store_mismatches, group_mismatches, residual_case,
                                residual_mismatches, combine_case, combine_mismatches, dense_norm_case,
                                dense_norm_mismatches)
from exactness.kernels import (rope as _rope, triton_cache, triton_dense_norm, triton_gemm as tg, triton_group,
                               triton_fused, triton_moe_rows, triton_rows, triton_split)
for dt in (torch.bfloat16, torch.float32):
    cos, sin = _rope._table(16, 1e4, 1, torch.device("cpu"), dt)
    case = qk_case(dt, "cpu", M=3, HQ=4, HK=2, D=16)
    args = (triton_fused.qk_norm_rope, triton_rows.rmsnorm, triton_rows.rope, case, cos, sin)
    print("qk", qk_mismatches(*args), qk_mismatches(*args, fault=True))
    store = args[:3] + (triton_cache.store,) + args[3:]
    print("qks", qk_store_mismatches(*store), qk_store_mismatches(*store, fault="key"),
          qk_store_mismatches(*store, fault="value"))
    case = residual_case(dt, "cpu", R=3, H=64)
    print("res", residual_mismatches(triton_fused.residual_norm, triton_rows.rmsnorm, case),
          residual_mismatches(triton_fused.residual_norm, triton_rows.rmsnorm, case, fault=True))
    for shared in (False, True):
        case = combine_case(dt, "cpu", R=3, K=3, H=64, shared=shared)
        args = (triton_fused.combine_residual_norm, triton_moe_rows.combine, triton_rows.rmsnorm, case)
        print("comb", combine_mismatches(*args), combine_mismatches(*args, fault="weight"),
              combine_mismatches(*args, fault="norm"))
tg.with_config("linear", 64, 96, torch.bfloat16, "interp", tg.GemmConfig(16, 16, 16, 1, 4, split_k=3))
for M in (3, 17):                                     # one block of 16 rows, two
    args = (triton_dense_norm.try_dense_residual_norm, tg.linear, triton_fused.residual_norm,
            dense_norm_case(torch.bfloat16, "cpu", M=M, N=64, K=96, seed=M))
    print("dres", dense_norm_mismatches(*args), dense_norm_mismatches(*args, fault="weight"),
          dense_norm_mismatches(*args, fault="norm"))
for n in (48, 40):
    tg.with_config("linear", n, 64, torch.bfloat16, "interp", tg.GemmConfig(16, 16, 16, 1, 4, split_k=2, tma=False))
x = torch.randn(2, 64).to(torch.bfloat16)
ws = [torch.randn(n, 64).to(torch.bfloat16) for n in (48, 40, 40)]


def group(ws):
    print("group", int(triton_group.serves(x, tuple(ws))), group_mismatches(tg.linear, triton_group.linear_many, x,
                                                                             ws),
          group_mismatches(tg.linear, triton_group.linear_many, x, ws, fault=True))
group(ws)                                             # one config
tg.with_config("linear", 48, 64, torch.bfloat16, "interp", tg.GemmConfig(16, 32, 16, 1, 4, split_k=3, tma=False))
tg._PLANS.clear()
group(ws)                                             # the first weight's own tile columns and split_k
group([ws[1], ws[0], ws[2]])                          # ... the second's (launched first)
w56 = torch.randn(56, 64).to(torch.bfloat16)          # a third tile columns and split_k: no grouped launch
tg.with_config("linear", 56, 64, torch.bfloat16, "interp", tg.GemmConfig(16, 64, 16, 1, 4, split_k=4, tma=False))
print("apart", int(triton_group.serves(x, (ws[0], ws[1], w56))), group_mismatches(
    tg.linear, triton_group.linear_many, x, [ws[0], ws[1], w56]))
triton_group.MIXED = False                            # one config per launch: the pair of 40 rows alone
print("unmixed", int(triton_group.serves(x, tuple(ws))), int(triton_group.serves(x, tuple(ws[1:]))),
      group_mismatches(tg.linear, triton_group.linear_many, x, ws))
triton_group.MIXED = True
triton_split.COUNT_SLOTS = 0                          # the sums in second launches
group(ws)
group([ws[1], ws[0], ws[2]])
"""


@NEEDS_TRITON
def test_interpreter_fused_kernels_give_the_kernels_bytes_and_planted_faults_are_caught():
    rows = interpreted_rows(_INTERP)
    head = ["qk", "qks", "res", "comb", "comb"] * 2 + ["dres"] * 2
    assert [r[0] for r in rows] == head + ["group"] * 3 + ["apart", "unmixed"] + ["group"] * 2
    assert all(int(r[1]) == 0 and all(int(v) > 0 for v in r[2:]) for r in rows[:len(head)])
    assert all(r[1:3] == ["1", "0"] and int(r[3]) > 0 for r in rows if r[0] == "group")
    assert rows[15][1:] == ["0", "0"] and rows[16][1:] == ["0", "1", "0"]
