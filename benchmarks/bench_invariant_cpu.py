"""CPU speed of the invariant prompt kernels against the fast prompt kernels, per kernel class and row count M.

Not a test. For every class and M in (1, 64, 256, 1024, 4096) both prompt kernels run on the same inputs (the
contract checker's seeded random rows, tiny-preset shapes; attention: a prompt block of M query rows at positions
0..M-1 against a cache holding them), measured side by side in one process with torch.utils.benchmark.Timer
(blocked_autorange; the median per call is reported), invariant and fast alternating per (class, M).

    python benchmarks/bench_invariant_cpu.py [--dtype bfloat16|float32] [--threads N] [--min-time 0.2]
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.utils.benchmark as tb
from tabulate import tabulate

from exactness.analysis.contract.cases import make_pool
from exactness.kernels import KERNEL_CLASSES, get_set

MS = (1, 64, 256, 1024, 4096)


def median_ms(fn, args, min_time: float) -> float:
    """Median wall time of ``fn(*args)`` in milliseconds (torch.utils.benchmark.Timer.blocked_autorange)."""
    t = tb.Timer(stmt="fn(*args)", globals={"fn": fn, "args": args}, num_threads=torch.get_num_threads())
    return t.blocked_autorange(min_run_time=min_time).median * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds of timing per kernel and M")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dt = getattr(torch, a.dtype)
    inv, fast = get_set("invariant"), get_set("fast")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {a.dtype}, tiny-preset shapes, "
          f"median of blocked_autorange (min {a.min_time} s)")
    rows, ratios = [], {}
    with torch.no_grad():
        for cls in KERNEL_CLASSES:
            pool = make_pool(cls, "random", dt, "cpu")
            for M in MS:
                args = pool.args(torch.arange(M))
                t_inv = median_ms(inv.fn(cls, "prompt"), args, a.min_time)
                t_fast = median_ms(fast.fn(cls, "prompt"), args, a.min_time)
                ratios.setdefault(cls, []).append(t_inv / t_fast)
                rows.append([cls, M, f"{t_inv:.4f}", f"{t_fast:.4f}", f"{t_inv / t_fast:.2f}"])
    print(tabulate(rows, headers=["class", "M", "invariant ms", "fast ms", "invariant / fast"],
                   disable_numparse=True))
    print()
    geo = [[c, f"{math.exp(sum(map(math.log, r)) / len(r)):.2f}", f"{min(r):.2f}", f"{max(r):.2f}"]
           for c, r in ratios.items()]
    print(tabulate(geo, headers=["class", "geo-mean ratio over M", "min", "max"], disable_numparse=True))


if __name__ == "__main__":
    main()
