"""GEMM configs and placements of the small preset on one CUDA GPU (benchmark, not a test): GPU time / cuBLAS, bytes
compared.

Run from the repository root on the GPU machine:

    PYTHONPATH=lib python3 benchmarks/bench_split_k.py --part configs      # candidate configs for q, k/v, o
    PYTHONPATH=lib python3 benchmarks/bench_split_k.py --part rows         # parallel runs against runs in turn
    PYTHONPATH=lib python3 benchmarks/bench_split_k.py --part placements   # small-M tiles (gemm_configs.PLACEMENTS)
    PYTHONPATH=lib python3 benchmarks/bench_split_k.py --part experts      # (triton_moe.EXPERT_PLACEMENTS)
    PYTHONPATH=lib python3 benchmarks/bench_split_k.py --part stages       # the decode step at other depths

``configs``: per shape and M (1 to 16,384), each candidate config (persistent or not, ``split_loop`` runs / fold /
flat, pipeline stages) as GPU time (CUDA-graph replay) / cuBLAS, and whether its output equals the configured
config's bytes ("DIFF" where not). ``rows``: at M = 1 to 512, a split shape's runs in parallel programs (fp32
partials and their reduce) against one program per tile running them in turn, as GPU time / cuBLAS, and whether
the two outputs are equal bytes; the crossover sets triton_split.SPLIT_TILES_BELOW and SPLIT_MAX_ROWS.
``placements``: per shape and M (1 to 512), the shape's config, the wrapper's choice and every candidate placement
(rows 16 / 64 / 128, columns, 4 warps 4 stages or 8 warps 3 stages) as GPU time / cuBLAS, each candidate's output
compared with the shape config's bytes at M = 1 to 600 ("DIFF" where a row differs). ``experts``: the grouped
experts of one layer (top-8 of 128) at 1, 8 and 64 rows, the same candidates for both GEMMs, in microseconds.
``stages``: the invariant decode step on CUDA graphs with the decode-size placements' pipeline depth changed (the
GEMMs', the grouped experts'), side by side, and whether its logits keep their bytes.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "lib"))

import bench_gpu_kernels as bg  # noqa: E402
from exactness.kernels import triton_gemm as tg  # noqa: E402
from exactness.kernels import triton_split as ts  # noqa: E402

SM90 = (9, 0)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def configs() -> None:
    """Candidate configs for q, o and k/v at M = 1, 256, 512, 4096 and 16384."""
    for name in ("q", "o", "k/v"):
        N, K = bg.SHAPES[name]
        w = bg._rand(N, K, scale=K ** -0.5)
        base = tg.config_for("linear", N, K, torch.bfloat16, SM90)
        cands = {"base": base, "P flat": replace(base, persistent=True, split_loop="flat"),
                 "NP runs": replace(base, persistent=False),
                 "NP fold": replace(base, persistent=False, split_loop="fold"),
                 "NP fold s3": replace(base, persistent=False, split_loop="fold", num_stages=3),
                 "NP fold s5": replace(base, persistent=False, split_loop="fold", num_stages=5),
                 "P fold": replace(base, persistent=True, split_loop="fold")}
        print(f"{name} base {base.label()}")
        for M in (1, 256, 512, 4096, 16384):
            x = bg._rand(M, K)
            ref = tg.linear(x, w, base)
            cub = bg.graph_ms(lambda: torch.nn.functional.linear(x, w))
            line = [f"{name:4s} M={M:6d} cuBLAS {cub * 1e3:7.1f} us"]
            for label, c in cands.items():
                y = tg.linear(x, w, c)
                t = bg.graph_ms(lambda: tg.linear(x, w, c))
                line.append(f"{label} {t / cub:4.2f}{'' if _same(y, ref) else ' DIFF'}")
            print(" | ".join(line), flush=True)


def rows() -> None:
    """Each split shape at M = 1..512: its runs in parallel programs against in turn (the wrapper's two paths)."""
    for name in ("q", "k/v", "o", "router", "lm_head"):
        N, K = bg.SHAPES[name]
        w = bg._rand(N, K, scale=K ** -0.5)
        cfg = tg.config_for("linear", N, K, torch.bfloat16, SM90)
        for M in (1, 16, 64, 128, 192, 256, 384, 512):
            x = bg._rand(M, K)
            cub = bg.graph_ms(lambda: torch.nn.functional.linear(x, w))
            below, most = ts.SPLIT_TILES_BELOW, ts.SPLIT_MAX_ROWS
            try:
                ts.SPLIT_TILES_BELOW, ts.SPLIT_MAX_ROWS = 10 ** 9, 10 ** 9      # every call: parallel runs
                par = tg.linear(x, w)
                tp = bg.graph_ms(lambda: tg.linear(x, w))
                ts.SPLIT_TILES_BELOW = 0                                       # every call: runs in turn
                turn = tg.linear(x, w)
                tt = bg.graph_ms(lambda: tg.linear(x, w))
            finally:
                ts.SPLIT_TILES_BELOW, ts.SPLIT_MAX_ROWS = below, most
            print(f"{name:7s} {cfg.label():34s} M={M:4d} parallel {tp / cub:5.2f}x  in turn {tt / cub:5.2f}x  "
                  f"{'=' if _same(par, turn) else 'DIFF'}", flush=True)


def _candidates(base, kind: str) -> list:
    cols = (32, 64, 128) if kind == "gate_up" else (64, 128, 256)
    return [replace(base, block_m=bm, block_n=bn, num_warps=nw, num_stages=st, persistent=False)
            for bm in (16, 64, 128) for bn in cols for nw, st in ((4, 4), (8, 3)) if (bm, nw) != (128, 4)]


def placements() -> None:
    """Each shape at M = 1..512: shape config, wrapper's choice (its placement) and each candidate, / cuBLAS."""
    shapes = [(name, "gate_up" if name == "gate|up" else "linear", N, K) for name, (N, K) in bg.SHAPES.items()]
    for name, kind, N, K in shapes + [("gate|up alone", "linear", *bg.SHAPES["gate|up"])]:
        w, w2 = bg._rand(N, K, scale=K ** -0.5), bg._rand(N, K, scale=K ** -0.5)

        def call(x, c=None):
            return tg.gate_up(x, w, w2, config=c) if kind == "gate_up" else tg.linear(x, w, config=c)
        base = tg.config_for(kind, N, K, torch.bfloat16, SM90)
        x600 = bg._rand(600, K)
        ref = call(x600, base)
        cands = []
        for c in _candidates(base, kind):
            diff = [m for m in (1, 5, 64, 130, 600) if not _same(call(x600[:m], c), ref[:m])]
            if diff:
                print(f"{name} {c.label()} DIFF at M = {diff}")
            else:
                cands.append(c)
        for M in (1, 8, 64, 128, 256, 512):
            x = bg._rand(M, K)
            cub = bg.graph_ms(lambda: torch.nn.functional.linear(x, w)) * (2 if kind == "gate_up" else 1)
            times = sorted((bg.graph_ms(lambda: call(x, c)) / cub, c.label()) for c in cands)
            conf, chosen = bg.graph_ms(lambda: call(x, base)) / cub, bg.graph_ms(lambda: call(x)) / cub
            print(f"{name:13s} M={M:4d} cuBLAS {cub * 1e3:6.1f} us  config {conf:5.2f}  chosen {chosen:5.2f}  best: "
                  + ", ".join(f"{lab} {r:5.2f}" for r, lab in times[:3]), flush=True)


def experts() -> None:
    """One layer's grouped experts (E = 128, top-8) at 1, 8, 64 rows: candidate placements for both GEMMs, in us."""
    from exactness.kernels import triton_moe as tm
    E, I, H = 128, 768, 2048
    wg, wu = bg._rand(E, I, H, scale=H ** -0.5), bg._rand(E, I, H, scale=H ** -0.5)
    wd = bg._rand(E, H, I, scale=I ** -0.5)
    calls = {M: (bg._rand(M, H), torch.stack([torch.randperm(E, device="cuda")[:8] for _ in range(M)]))
             for M in (1, 8, 64)}
    gu0, dn0 = (tg.config_for(k, n, kk, torch.bfloat16, SM90) for k, n, kk in (("gate_up", I, H), ("linear", H, I)))
    real = tm.expert_placements
    try:
        tm.expert_placements = lambda *a: ((float("inf"), gu0, dn0),)
        tm._PLANS.clear()
        ref = {M: tm.experts(h, i, wg, wu, wd) for M, (h, i) in calls.items()}
        for gu, dn in [(gu0, dn0)] + [(g, replace(d, block_m=g.block_m)) for g in _candidates(gu0, "gate_up")
                                      for d in _candidates(dn0, "linear") if d.block_m == g.block_m
                                      and (d.num_warps, d.num_stages) == (g.num_warps, g.num_stages)]:
            tm.expert_placements = lambda *a, p=(float("inf"), gu, dn): (p,)
            tm._PLANS.clear()
            same = all(_same(tm.experts(h, i, wg, wu, wd), ref[M]) for M, (h, i) in calls.items())
            us = [bg.graph_ms(lambda: tm.experts(h, i, wg, wu, wd)) * 1e3 for h, i in calls.values()]
            print(f"gate/up {gu.label():26s} down {dn.label():26s} " + "  ".join(
                f"{M} rows {t:6.1f} us" for M, t in zip(calls, us)) + ("" if same else "  DIFF"), flush=True)
    finally:
        tm.expert_placements = real
        tm._PLANS.clear()


def _with_depth(dense: int | None, experts: int | None) -> None:
    """The decode-size placements (entries of at most 16 rows) of every GEMM shape run ``dense`` pipeline stages,
    the grouped experts' ``experts`` (None: the table's; plans rebuilt; placements change no byte)."""
    from exactness.kernels import triton_moe as tm
    for key, entries in tg.PLACEMENTS.items():
        tg.PLACEMENTS[key] = tuple((r, dict(o, num_stages=dense) if r <= 16 and dense else o) for r, o in entries)
    for key, entries in tm.EXPERT_PLACEMENTS.items():
        tm.EXPERT_PLACEMENTS[key] = tuple((r, dict(g, num_stages=experts), dict(d, num_stages=experts))
                                          if r <= 16 and experts else (r, g, d) for r, g, d in entries)
    tg._PLANS.clear()
    tm._PLANS.clear()


def stages() -> None:
    """The invariant decode step (small preset, 4,096 context, CUDA graphs) with its decode-size GEMM placements
    and its grouped experts at other pipeline depths, side by side: median wall ms, and whether the logits equal
    the tables' own (a placement changes no byte)."""
    import statistics
    import time

    from exactness.cache import KVCache
    from exactness.graphs import GraphDecoder
    from exactness.kernels import triton_moe as tm
    w, P = bg._weights("device"), 4096
    cache = KVCache(w.cfg, P + 64, 1, torch.bfloat16, w.device)
    ids = torch.randint(0, 256, (P,), generator=torch.Generator().manual_seed(0))
    bg.paths.prefill(w, cache, ids, "fast", bg.paths.Schedule("batched", 4096))
    tok = ids[-1:].to(w.device)
    saved = dict(tg.PLACEMENTS), dict(tm.EXPERT_PLACEMENTS)
    variants = [(None, None), (3, None), (6, None), (None, 4), (None, 5), (None, 7), (None, 8)]
    dec, logits, times = {}, {}, {}
    try:
        for dense, experts in variants:
            tg.PLACEMENTS.update(saved[0])
            tm.EXPERT_PLACEMENTS.update(saved[1])
            _with_depth(dense, experts)
            dec[dense, experts] = GraphDecoder(w, cache, "invariant")
            dec[dense, experts].step(tok, [P], [0])                                  # eager warm-up, capture
            logits[dense, experts] = dec[dense, experts].step(tok, [P], [0]).clone()
            times[dense, experts] = []
    finally:
        tg.PLACEMENTS.update(saved[0])
        tm.EXPERT_PLACEMENTS.update(saved[1])
        tg._PLANS.clear()
        tm._PLANS.clear()
    for rnd in range(6):
        for v in variants:
            for i in range(8):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dec[v].step(tok, [P + i], [0])
                torch.cuda.synchronize()
                if rnd:
                    times[v].append(time.perf_counter() - t0)
    base = statistics.median(times[None, None])
    for v in variants:
        t = statistics.median(times[v])
        print(f"dense stages {v[0] or 'table'}, expert stages {v[1] or 'table'}: {t * 1e3:.4f} ms "
              f"({t / base:.3f}), logits {'=' if _same(logits[v], logits[None, None]) else 'DIFF'}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("configs", "rows", "placements", "experts", "stages"), required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_split_k needs a CUDA device")
    torch.manual_seed(0)
    {"configs": configs, "rows": rows, "placements": placements, "experts": experts, "stages": stages}[a.part]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
