"""Speed of the invariant set's Triton kernels against the fast set (cuBLAS, SDPA, torch ops) on one CUDA GPU.

Run from the repository root on the GPU machine (needs torch and triton; the package need not be installed):

    PYTHONPATH=lib python3 benchmarks/bench_gpu_kernels.py [--sections ceilings,gemm,gate_up,attention,rows,
        overhead,moe,profile,decode_step,e2e,compile,contract,oracle,drafted,tests] [--tune] [--out DIR]
        [--e2e-weights synthetic|device]

Every ratio is invariant time / fast time (lower is better) and is printed with its goal, met or missed:
GEMM / cuBLAS <= 1.05 at M >= 4096 and <= 1.25 at M = 64..512 for the ``small`` preset's dense (2048->4096 q,
2048->512 k/v, 4096->2048 o) and expert (2048->768 gate/up, 768->2048 down) shapes, judged on GPU time (CUDA-graph
replay, L2 warm; the do_bench ratio with host launch and L2 flush is printed beside it); decode-step time
invariant / fast <= 1.05 (wall clock with torch.cuda.synchronize, as end-to-end times). Other kernel times are
medians of triton.testing.do_bench (CUDA events, L2 flushed before each run).

``--tune`` times every candidate tile config per weight shape (configs are chosen per (N, K), never per M; the
candidates run as given, without the placements small calls take), pins
the best one in-process (gemm_configs.with_config) for the later sections and prints the table to paste into
gemm_configs.SHAPE_CONFIGS. ``--sections compile`` needs no GPU: it compiles every kernel for sm_120 offline.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))

from exactness import paths  # noqa: E402
from exactness.config import get_preset  # noqa: E402
from exactness.kernels import attention as fast_attn  # noqa: E402
from exactness.kernels import cuda, experts, fast_cuda, fast_fused, offline_compile, rope, router  # noqa: E402
from exactness.loop import decode_step as eager_step  # noqa: E402
from exactness.weights import device_random_weights  # noqa: E402

SHAPES = {"q": (4096, 2048), "k/v": (512, 2048), "o": (2048, 4096), "gate|up": (768, 2048), "down": (2048, 768),
          "router": (128, 2048), "lm_head": (258, 2048)}
TARGETED = ("q", "k/v", "o", "gate|up", "down")
MS = (1, 64, 128, 256, 512, 4096, 16384)
BF16 = torch.bfloat16


def goal(M: int) -> float | None:
    """The GEMM/cuBLAS ratio goal at M rows (None: no goal, reported only)."""
    return 1.05 if M >= 4096 else 1.25 if 64 <= M <= 512 else None


def linear_candidates():
    """Candidate sm_90 bf16 tile configs for ``linear`` (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, flags)."""
    from exactness.kernels.triton_gemm import GemmConfig as C
    return [C(128, 128, 64, 4, 8), C(128, 128, 64, 4, 8, persistent=True), C(128, 256, 64, 3, 8),
            C(128, 256, 64, 3, 8, persistent=True), C(128, 64, 64, 4, 4), C(128, 64, 64, 5, 4, persistent=True),
            C(64, 128, 64, 4, 4), C(64, 64, 128, 4, 4), C(128, 128, 128, 3, 8), C(128, 32, 128, 4, 4)]


def gate_up_candidates():
    """Candidate sm_90 bf16 tile configs for the fused ``gate_up`` (BLOCK_N is per matrix)."""
    from exactness.kernels.triton_gemm import GemmConfig as C
    return [C(128, 64, 64, 4, 8), C(128, 64, 64, 4, 8, persistent=True), C(128, 128, 64, 3, 8),
            C(64, 64, 64, 4, 4), C(128, 32, 128, 4, 4), C(64, 128, 64, 3, 4)]


def attention_candidates():
    """Candidate attention configs (BLOCK_M rows, BLOCK_N keys per block, warps, stages, keys per chunk); 128 x 128
    with 3 stages needs more than sm_90's 232 KB of shared memory since the softmax sum runs through the MMA."""
    from exactness.kernels.triton_attention import AttnConfig as A
    return [A(128, 64, 8, 3), A(128, 128, 8, 2), A(64, 128, 8, 3), A(64, 64, 4, 3), A(128, 64, 8, 3, 256),
            A(128, 64, 8, 3, 128)]


def ms(fn, rep: int = 25) -> float:
    """Median milliseconds of ``fn`` (triton.testing.do_bench: CUDA events, L2 flushed before each call)."""
    import triton
    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def graph_ms(fn, rep: int = 10) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph: GPU time without host launch cost (L2 warm)."""
    import triton
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def host_us(fn, warm: int, n: int) -> float:
    """Host microseconds per call of ``fn`` over ``n`` back-to-back calls after ``warm`` warm-up calls (the launch
    cost: the device is synchronized before the clock starts, not inside the loop)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def _rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(BF16)


# ------------------------------------------------------------------------------------------------ sections

def ceilings(_args) -> dict:
    """Measured bf16 matmul rate (8192^3, random data) and device-to-device copy bandwidth."""
    a, b = _rand(8192, 8192), _rand(8192, 8192)
    t = ms(lambda: a @ b, rep=100)
    src = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    tc = ms(lambda: dst.copy_(src), rep=100)
    out = {"matmul_tflops": 2 * 8192 ** 3 / t / 1e9, "copy_gbs": 2 * src.numel() / tc / 1e6}
    print(f"ceilings: bf16 matmul {out['matmul_tflops']:.0f} TFLOP/s, d2d copy {out['copy_gbs']:.0f} GB/s")
    return out


def _linear_times(name: str, cfg, Ms=MS) -> dict:
    from exactness.kernels import triton_gemm as tg
    N, K = SHAPES[name]
    w = _rand(N, K, scale=K ** -0.5)
    out = {}
    for M in Ms:
        x = _rand(M, K)
        out[M] = ms(lambda: tg.linear(x, w, cfg))
    return out


