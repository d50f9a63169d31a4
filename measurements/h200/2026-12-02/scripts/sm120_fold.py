"""The folded split-K loop compiled for sm_120 offline (no GPU): every linear shape's sm_120 config with split_k = 4
and split_loop = "fold" (sm_120's own configs do not split K, so compile_report does not build that loop there)."""
from dataclasses import replace

from exactness.kernels import cuda
from exactness.kernels import triton_gemm as tg

orig = tg.config_for


def folded(kind, N, K, dtype, cap):
    c = orig(kind, N, K, dtype, cap)
    return replace(c, split_k=4, split_loop="fold") if kind == "linear" else c


tg.config_for = folded
for r in cuda.compile_report((12, 0)):
    if r["kernel"].startswith("gemm"):
        print(r)
