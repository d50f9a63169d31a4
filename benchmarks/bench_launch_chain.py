"""The floor a chain of dependent kernels puts under a CUDA-graph step: wall time of a graph of N tiny Triton kernels,
each reading and writing what the one before wrote, launched as the invariant set launches its kernels
(triton_rows.launch, programmatic dependent launch on and off), side by side in one process.

Run from the repository root on the GPU machine:

    PYTHONPATH=lib python3 benchmarks/bench_launch_chain.py [--out DIR]

Prints, per programs per kernel and PDL on/off, the median wall time of one graph replay at each chain length and
the marginal cost of one more kernel in the chain (the slope between the shortest and the longest chain): a decode
step of K kernels cannot take less than about K times that slope, whatever its kernels compute.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl
from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))

from exactness.kernels import triton_rows as tr  # noqa: E402
from exactness.kernels.triton_rows import pdl_start  # noqa: E402

LENGTHS = (16, 64)            # kernels per graph (a decode step of the small preset launches 64 to 68)
PROGRAMS = (1, 132)           # programs per kernel: one, and one per H200 SM (a decode step's GEMMs fill them)
REPLAYS = 200


@triton.jit
def _chain_kernel(x_ptr, PDL: tl.constexpr):
    """Each program adds 1 to its int32 of x: the kernel depends on the one before, as a decode step's do."""
    pdl_start(PDL)
    p = tl.program_id(0)
    tl.store(x_ptr + p, tl.load(x_ptr + p) + 1)


def replay_us(n: int, programs: int, pdl: bool) -> float:
    """Median wall microseconds of one replay of a graph of n chained kernels of ``programs`` programs.

    Raises:
        RuntimeError: a replay did not run every kernel (x did not grow by n).
    """
    x = torch.zeros(programs, dtype=torch.int32, device="cuda")

    def chain() -> None:
        for _ in range(n):
            tr.launch(_chain_kernel, (programs,), (x,), {}, num_warps=4)
    with tr.launch_settings(pdl=pdl):
        chain()                                                  # compile, then capture with this PDL
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain()
    times = []
    for _ in range(REPLAYS):
        before = int(x[0])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if int(x[0]) != before + n:
            raise RuntimeError(f"a replay of {n} kernels added {int(x[0]) - before} to x")
    return statistics.median(times) * 1e6


def chain_rows(programs=PROGRAMS, pdls=(False, True)) -> list[dict]:
    """Per (programs per kernel, PDL): the median replay µs of each chain length and per_kernel_us, the slope
    between the shortest and the longest chain (replay_us's errors)."""
    rows = []
    for n_prog in programs:
        for pdl in pdls:
            us = {n: replay_us(n, n_prog, pdl) for n in LENGTHS}
            lo, hi = LENGTHS[0], LENGTHS[-1]
            rows.append({"programs": n_prog, "pdl": pdl, **{f"{n} kernels_us": us[n] for n in LENGTHS},
                         "per_kernel_us": (us[hi] - us[lo]) / (hi - lo)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    rows = chain_rows()
    print(f"## a graph of chained tiny kernels on {torch.cuda.get_device_name()}: median wall time of one replay "
          f"({REPLAYS} replays)")
    print(tabulate(rows, headers="keys", tablefmt="github", floatfmt=".2f"))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_launch_chain.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "replays": REPLAYS, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