def _cublas_times(name: str, Ms=MS) -> dict:
    N, K = SHAPES[name]
    w = _rand(N, K, scale=K ** -0.5)
    return {M: ms(lambda x=_rand(M, K): torch.nn.functional.linear(x, w)) for M in Ms}


def _score(times: dict, base: dict) -> float:
    """max over M of (ratio / goal) (M without a goal: ratio / 2, so decode GEMVs still count a little)."""
    return max((times[M] / base[M]) / (goal(M) or 2.0) for M in times)


def gemm(args) -> dict:
    """GEMM / cuBLAS per shape and M as the wrapper runs it (the shape's current or tuned config, in its placement
    for M: gemm_configs.placements); with --tune, the candidate sweep."""
    from exactness.kernels import triton_gemm as tg
    cap = torch.cuda.get_device_capability()
    arch = tg.arch_of(cap)
    res = {"rows": [], "tuning": []}
    for name, (N, K) in SHAPES.items():
        base = _cublas_times(name)
        cfg = tg.config_for("linear", N, K, BF16, cap)
        if args.tune:
            best = None
            for cand in linear_candidates():
                try:
                    t = _linear_times(name, cand)
                except Exception as e:  # a candidate that does not compile or fit is skipped, and shown
                    res["tuning"].append({"shape": name, "config": cand.label(), "error": repr(e)[:200]})
                    continue
                sc = _score(t, base)
                res["tuning"].append({"shape": name, "config": cand.label(), "score": sc,
                                      **{f"M={M}": t[M] / base[M] for M in MS}})
                if best is None or sc < best[0]:
                    best = (sc, cand, t)
            if best is None:
                raise RuntimeError(f"no linear candidate ran for {name}")
            cfg = best[1]
            tg.with_config("linear", N, K, BF16, arch, cfg)
            t = best[2]
        else:
            t = _linear_times(name, None)
        w = _rand(N, K, scale=K ** -0.5)
        placed = tg.placements("linear", N, K, BF16, cap)
        for M in MS:
            x = _rand(M, K)
            gi = graph_ms(lambda: tg.linear(x, w))                     # the wrapper's choice: its placement for M
            gc = graph_ms(lambda: torch.nn.functional.linear(x, w))
            r, g = gi / gc, goal(M) if name in TARGETED else None
            used = next(c for rows, c in placed if M <= rows)
            res["rows"].append({"shape": name, "N": N, "K": K, "M": M, "config": used.label(),
                                "cublas_us": base[M] * 1e3, "invariant_us": t[M] * 1e3,
                                "launch_ratio": t[M] / base[M], "cublas_gpu_us": gc * 1e3,
                                "invariant_gpu_us": gi * 1e3, "ratio": r, "goal": g,
                                "met": None if g is None else r <= g})
    _print_rows("GEMM invariant / cuBLAS (bf16); ratio = GPU time (CUDA graph); launch_ratio = do_bench with "
                "host launch", res["rows"])
    if res["tuning"]:
        print(tabulate(res["tuning"], headers="keys", floatfmt=".3f", tablefmt="github"))
    return res


def _print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    print(tabulate([{k: (("met" if v else "MISSED") if k == "met" and v is not None else v) for k, v in r.items()}
                    for r in rows], headers="keys", floatfmt=".3f", tablefmt="github"))


def gate_up(args) -> dict:
    """Fused invariant gate_up vs the fast set's (2 cuBLAS GEMMs + SiLU + mul), and vs 2 cuBLAS GEMMs alone."""
    from exactness.kernels import triton_gemm as tg
    cap = torch.cuda.get_device_capability()
    N, K = SHAPES["gate|up"]
    wg, wu = _rand(N, K, scale=K ** -0.5), _rand(N, K, scale=K ** -0.5)
    xs = {M: _rand(M, K) for M in MS}
    res = {"rows": [], "tuning": []}
    cfg = tg.config_for("gate_up", N, K, BF16, cap)
    if args.tune:
        two = {M: ms(lambda x=xs[M]: (torch.nn.functional.linear(x, wg), torch.nn.functional.linear(x, wu)))
               for M in MS}
        best = None
        for cand in gate_up_candidates():
            try:
                t = {M: ms(lambda x=xs[M]: tg.gate_up(x, wg, wu, cand)) for M in MS}
            except Exception as e:
                res["tuning"].append({"config": cand.label(), "error": repr(e)[:200]})
                continue
            sc = _score(t, two)
            res["tuning"].append({"config": cand.label(), "score": sc, **{f"M={M}": t[M] / two[M] for M in MS}})
            if best is None or sc < best[0]:
                best = (sc, cand)
        if best is None:
            raise RuntimeError("no gate_up candidate ran")
        cfg = best[1]
        tg.with_config("gate_up", N, K, BF16, tg.arch_of(cap), cfg)
    for M in MS:
        x = xs[M]
        t = graph_ms(lambda: tg.gate_up(x, wg, wu))
        f = graph_ms(lambda: experts.gate_up_fast(x, wg, wu))
        c2 = graph_ms(lambda: (torch.nn.functional.linear(x, wg), torch.nn.functional.linear(x, wu)))
        g = goal(M)
        used = next(c for rows, c in tg.placements("gate_up", N, K, BF16, cap) if M <= rows)
        res["rows"].append({"M": M, "config": used.label(), "fast_gpu_us": f * 1e3, "2xcublas_gpu_us": c2 * 1e3,
                            "invariant_gpu_us": t * 1e3, "vs_fast": t / f, "vs_2xcublas": t / c2, "goal": g,
                            "met": None if g is None else t / c2 <= g})
    _print_rows("fused gate_up (2048->768 x2), GPU time (CUDA graph): invariant vs fast set and vs 2 cuBLAS GEMMs",
                res["rows"])
    if res["tuning"]:
        print(tabulate(res["tuning"], headers="keys", floatfmt=".3f", tablefmt="github"))
    return res


