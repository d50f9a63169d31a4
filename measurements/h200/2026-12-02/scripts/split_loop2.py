"""Device experiment 2: candidate configs (persistent or not, split loop, stages) for q, k/v, o; GPU time
(graph replay) / cuBLAS as each config runs (parallel split path where the wrapper takes it), bytes against the
current config's output."""
import sys
from dataclasses import replace

import torch

sys.path.insert(0, "benchmarks")
import bench_gpu_kernels as bg  # noqa: E402
from exactness.kernels import triton_gemm as tg  # noqa: E402

torch.manual_seed(0)
for name in ("q", "o", "k/v"):
    N, K = bg.SHAPES[name]
    w = bg._rand(N, K, scale=K ** -0.5)
    base = tg.config_for("linear", N, K, torch.bfloat16, (9, 0))
    cands = {"base": base, "P flat": replace(base, persistent=True, split_loop="flat"),
             "NP runs": replace(base, persistent=False), "NP fold": replace(base, persistent=False, split_loop="fold"),
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
            same = torch.equal(y.view(torch.int16), ref.view(torch.int16))
            line.append(f"{label} {t / cub:4.2f}{'' if same else ' DIFF'}")
        print(" | ".join(line), flush=True)
