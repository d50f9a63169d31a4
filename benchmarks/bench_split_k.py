"""GEMM configs and placements of the small preset on one CUDA GPU (benchmark, not a test): GPU time / cuBLAS, bytes
compared.

Run from the repository root on the GPU machine:

    PYTHONPATH=lib python3 benchmarks/bench_split_k.py --part configs      # candidate configs for q, k/v, o
    PYTHONPATH=lib python3 benchmarks/bench_split_k.py --part rows         # parallel runs against runs in turn
    PYTHONPATH=lib python3 benchmarks/bench_split_k.py --part placements   # small-M tiles (triton_gemm.PLACEMENTS)
    PYTHONPATH=lib python3 benchmarks/bench_split_k.py --part experts      # (triton_moe.EXPERT_PLACEMENTS)

``configs``: per shape and M (1 to 16,384), each candidate config (persistent or not, ``split_loop`` runs / fold /
flat, pipeline stages) as GPU time (CUDA-graph replay) / cuBLAS, and whether its output equals the configured
config's bytes ("DIFF" where not). ``rows``: at M = 1 to 512, a split shape's runs in parallel programs (fp32
partials and their reduce) against one program per tile running them in turn, as GPU time / cuBLAS, and whether
the two outputs are equal bytes; the crossover sets triton_split.SPLIT_TILES_BELOW and SPLIT_MAX_ROWS.
``placements``: per shape and M (1 to 512), the shape's config, the wrapper's choice and every candidate placement
(rows 16 / 64 / 128, columns, 4 warps 4 stages or 8 warps 3 stages) as GPU time / cuBLAS, each candidate's output
compared with the shape config's bytes at M = 1 to 600 ("DIFF" where a row differs). ``experts``: the grouped
experts of one layer (top-8 of 128) at 1, 8 and 64 rows, the same candidates for both GEMMs, in microseconds.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("configs", "rows", "placements", "experts"), required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_split_k needs a CUDA device")
    torch.manual_seed(0)
    {"configs": configs, "rows": rows, "placements": placements, "experts": experts}[a.part]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