def attention(args) -> dict:
    """Prefill (causal, one slot) and decode attention: invariant Triton vs the fast set (SDPA), small preset."""
    from exactness.kernels import triton_attention as ta
    cfgm = get_preset("small")
    Hq, Hkv, D = cfgm.n_heads, cfgm.n_kv_heads, cfgm.head_dim
    cap = torch.cuda.get_device_capability()
    res = {"rows": [], "tuning": []}
    cases = []
    for P in (4096, 16384):
        kc, vc = _rand(1, P, Hkv, D), _rand(1, P, Hkv, D)
        q = _rand(P, Hq, D)
        pos = torch.arange(P, device="cuda")
        slots = torch.zeros_like(pos)
        cases.append((f"prefill P={P}", q, kc, vc, slots, pos, fast_attn.attention_fast_prompt))
        cases.append((f"decode pos={P - 1}", q[-1:], kc, vc, slots[-1:], pos[-1:], fast_attn.attention_fast_decode))
        qh, kh, vh = q.transpose(0, 1)[None], kc[0].transpose(0, 1)[None], vc[0].transpose(0, 1)[None]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):   # the reference is flash attention, not cuDNN's
            causal = ms(lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                                                  enable_gqa=True))
        res["rows"].append({"case": f"SDPA is_causal (flash, reference) P={P}", "fast_us": causal * 1e3})
    cands = attention_candidates() if args.tune else [ta.config_for(D, BF16, cap)]
    fast_t = {name: ms(lambda: fast(q, kc, vc, slots, pos)) for name, q, kc, vc, slots, pos, fast in cases}
    for c in cands:
        for name, q, kc, vc, slots, pos, _ in cases:
            try:
                t = ms(lambda: ta.attention(q, kc, vc, slots, pos, c))
            except Exception as e:
                res["tuning"].append({"config": c.label(), "case": name, "error": repr(e)[:200]})
                continue
            f = fast_t[name]
            flops = 4 * q.shape[0] * Hq * D * (pos.float().mean().item() + 1)
            res["rows"].append({"case": name, "config": c.label(), "fast_us": f * 1e3, "invariant_us": t * 1e3,
                                "ratio": t / f, "invariant_tflops": flops / t / 1e9})
    if args.tune:
        def cost(c) -> float:                                  # prefill time + 4 x decode time (microseconds)
            mine = [r for r in res["rows"] if r.get("config") == c.label()]
            return (sum(r["invariant_us"] for r in mine if "prefill" in r["case"])
                    + 4 * sum(r["invariant_us"] for r in mine if "decode" in r["case"]))
        failed = {r["config"] for r in res["tuning"] if "error" in r}   # a config that failed a case is out
        ran = [c for c in cands if c.label() not in failed]
        if not ran:
            raise RuntimeError("no attention candidate ran every case")
        best = min(ran, key=cost)
        ta.SHAPE_CONFIGS[(D, "16bit", "sm90")] = best
        res["chosen"] = best.label()
        print(f"attention: chose {best.label()}")
    _print_rows("attention invariant / fast set (small preset heads, bf16)", res["rows"])
    return res


def rows(_args) -> dict:
    """Row kernels at 16384 rows: invariant Triton vs the fast set's kernels (compiled torch ops; the softmax/top-k
    row: the router's torch ops after its GEMM, eager)."""
    from exactness.kernels import triton_moe_rows as mr
    from exactness.kernels import triton_rows as tr
    cfgm = get_preset("small")
    M, H, Hq, D, k, E = 16384, cfgm.hidden, cfgm.n_heads, cfgm.head_dim, cfgm.top_k, cfgm.n_experts
    x, w = _rand(M, H), _rand(H)
    qh = _rand(M, Hq, D)
    pos = torch.arange(M, device="cuda")
    cos, sin = rope._table(D, cfgm.rope_theta, 1, qh.device, BF16)
    y, wts = _rand(M, k, H), torch.rand(M, k, device="cuda").to(BF16)
    logits = _rand(M, E, scale=3.0)
    cases = [("rmsnorm [16384, 2048]", lambda: tr.rmsnorm(x, w, 1e-6), lambda: fast_fused.rmsnorm(x, w, 1e-6)),
             ("rope [16384, 32, 128]", lambda: tr.rope(qh, pos, cos, sin), lambda: fast_fused.rope(qh, pos, 1e6)),
             ("combine [16384, 8, 2048]", lambda: mr.combine(y, wts, None),
              lambda: fast_fused.combine(y, wts, None)),
             ("softmax/top-8 [16384, 128]", lambda: mr.softmax_topk(logits, k, True),
              lambda: router._softmax_topk_tile(logits, k, True))]
    res = [{"case": n, "fast_us": ms(f) * 1e3, "invariant_us": ms(i) * 1e3} for n, i, f in cases]
    for r in res:
        r["ratio"] = r["invariant_us"] / r["fast_us"]
    _print_rows("row kernels invariant / fast (bf16)", res)
    return {"rows": res}


def overhead(_args) -> dict:
    """Host time per call (no sync; launch-bound) at decode size: the cost a decode step pays per kernel."""
    from exactness.kernels import triton_gemm as tg
    from exactness.kernels import triton_rows as tr
    x, wq = _rand(1, 2048), _rand(4096, 2048)
    h = _rand(2048)
    cases = [("linear M=1", lambda: tg.linear(x, wq), lambda: torch.nn.functional.linear(x, wq)),
             ("rmsnorm M=1", lambda: tr.rmsnorm(x, h, 1e-6), lambda: fast_fused.rmsnorm(x, h, 1e-6))]
    if hasattr(cuda, "moe_experts"):
        E, I, k = 128, 768, 8
        wg, wu, wd = _rand(E, I, 2048), _rand(E, I, 2048), _rand(E, 2048, I)
        idx = torch.arange(k, device="cuda")[None] * 3
        lay = [wg[e] for e in range(k)]
        cases.append(("moe experts M=1 (grouped vs 8 fast experts)", lambda: cuda.moe_experts(x, idx, wg, wu, wd),
                      lambda: [experts.down_fast(experts.gate_up_fast(x, g, g), g.T) for g in lay]))
    out = []
    for name, inv, fast in cases:
        out.append({"case": name, "invariant_us": host_us(inv, 20, 500), "fast_us": host_us(fast, 20, 500)})
    _print_rows("host time per call (us, launch-bound)", out)
    return {"rows": out}


