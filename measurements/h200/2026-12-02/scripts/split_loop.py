"""Device experiment: GemmConfig.split_loop runs / fold / flat on the split-K dense shapes, GPU time (graph
replay) against cuBLAS, and bytes against the current config's output (and the parallel split path)."""
import sys
from dataclasses import replace

import torch

sys.path.insert(0, "benchmarks")
import bench_gpu_kernels as bg  # noqa: E402
from exactness.kernels import triton_gemm as tg  # noqa: E402

torch.manual_seed(0)
rows = []
for name in ("q", "k/v", "o"):
    N, K = bg.SHAPES[name]
    w = bg._rand(N, K, scale=K ** -0.5)
    base = tg.config_for("linear", N, K, torch.bfloat16, (9, 0))
    for M in (1, 64, 256, 512, 4096, 16384):
        x = bg._rand(M, K)
        ref = tg.linear(x, w, base)
        cub = bg.graph_ms(lambda: torch.nn.functional.linear(x, w))
        line = [f"{name:4s} M={M:6d} cuBLAS {cub * 1e3:8.1f} us"]
        for loop in ("runs", "fold", "flat"):
            c = replace(base, split_loop=loop)
            below = tg.SPLIT_TILES_BELOW
            tg.SPLIT_TILES_BELOW = 0                    # every M in one program per tile: the path under test
            try:
                y = tg.linear(x, w, c)
                t = bg.graph_ms(lambda: tg.linear(x, w, c))
            finally:
                tg.SPLIT_TILES_BELOW = below
            same = torch.equal(y.view(torch.int16), ref.view(torch.int16))
            line.append(f"{loop} {t / cub:5.2f}x {'=' if same else 'DIFF'}")
        t_def = bg.graph_ms(lambda: tg.linear(x, w, base))
        line.append(f"| as configured {t_def / cub:5.2f}x")
        print("  ".join(line), flush=True)
