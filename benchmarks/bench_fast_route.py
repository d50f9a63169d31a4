"""The fast set's glue around its library kernels on CUDA, side by side in one process: the grouped experts' route
(kernels/fast_cuda._grouped: sort by expert, gather the pairs' rows, three torch._grouped_mm, SiLU * up, scatter
back) compiled as the set compiles it (torch.compile, the row count dynamic, the other sizes static) against
variants, and its RoPE (cos/sin evaluated per position, compiled alike) against variants and a cos/sin table
gathered by position. Shapes of the `small` preset (hidden 2048, 128 experts, top-8, expert width 768; 32 + 4 heads
of 128), random weights.

Run from the repository root on the GPU machine:

    PYTHONPATH=lib python3 benchmarks/bench_fast_route.py

Prints per variant and row count (a 16,022-row prompt, one decode row) the median GPU time of 20 calls (CUDA
events) and whether its bytes equal the set's compiled route's (the fast set claims no bytes: a variant that keeps
them could replace the route without moving the fast set's receipt rows); after each row count, what served the
set's calls (fast_cuda.served: a kernel that failed leaves its rows to its fallback, and the script says so).
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))

from exactness.kernels import fast_cuda, fast_fused  # noqa: E402
from exactness.kernels import rope as R  # noqa: E402

E, I, H, K = 128, 768, 2048, 8          # experts, expert width, hidden, top-k
HEADS, D, THETA = 36, 128, 1e6          # q + k heads, head size, RoPE base


def gpu_us(fn, n: int = 20) -> float:
    """Median GPU time of fn() in µs over n calls, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)


def variants(ws):
    """name -> fn(h, idx) -> y [M, k, H]; the first is the set's."""
    opts = fast_cuda._inductor_options()
    every = torch.compile(fast_cuda._grouped, dynamic=True, fullgraph=True, options=opts)
    static = torch.compile(fast_cuda._grouped, dynamic=False, fullgraph=True, options=opts)
    run = fast_cuda.run_compiled

    def aten_moves(h, idx):                       # the gather and the scatter by ATen, the rest compiled
        M, k = idx.shape
        order, offs = run(fast_cuda.route, idx, E)
        out = run(fast_cuda.grouped_swiglu, h.index_select(0, order // k), offs, *ws)
        y = h.new_empty(M, k, H)
        y.view(M * k, H).index_copy_(0, order, out)
        return y

    def aten_gathers(h, idx):                     # the scatter as a gather by the inverse permutation
        M, k = idx.shape
        order, offs = run(fast_cuda.route, idx, E)
        out = run(fast_cuda.grouped_swiglu, h.index_select(0, order // k), offs, *ws)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return out.index_select(0, inv).view(M, k, H)
    return {"compiled, row count dynamic (the set's)":
            lambda h, idx: run(fast_cuda._grouped, h, idx, *ws, rows=(0, 1)),
            "compiled, every size dynamic": lambda h, idx: every(h, idx, *ws),
            "compiled, static sizes": lambda h, idx: static(h, idx, *ws),
            "eager": lambda h, idx: fast_cuda._grouped(h, idx, *ws),
            "gather/scatter by ATen": aten_moves, "gather, inverse gather by ATen": aten_gathers}


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    r = lambda *s: (torch.randn(*s, device=dev) * 0.02).bfloat16()  # noqa: E731
    ws = (r(E, I, H), r(E, I, H), r(E, H, I))
    for M in (16022, 1):
        h = torch.randn(M, H, device=dev).bfloat16()
        idx = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(M)]) if M < 64 else \
            torch.rand(M, E, device=dev).topk(K, dim=1).indices            # distinct experts per row
        vs = variants(ws)
        ref = next(iter(vs.values()))(h, idx)
        for name, fn in vs.items():
            try:
                same = torch.equal(fn(h, idx).view(torch.int16), ref.view(torch.int16))
                print(f"route  M={M:6d}  {name:34s} {gpu_us(lambda: fn(h, idx)):10.1f} us  set's bytes: {same}")
            except Exception as e:  # noqa: BLE001 -- a variant this torch cannot compile is reported, not fatal
                print(f"route  M={M:6d}  {name:34s} failed: {type(e).__name__}: {str(e)[:160]}")
        _served(f"route  M={M:6d}")
    every = torch.compile(R.rope_fast, dynamic=True)
    tab = torch.compile(lambda x, p, c, s: R._rotate(x, c[p], s[p]), dynamic=True)
    for M in (16022, 1):
        x = torch.randn(M, HEADS, D, device=dev).bfloat16()
        pos = torch.arange(M, device=dev) + (4095 if M == 1 else 0)
        cos, sin = R._table(D, THETA, 65536, dev, torch.bfloat16)
        eager = R.rope_fast(x, pos, THETA)
        fns = {"row count dynamic (the set's)": lambda: fast_fused.rope(x, pos, THETA),
               "every size dynamic": lambda: every(x, pos, THETA), "table": lambda: tab(x, pos, cos, sin),
               "eager": lambda: R.rope_fast(x, pos, THETA)}
        for name, fn in fns.items():
            err = float((fn().float() - eager.float()).abs().max())
            print(f"rope   M={M:6d}  {name:34s} {gpu_us(fn):10.1f} us  max |this - eager| {err:.3g}")
        _served(f"rope   M={M:6d}")


def _served(rows: str) -> None:
    """Print what served the set's calls so far (fast_cuda.served), prefixed ``rows``; where a kernel had failed
    (fast_cuda.failed), that its calls from that failure on ran its fallback (kept for the process)."""
    print(f"{rows}  the set's kernels: " + ", ".join(f"{n} {v}" for n, v in fast_cuda.served().items()))
    if fast_cuda.failed():
        print(f"{rows}  a kernel of the set failed by here: its calls from then on ran its fallback")


if __name__ == "__main__":
    main()