def moe(_args) -> dict:
    """One layer's routed experts (small preset, bf16, random routing): the grouped kernel (one launch per
    projection) vs the same kernels expert by expert (decode/batched/deep plans) and the fast set's loop.

    Times are do_bench medians (host launch included: the loops are launch-bound). ``same_bytes``: the grouped
    rows equal the invariant one-by-one rows (exact.differing_rows).
    """
    from types import SimpleNamespace

    from exactness import model
    from exactness.exact import differing_rows
    from exactness.expert_providers import ResidentExperts
    from exactness.kernels import get_set
    cfgm = get_preset("small")
    E, I, H, k = cfgm.n_experts, cfgm.expert_inter, cfgm.hidden, cfgm.top_k
    wg, wu, wd = _rand(E, I, H, scale=H ** -0.5), _rand(E, I, H, scale=H ** -0.5), _rand(E, H, I, scale=I ** -0.5)
    prov = ResidentExperts([SimpleNamespace(w_gate=wg, w_up=wu, w_down=wd)])
    out = []
    for M in (1, 8, 64, 512, 4096, 16384):
        h = _rand(M, H)
        idx = torch.rand(M, E, device="cuda").topk(k, dim=1).indices                   # [M, k] int64
        plans = [model.DECODE] if M == 1 else [model.BATCHED, model.DEEP] if M >= 512 else [model.BATCHED]
        row = {"M": M, "grouped_us": ms(lambda: cuda.moe_experts(h, idx, wg, wu, wd)) * 1e3}
        y = cuda.moe_experts(h, idx, wg, wu, wd)
        for plan in plans:
            for ks in ("invariant", "fast"):
                ops = model.Ops(get_set(ks), plan)
                fn = lambda ops=ops: model._experts_one_by_one(ops, cfgm, h, idx, prov, 0)  # noqa: E731
                row[f"{ks}_{plan.kind}_loop_us"] = ms(fn, rep=50 if M < 4096 else 200) * 1e3
                if ks == "invariant":
                    row[f"same_bytes_{plan.kind}"] = int(differing_rows(y.reshape(M * k, H),
                                                                        fn().reshape(M * k, H)).sum()) == 0
        loop = row[f"invariant_{plans[0].kind}_loop_us"]
        row["speedup_vs_invariant_loop"] = loop / row["grouped_us"]
        row["vs_fast_loop"] = row["grouped_us"] / row[f"fast_{plans[0].kind}_loop_us"]
        out.append(row)
    _print_rows("MoE experts of one layer (small preset, bf16): grouped kernel vs expert-by-expert loops (us)", out)
    return {"rows": out}


_WEIGHTS: dict = {}


def _weights(kind: str):
    if kind not in _WEIGHTS:
        cfg = get_preset("small")
        t0 = time.perf_counter()
        if kind == "synthetic":
            from exactness.weights import synthetic_weights
            _WEIGHTS[kind] = synthetic_weights(cfg, BF16, "cuda")
        else:
            _WEIGHTS[kind] = device_random_weights(cfg, BF16, "cuda", seed=0)
        print(f"weights ({kind}) built in {time.perf_counter() - t0:.1f} s")
    return _WEIGHTS[kind]


