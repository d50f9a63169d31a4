"""Split-K GEMM configs of the small preset on one CUDA GPU (benchmark, not a test): GPU time / cuBLAS, bytes compared.

Run from the repository root on the GPU machine:

    PYTHONPATH=lib python3 benchmarks/bench_split_k.py --part configs   # candidate configs for q, k/v, o
    PYTHONPATH=lib python3 benchmarks/bench_split_k.py --part rows      # parallel runs against runs in turn

``configs``: per shape and M (1 to 16,384), each candidate config (persistent or not, ``split_loop`` runs / fold /
flat, pipeline stages) as GPU time (CUDA-graph replay) / cuBLAS, and whether its output equals the configured
config's bytes ("DIFF" where not). ``rows``: at M = 1 to 512, a split shape's runs in parallel programs (fp32
partials and their reduce) against one program per tile running them in turn, as GPU time / cuBLAS, and whether
the two outputs are equal bytes; the crossover sets triton_gemm.SPLIT_TILES_BELOW and SPLIT_MAX_ROWS.
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
            below, most = tg.SPLIT_TILES_BELOW, tg.SPLIT_MAX_ROWS
            try:
                tg.SPLIT_TILES_BELOW, tg.SPLIT_MAX_ROWS = 10 ** 9, 10 ** 9      # every call: parallel runs
                par = tg.linear(x, w)
                tp = bg.graph_ms(lambda: tg.linear(x, w))
                tg.SPLIT_TILES_BELOW = 0                                       # every call: runs in turn
                turn = tg.linear(x, w)
                tt = bg.graph_ms(lambda: tg.linear(x, w))
            finally:
                tg.SPLIT_TILES_BELOW, tg.SPLIT_MAX_ROWS = below, most
            print(f"{name:7s} {cfg.label():34s} M={M:4d} parallel {tp / cub:5.2f}x  in turn {tt / cub:5.2f}x  "
                  f"{'=' if _same(par, turn) else 'DIFF'}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("configs", "rows"), required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_split_k needs a CUDA device")
    torch.manual_seed(0)
    {"configs": configs, "rows": rows}[a.part]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
