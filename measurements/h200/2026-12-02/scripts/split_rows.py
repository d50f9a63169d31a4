"""Device experiment: at M = 64..512, a split-K shape's runs in parallel programs (partials + reduce) against one
program per tile doing its runs in turn (the fold loop), GPU time (graph replay) / cuBLAS, bytes compared."""
import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_gpu_kernels as bg  # noqa: E402
from exactness.kernels import triton_gemm as tg  # noqa: E402

torch.manual_seed(0)
for name in ("q", "k/v", "o", "router", "lm_head"):
    N, K = bg.SHAPES[name]
    w = bg._rand(N, K, scale=K ** -0.5)
    cfg = tg.config_for("linear", N, K, torch.bfloat16, (9, 0))
    for M in (1, 16, 64, 128, 192, 256, 384, 512):
        x = bg._rand(M, K)
        cub = bg.graph_ms(lambda: torch.nn.functional.linear(x, w))
        below, rows = tg.SPLIT_TILES_BELOW, tg.SPLIT_MAX_ROWS
        tg.SPLIT_TILES_BELOW, tg.SPLIT_MAX_ROWS = 10 ** 9, 10 ** 9          # parallel runs
        par = tg.linear(x, w)
        tp = bg.graph_ms(lambda: tg.linear(x, w))
        tg.SPLIT_TILES_BELOW = 0                                           # in turn
        turn = tg.linear(x, w)
        tt = bg.graph_ms(lambda: tg.linear(x, w))
        tg.SPLIT_TILES_BELOW, tg.SPLIT_MAX_ROWS = below, rows
        same = torch.equal(par.view(torch.int16), turn.view(torch.int16))
        print(f"{name:7s} {cfg.label():34s} M={M:4d} parallel {tp / cub:5.2f}x  in turn {tt / cub:5.2f}x  "
              f"{'=' if same else 'DIFF'}", flush=True)