def decode_step(args) -> dict:
    """Wall time of one decode step (small preset, 1 stream) after a 4096-token prompt: invariant vs fast set, each
    eager and replayed from a CUDA graph (graphs.GraphDecoder), all timed side by side in one loop. The prompt's
    fast-set prefill is timed twice first: in this process its first call compiles the fast set's graphs.

    The invariant set runs eagerly with Triton fast launch on and off (triton_rows.FAST_LAUNCH); both give the same
    logits. On graphs it runs with programmatic dependent launch on and off (triton_rows.PDL, fixed when the graph is
    captured), without the set's fused options (qk_norm_rope, dense_group, residual_norm, combine_residual_norm,
    dense_residual_norm: kernels/fused.py), with split-K partials summed by a second launch instead of each tile's
    last split (triton_split.COUNT_SLOTS = 0 while captured), and with the queries' projection in a launch of its
    own rather than grouped with the keys' and values' (triton_group.MIXED); every other row with PDL and the options
    on (the defaults on sm_90). A second capture of the default graph, timed as one more row, gives the noise floor
    of these side-by-side ratios (two graphs of one step differ by a few percent in wall time), and the rows' order
    turns each round. A graph step's logits are compared as bytes with the eager step's at the same position.
    """
    from exactness.cache import KVCache
    from exactness.exact import bytes_equal
    from exactness.kernels import triton_rows as tr
    w = _weights(args.e2e_weights)
    out, P = [], 4096
    ids = torch.randint(0, 256, (P,), generator=torch.Generator().manual_seed(0))
    first = []
    for _ in range(2):   # the fast set's first prefill in this process compiles its graphs (kernels/fast_fused.py)
        cache = KVCache(w.cfg, P + 64, 1, BF16, w.device)
        t0 = time.perf_counter()
        paths.prefill(w, cache, ids, "fast", paths.Schedule("batched", 4096))
        torch.cuda.synchronize()
        first.append(time.perf_counter() - t0)
    compile_row = {"first_prefill_s": first[0], "again_s": first[1]}
    _print_rows("the fast set's first 4,096-row prefill in this process (its torch.compile graphs compiled, or "
                "loaded from Inductor's cache) and the same prefill again, wall seconds", [compile_row])
    tok = ids[-1:].to(w.device)
    slots = torch.zeros(1, dtype=torch.int64, device=w.device)
    pos0 = torch.tensor([P], device=w.device)
    with tr.launch_settings():                          # the runs set both per row; restored here
        logits, dec, graph_same, times = _decode_step_runs(w, cache, tok, pos0, slots, P)
    med = {ks: statistics.median(t) for ks, t in times.items()}
    for ks, f in (("invariant", "fast"), ("invariant (fast launch off)", "fast"),
                  ("invariant (graphs)", "fast (graphs)")):
        i, fm = med[ks], med[f]
        out.append({"context": P, "set": ks, "fast_ms": fm * 1e3, "invariant_ms": i * 1e3, "ratio": i / fm,
                    "goal": 1.05, "met": i / fm <= 1.05})
    graph_rows = [{"set": ks, "eager_ms": med[ks] * 1e3, "graphs_ms": med[f"{ks} (graphs)"] * 1e3,
                   "speedup": med[ks] / med[f"{ks} (graphs)"], "pieces": dec[ks].info()["pieces"],
                   "reason": dec[ks].reason, "same_logits": graph_same[ks], "goal_ms": 1.0,
                   "met": med[f"{ks} (graphs)"] * 1e3 <= 1.0} for ks in ("fast", "invariant")]
    same = torch.equal(logits[False].view(torch.int32), logits[True].view(torch.int32))
    on = med["invariant (graphs)"]

    def versus(name: str, keys: tuple[str, str], title: str) -> dict:
        """The default invariant graph step (keys[0]) against the row ``name`` (keys[1]), side by side: both median
        wall times (ms), their ratio, and whether both give the same logit bytes; printed under ``title``."""
        other = med[f"{name} (graphs)"]
        row = {f"{keys[0]}_ms": on * 1e3, f"{keys[1]}_ms": other * 1e3, f"{keys[0]}/{keys[1]}": on / other,
               "same_logits": bytes_equal(logits["invariant"], logits[name]) and graph_same[name]}
        _print_rows(f"invariant decode step on graphs, {title}, median wall time", [row])
        return row
    pdl = versus("invariant (PDL off)", ("on", "off"), "programmatic dependent launch on vs off (triton_rows.PDL)")
    fusion = versus("invariant (unfused)", ("fused", "unfused"), "fused options (q/k norm + RoPE + KV store, "
                    "residual + norm, MoE combine + residual + norm, grouped q, k, v projections) on vs off")
    split_sum = versus("invariant (sum launches)", ("in_split", "sum_launch"), "split-K partials summed by each "
                       "tile's last split vs by a second launch (triton_split.split_counts)")
    mixed = versus("invariant (q apart)", ("qkv", "q_apart"), "q, k and v projections in one grouped launch vs q "
                   "alone and k, v grouped (triton_group.MIXED)")
    control = versus("invariant (again)", ("first", "again"), "the default graph captured twice: the noise floor "
                     "of the ratios above")
    _print_rows(f"decode step, small preset ({args.e2e_weights} weights), median wall time; fast launch on/off "
                f"logits identical: {same}", out)
    _print_rows("decode step with CUDA graphs (graphs.GraphDecoder) vs eager, same run", graph_rows)
    kernels = {}
    for ks in ("fast", "invariant"):
        kernels[f"{ks} (graphs)"] = _step_kernels(f"{ks} (graphs)", lambda: dec[ks].step(tok, [P], [0]))
        kernels[ks] = _step_kernels(ks, lambda: eager_step(w, cache, tok, pos0, slots, ks))
    kernels["invariant (PDL off) (graphs)"] = _step_kernels(
        "invariant (PDL off) (graphs)", lambda: dec["invariant (PDL off)"].step(tok, [P], [0]))
    for name in ("unfused", "q apart", "sum launches", "combine apart", "o apart", "KV store apart",
                 "routed one row", "logits widened apart"):
        row = f"invariant ({name}, PDL off)"
        kernels[f"{row} (graphs)"] = _step_kernels(f"{row} (graphs)", lambda: dec[row].step(tok, [P], [0]))
    return {"rows": out, "graphs": graph_rows, "fast_launch_same_logits": same, "pdl": pdl, "fusion": fusion,
            "split_sum": split_sum, "mixed": mixed, "control": control, "kernels": kernels,
            "fast_first_prefill": compile_row}


