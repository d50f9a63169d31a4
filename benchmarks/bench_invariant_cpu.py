"""CPU speed of the invariant prompt kernels against the fast prompt kernels, per kernel class and row count M.

Not a test. For every class and M in (1, 64, 256, 1024, 4096) both prompt kernels run on the same inputs (the
contract checker's seeded random rows, tiny-preset shapes; attention: a prompt block of M query rows at positions
0..M-1 against a cache holding them), measured side by side in one process with torch.utils.benchmark.Timer
(blocked_autorange; the median per call is reported), invariant and fast alternating per (class, M).

    python benchmarks/bench_invariant_cpu.py [--dtype bfloat16|float32] [--threads N] [--min-time 0.2]
    python benchmarks/bench_invariant_cpu.py --budgets     # the invariant attention's ATT_BATCH_BYTES, prefills

``--budgets`` times instead the invariant set's prefill of exact-length prompts (tiny preset, bf16) at several
attention.ATT_BATCH_BYTES (0: every tile in a call of its own), the budgets alternating round by round, median of
5, and checks that every budget gives the first one's logit bytes.
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


BUDGETS = (0, 1 << 20, 2 << 20, 4 << 20, 8 << 20)
PREFILLS = ((300, "batched", 128), (1024, "deep", 256), (2048, "deep", 256), (2048, "batched", None))


def budgets() -> None:
    """Invariant prefill time per attention.ATT_BATCH_BYTES (module docstring)."""
    import statistics
    import time

    from exactness import paths
    from exactness.analysis.bench import exact_length_ids
    from exactness.cache import KVCache
    from exactness.checkpoint import load_model
    from exactness.kernels import attention
    from exactness.prompts import build_prompt
    w, _ = load_model("tiny", "cpu", "bfloat16", None, "bf16")
    src = [build_prompt(n, None).ids for n in ("code", "docs")]
    saved, rows = attention.ATT_BATCH_BYTES, []
    try:
        for n, path, step in PREFILLS:
            ids, t, ref = exact_length_ids(n, src), {b: [] for b in BUDGETS}, None
            for _ in range(5):
                for b in BUDGETS:
                    attention.ATT_BATCH_BYTES = b
                    cache = KVCache(w.cfg, n + 1, 1, w.dtype, w.device)
                    t0 = time.perf_counter()
                    logits = paths.prefill(w, cache, ids, "invariant", paths.Schedule(path, step, 128)).logits
                    t[b].append(time.perf_counter() - t0)
                    ref = logits if ref is None else ref
                    if not torch.equal(logits.view(torch.int32), ref.view(torch.int32)):
                        raise SystemExit(f"ATT_BATCH_BYTES={b} changed the logits of the {n}-token prefill")
            med = {b: statistics.median(v) for b, v in t.items()}
            rows.append([f"{n} {path}@{step}"] + [f"{m * 1e3:.1f} ({m / med[0]:.2f})" for m in med.values()])
    finally:
        attention.ATT_BATCH_BYTES = saved
    print(tabulate(rows, headers=["prefill"] + [f"{b >> 20} MiB: ms (/ 0 MiB)" for b in BUDGETS],
                   disable_numparse=True))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds of timing per kernel and M")
    ap.add_argument("--budgets", action="store_true", help="time invariant prefills per ATT_BATCH_BYTES instead")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.budgets:
        return budgets()
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