def _decode_step_runs(w, cache, tok, pos0, slots, P: int) -> tuple:
    """decode_step's runs: (eager logits with fast launch off/on and first-replay logits per graph, the graph
    decoders, their first replays equal the eager step's, wall times per row). Sets triton_rows.FAST_LAUNCH and
    PDL as each row asks (the caller restores them: triton_rows.launch_settings); a row's triton_split.COUNT_SLOTS,
    triton_group.MIXED, triton_moe.ONE_ROW and triton_split.WIDE are restored once its graph is captured. Rows
    profiled only: the MoE combine apart from the residual norm, the attention output projection apart from the
    residual norm (each without that option), the KV store apart from the q/k norms (an option that takes no
    store), a one-row call's experts routed (triton_moe.ONE_ROW off) and the logits widened by a copy launch after
    the lm_head GEMM (triton_split.WIDE empty)."""
    from exactness.exact import bytes_equal
    from exactness.graphs import GraphDecoder
    from exactness.kernels import KernelOptions, fused, get_set
    from exactness.kernels import triton_group as tgr
    from exactness.kernels import triton_moe as tm
    from exactness.kernels import triton_rows as tr
    from exactness.kernels import triton_split as ts
    logits = {}
    for fl in (False, True):
        tr.FAST_LAUNCH = fl
        logits[fl] = eager_step(w, cache, tok, pos0, slots, "invariant").clone()
    inv = get_set("invariant")
    unfused = dataclasses.replace(inv, name="invariant-unfused", options=inv.options.without(
        "qk_norm_rope", "dense_group", "residual_norm", "combine_residual_norm", "dense_residual_norm"))
    combine_apart = dataclasses.replace(inv, name="invariant-combine-apart",
                                        options=inv.options.without("combine_residual_norm"))
    o_apart = dataclasses.replace(inv, name="invariant-o-apart", options=inv.options.without("dense_residual_norm"))

    def qk_without_store(*a, **kw):
        return fused.qk_norm_rope(*a, **kw)
    qk_without_store.stands_for = fused.qk_norm_rope.stands_for                 # no stores_kv: cache.write
    store_apart = dataclasses.replace(inv, name="invariant-store-apart", options=KernelOptions.of(
        {**inv.options, "qk_norm_rope": qk_without_store}))
    dec, graph_same = {}, {}
    saved = {(ts, "COUNT_SLOTS"): ts.COUNT_SLOTS, (tgr, "MIXED"): tgr.MIXED, (tm, "ONE_ROW"): tm.ONE_ROW,
             (ts, "WIDE"): ts.WIDE}
    sums = {(ts, "COUNT_SLOTS"): 0}                                              # sums in a second launch
    apart = {(tgr, "MIXED"): False}                                              # q alone, k and v grouped
    for name, ks, pdl, settings in (
            ("fast", "fast", True, {}), ("invariant", "invariant", True, {}),
            ("invariant (PDL off)", "invariant", False, {}), ("invariant (unfused)", unfused, True, {}),
            ("invariant (unfused, PDL off)", unfused, False, {}),
            ("invariant (sum launches)", "invariant", True, sums),
            ("invariant (sum launches, PDL off)", "invariant", False, sums),
            ("invariant (q apart, PDL off)", "invariant", False, apart),
            ("invariant (q apart)", "invariant", True, apart),
            ("invariant (combine apart, PDL off)", combine_apart, False, {}),
            ("invariant (o apart, PDL off)", o_apart, False, {}),
            ("invariant (KV store apart, PDL off)", store_apart, False, {}),
            ("invariant (routed one row, PDL off)", "invariant", False, {(tm, "ONE_ROW"): False}),
            ("invariant (logits widened apart, PDL off)", "invariant", False, {(ts, "WIDE"): {}}),
            ("invariant (again)", "invariant", True, {})):
        tr.PDL = pdl                                                         # captured into the graph
        for (mod, k), v in settings.items():
            setattr(mod, k, v)
        try:
            eager = eager_step(w, cache, tok, pos0, slots, ks).clone()
            dec[name] = GraphDecoder(w, cache, ks)
            dec[name].step(tok, [P], [0])                                    # eager warm-up, then capture
            replay = dec[name].step(tok, [P], [0])                           # the first replay
        finally:
            for (mod, k), v in saved.items():
                setattr(mod, k, v)
        graph_same[name] = bytes_equal(eager, replay)
        logits[name] = replay.clone()
    tr.PDL = True
    times = {"fast": [], "invariant": [], "invariant (fast launch off)": [], "fast (graphs)": [],
             "invariant (graphs)": [], "invariant (PDL off) (graphs)": [], "invariant (unfused) (graphs)": [],
             "invariant (sum launches) (graphs)": [], "invariant (q apart) (graphs)": [],
             "invariant (again) (graphs)": []}
    rows = list(times)
    for rnd in range(7):
        for ks in rows[rnd:] + rows[:rnd]:                                   # each round starts one row later
            tr.FAST_LAUNCH = ks != "invariant (fast launch off)"
            name = ks.split(" ")[0]
            for i in range(8):
                pos = torch.tensor([P + i], device=w.device)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if ks.endswith("(graphs)"):
                    dec[ks[:-len(" (graphs)")]].step(tok, [P + i], [0])
                else:
                    eager_step(w, cache, tok, pos, slots, name)
                torch.cuda.synchronize()
                if rnd:                                                      # round 0 warms up
                    times[ks].append(time.perf_counter() - t0)
    return logits, dec, graph_same, times


def _step_kernels(label: str, step, top: int = 8) -> dict:
    """GPU time of one call of ``step`` by kernel (torch.profiler, CUDA activity): the sum over kernels, the wall
    time of the call, and the ``top`` kernels by total time (name, calls, microseconds). A kernel launched with
    programmatic dependent launch starts before its predecessor ends and waits for it, so its time counts that
    wait: profile a step without PDL for each kernel's own time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    evs = [(e.key, e.count, getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0))
           for e in prof.key_averages()]
    evs = sorted([e for e in evs if e[2] > 0], key=lambda e: -e[2])
    rows = [{"kernel": k[:70], "calls": n, "us": t} for k, n, t in evs[:top]]
    total = sum(t for _, _, t in evs)
    n = sum(c for _, c, _ in evs)
    _print_rows(f"{label}: one step's kernels: {n} launches, {total:.0f} us GPU, {wall * 1e6:.0f} us wall "
                "(profiled)", rows)
    return {"gpu_us": total, "launches": n, "wall_us": wall * 1e6, "top": rows}


def profile(args) -> dict:
    """Where a decode step's host time goes: cProfile of 20 invariant decode steps (small preset, 4096 context),
    the 25 functions with the most own time; and host time per call of a few launch ingredients."""
    import cProfile
    import io
    import pstats

    from exactness.cache import KVCache
    from exactness.kernels import triton_gemm as tg
    from exactness.kernels import triton_moe as tm
    w = _weights(args.e2e_weights)
    P = 4096
    cache = KVCache(w.cfg, P + 64, 1, BF16, w.device)
    ids = torch.randint(0, 256, (P,), generator=torch.Generator().manual_seed(0))
    paths.prefill(w, cache, ids, "invariant", paths.Schedule("batched", 4096))
    tok, slots = ids[-1:].to(w.device), torch.zeros(1, dtype=torch.int64, device=w.device)
    pos = [torch.tensor([P + i], device=w.device) for i in range(20)]
    for p in pos[:3]:
        eager_step(w, cache, tok, p, slots, "invariant")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for p in pos:
        eager_step(w, cache, tok, p, slots, "invariant")
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(buf.getvalue()[-6000:])
    x, wq = _rand(1, 2048), _rand(4096, 2048)
    ids8 = torch.arange(8, device="cuda")
    cases = {"torch.empty [1, 4096]": lambda: torch.empty(1, 4096, dtype=BF16, device="cuda"),
             "torch.sort 8 int64 stable": lambda: torch.sort(ids8, stable=True),
             "descriptor() fast": lambda: tg.descriptor(x, [128, 64]),
             "TensorDescriptor()": lambda: tg.TensorDescriptor(x, [1, 2048], [2048, 1], [128, 64]),
             "tg.linear M=1": lambda: tg.linear(x, wq),
             "F.linear M=1": lambda: torch.nn.functional.linear(x, wq),
             "x + x": lambda: x + x}
    out = []
    for name, fn in cases.items():
        out.append({"case": name, "host_us": host_us(fn, 50, 1000)})
    _print_rows(f"host time per call (us), SMALL_PAIRS={tm.SMALL_PAIRS}", out)
    return {"rows": out, "profile": buf.getvalue()[-20000:]}


E2E_PLANS = (("batched", None), ("batched", 2048), ("deep", 2048), ("deep", None))   # (path, step) per e2e run


def e2e(args) -> dict:
    """End-to-end prefill of the code prompt (``--e2e-tokens``, 0 = the whole ~16k-token prompt), invariant / fast.

    Per set and (path, step) in E2E_PLANS: median wall seconds (and their range) of paths.prefill into a fresh KV
    cache,
    synchronized, over ``--e2e-reps`` rounds that each run every (set, path, step) once in turn (after one warm-up
    of each); the ratio invariant / fast per (path, step) against the goal 1.10. Byte check: every invariant run's
    prompt logits equal the invariant one-chunk batched run's (and, with ``--e2e-oracle``, the serial decode
    oracle's, one decode step per prompt token).
    """
    from exactness.cache import KVCache
    from exactness.prompts import build_prompt
    w = _weights(args.e2e_weights)
    try:
        prompt, pinned = build_prompt("code", max_tokens=args.e2e_tokens or None), True
    except Exception as e:
        print(f"prompt pin: {e}; running unpinned")
        prompt, pinned = build_prompt("code", max_tokens=args.e2e_tokens or None, allow_unpinned=True), False
    ids = prompt.ids.to(w.device)
    P = ids.numel()

    def run(ks, path, step):
        cache = KVCache(w.cfg, P + 1, 1, w.dtype, w.device)
        served = {p: {"segments": 0, "rows": 0} for p in paths.PATHS}
        logits = paths.prefill(w, cache, ids, ks, paths.Schedule(path, step, 512), served=served).logits
        torch.cuda.synchronize()
        return logits, served

    plans = E2E_PLANS + ((("decode", None),) if args.e2e_oracle else ())
    runs = [(ks, path, step) for path, step in plans for ks in ("fast", "invariant")
            if not (path == "decode" and ks == "fast")]
    warm = {r: run(*r) for r in runs}                                       # warm-up (and the bytes)
    times = {r: [] for r in runs if r[1] != "decode"}
    for _ in range(args.e2e_reps):               # round by round through every run: the runs share any drift
        for r in times:
            t0 = time.perf_counter()
            run(*r)
            times[r].append(time.perf_counter() - t0)
    ref = warm[("invariant",) + E2E_PLANS[0]][0]
    out = []
    for (ks, path, step), (logits, served) in warm.items():
        diff = int((logits.view(torch.int32) != ref.view(torch.int32)).any(dim=1).sum()) if ks == "invariant" \
            else None
        t = times.get((ks, path, step))
        out.append({"set": ks, "path": path, "step": step, "prompt_tokens": P,
                    "prefill_s": statistics.median(t) if t else None,
                    "prefill_range_s": [min(t), max(t)] if t else None,
                    "rows_differing_vs_batched": diff, "served": json.dumps(served)})
    ratios = []
    for path, step in E2E_PLANS:
        f, i = ([r["prefill_s"] for r in out if r["set"] == ks and (r["path"], r["step"]) == (path, step)][0]
                for ks in ("fast", "invariant"))
        ratios.append({"path": path, "step": step, "prompt_tokens": P, "fast_s": f, "invariant_s": i,
                       "ratio": i / f, "goal": 1.10, "met": i / f <= 1.10})
    _print_rows(f"end-to-end prefill: code prompt ({P} tokens, pinned={pinned}), {args.e2e_weights} weights, "
                f"median of {args.e2e_reps}", out)
    _print_rows("end-to-end prefill invariant / fast", ratios)
    return {"rows": out, "ratios": ratios, "pinned": pinned}


def compile_sm120(_args) -> dict:
    """Offline compile of every kernel the small preset launches for sm_120 (no such GPU needed)."""
    rows_ = offline_compile.compile_report((12, 0), BF16, "small")
    _print_rows("compiled for sm_120 without the GPU (triton.compile, GPUTarget('cuda', 120, 32))", rows_)
    return {"rows": rows_}


def contract(args) -> dict:
    """The contract checker's sweep of the invariant set on cuda (if analysis/contract/check.py is present)."""
    from exactness.analysis.contract import check as ct
    from exactness.analysis.contract.combine import coverage
    t0 = time.perf_counter()
    res = ct.check_set("invariant", device="cuda", dtypes=("bfloat16", "float32"), sweep=args.contract_sweep,
                       progress=True)
    rows_ = [r.to_row() for r in res]
    cov, unc = coverage(rows_, ["invariant"], "cuda", ("bfloat16", "float32"))
    bad = sum(r.mismatches for r in res)
    print(f"contract ({args.contract_sweep}) invariant on cuda: {len(res)} pairs, {bad} mismatching rows, "
          f"{len(unc)} uncovered, {time.perf_counter() - t0:.1f} s")
    return {"rows": rows_, "coverage": cov, "uncovered": unc, "mismatches": bad}


def oracle(args) -> dict:
    """The serial decode oracle (paths.generate on the decode path: one decode step per prompt row), each set with
    its steps replayed from a CUDA graph (the prompt rows included) and eagerly, on a random ``--oracle-tokens``
    prompt, timed side by side: wall ms per prompt row, and the graph's info (pieces, replays, reason)."""
    from exactness.exact import bytes_equal
    w = _weights(args.e2e_weights)
    ids = torch.randint(0, 256, (args.oracle_tokens,), generator=torch.Generator().manual_seed(0))
    out, logits = [], {}
    for ks in ("invariant", "fast"):
        for graphs in (True, False):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = paths.generate(w, ids, 4, ks, paths.Schedule("decode"), graphs=graphs)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            logits[(ks, graphs)] = r.prompt_logits
            out.append({"set": ks, "graphs": graphs, "prompt_rows": ids.numel(), "seconds": dt,
                        "ms_per_row": dt / ids.numel() * 1e3, "pieces": r.graphs.get("pieces"),
                        "replays": r.graphs.get("replays"), "reason": r.graphs.get("reason")})
    for row in out:
        row["same_prompt_logits"] = bytes_equal(logits[(row["set"], True)], logits[(row["set"], False)])
    _print_rows(f"serial decode oracle, {ids.numel()} prompt rows: CUDA-graph replays vs eager steps", out)
    return {"rows": out}


def _timed(fn):
    """(fn(), wall seconds) with the device synchronized on both sides."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return r, time.perf_counter() - t0


def drafted(args) -> dict:
    """Drafted decode (MTP head, k = 2) with its forwards after the prefill replayed from CUDA graphs and eagerly,
    beside plain decode with graphs, each set, on a random ``--drafted-tokens`` prompt (batched prefill at 2048):
    wall ms per generated token after the prefill (the run's time less a one-token run's, timed in the same loop);
    the graph run's tokens and generated logits compared as bytes with the eager drafted run's, and the graphs'
    replays and reasons (per shape) where a shape did not serve. Every run is made once untimed first, at the
    same length (Triton compiles every kernel the timed run meets); each drafted run captures its own graphs, inside
    its timing."""
    from exactness import mtp
    from exactness.exact import bytes_equal
    w, gen = _weights(args.e2e_weights), 64
    head = mtp.resolve_mtp(w)                                               # built once, outside the timing
    ids = torch.randint(0, 256, (args.drafted_tokens,), generator=torch.Generator().manual_seed(0))
    sched, rows = paths.Schedule("batched", 2048), []
    runs = {"prefill": lambda ks, n: paths.generate(w, ids, 1, ks, sched),
            "drafted graphs": lambda ks, n: mtp.generate_drafted(w, ids, n, ks, sched, k=2, mtp=head, graphs=True),
            "drafted eager": lambda ks, n: mtp.generate_drafted(w, ids, n, ks, sched, k=2, mtp=head),
            "plain graphs": lambda ks, n: paths.generate(w, ids, n, ks, sched, graphs=True)}
    for ks in ("invariant", "fast"):
        for fn in runs.values():
            fn(ks, gen)                                                     # untimed warm-up: every shape met
        res = {name: _timed(lambda: fn(ks, gen)) for name, fn in runs.items()}
        pre, ref = res["prefill"][1], res["drafted eager"][0]
        for name in ("drafted eager", "drafted graphs", "plain graphs"):
            r, dt = res[name]
            rec = r.graphs_record() or {}
            rows.append({"set": ks, "run": name, "prompt": ids.numel(), "gen": gen,
                         "ms_per_token": (dt - pre) / gen * 1e3,
                         "acceptance": getattr(getattr(r, "stats", None), "acceptance_rate", None),
                         "same_as_eager_drafted": (bytes_equal(r.gen_ids, ref.gen_ids)
                                                   and bytes_equal(r.gen_logits, ref.gen_logits)),
                         "replays": rec.get("replays"), "reason": rec.get("reason")})
        e, g = ((res[n][1] - pre) for n in ("drafted eager", "drafted graphs"))
        rows[-2]["speedup_vs_eager"] = e / g
    _print_rows(f"drafted decode (MTP k=2), {ids.numel()}-token prompt, {gen} tokens: graphs vs eager, ms per "
                "generated token after the prefill", rows)
    return {"rows": rows}


def tests(_args) -> dict:
    """tests/test_cuda_kernels.py's GPU tests in this process, so they run with the configs pinned by --tune."""
    import pytest
    here = os.path.dirname(os.path.abspath(__file__))
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "-k", "gpu", os.path.join(here, "..", "tests",
                                                                                "test_cuda_kernels.py")])
    print(f"GPU tests exit code {int(rc)}")
    return {"exit_code": int(rc)}


SECTIONS = {"ceilings": ceilings, "gemm": gemm, "gate_up": gate_up, "attention": attention, "rows": rows,
            "overhead": overhead, "moe": moe, "profile": profile, "decode_step": decode_step, "e2e": e2e,
            "compile": compile_sm120, "contract": contract, "oracle": oracle, "drafted": drafted, "tests": tests}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="ceilings,gemm,gate_up,attention,rows,overhead,decode_step,compile")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--e2e-weights", default="device", choices=("device", "synthetic"))
    ap.add_argument("--e2e-tokens", type=int, default=0, help="cut the code prompt (0 = all ~16k tokens)")
    ap.add_argument("--e2e-reps", type=int, default=3)
    ap.add_argument("--e2e-oracle", action="store_true", help="also prefill on the serial decode path (slow)")
    ap.add_argument("--contract-sweep", default="full", choices=("quick", "full"))
    ap.add_argument("--oracle-tokens", type=int, default=3000, help="prompt rows of the oracle section")
    ap.add_argument("--drafted-tokens", type=int, default=4096, help="prompt rows of the drafted section")
    args = ap.parse_args(argv)
    names = [s for s in args.sections.split(",") if s]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    if any(s != "compile" for s in names) and not torch.cuda.is_available():
        ap.error("these sections need a CUDA device (only 'compile' runs without one)")
    results = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
               "torch": torch.__version__}
    for s in names:
        t0 = time.perf_counter()
        try:
            results[s] = SECTIONS[s](args)
        except Exception as e:
            traceback.print_exc()
            results[s] = {"error": repr(e)}
        results[s]["seconds"] = round(time.perf_counter() - t0, 1) if isinstance(results[s], dict) else None
        results.setdefault("fast_served", {})[s] = fast_cuda.served()   # bench_gpu_goals.baseline_note reads it
        print(f"[{s}: {time.perf_counter() - t0:.1f} s]", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "bench_gpu_kernels.json"), "w") as f:
                json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
