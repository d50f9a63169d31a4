"""Benchmark (not a test): the cost of the FP64 pass against the cost of the paths it judges, side by side.

    python benchmarks/bench_fp64.py                          # ci profile (tiny, CPU), the fp64 section's prompt
    python benchmarks/bench_fp64.py --profile gpu --tokens 2064 --rows 64    # on the GPU machine

For each kernel set and path (decode / batched / deep) on the prompt the fp64 section uses (fp64.capture_plan):
the path's run without taps (best of ``--reps``), the same run with the tap recorder (the difference is the tap
overhead), then the FP64 pass over that path's captured rows, split into references (fp64_ref.evaluate),
certification (fp64_cert.certify, ``--cert`` elements per row) and metrics (error statistics, ULPs, comparison
with decode). It prints, per path, the pass's seconds / the path's seconds, and the totals. The goal is
a ratio of at most 1 on the GPU (the pass must not dominate a receipt); on CPU the tiny model's paths are cheap
and Python-side certification dominates.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from exactness.analysis.fp64 import section as fp64  # noqa: E402
from exactness.analysis.fp64.cert import certify  # noqa: E402
from exactness.analysis.fp64.ref import evaluate  # noqa: E402
from exactness.analysis.taps import TapRecorder  # noqa: E402
from exactness.config import get_preset  # noqa: E402
from exactness.model import tapping  # noqa: E402
from exactness.paths import PATHS, Schedule, generate  # noqa: E402
from exactness.profiles import get_profile  # noqa: E402
from exactness.weights import synthetic_weights  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


def bench(p: dict, reps: int) -> list[list]:
    """Rows [set, path, run s, tapped s, refs s, cert s, metrics s, pass s, pass / run]."""
    dev = torch.device(p["device"])
    w = synthetic_weights(get_preset(p["preset"]), fp64.DTYPES[p["dtype"]], dev)
    plan = fp64.capture_plan(p)
    threshold = int(p["deep_threshold"])
    run = lambda ks, path: generate(w, plan["ids"], 1, ks, Schedule(path, plan["step"], threshold))  # noqa: E731
    rows = []
    for ks in p["kernel_sets"]:
        run(ks, "batched")                                                      # warm-up (tables, kernels)
        decode_evs = {}
        for path in PATHS:
            t_run = min(_timed(lambda: run(ks, path), dev) for _ in range(reps))
            rec = TapRecorder(plan["positions"], w)

            def tapped():
                with rec.run(path), tapping(rec):
                    run(ks, path)
            t_tap = _timed(tapped, dev)
            t = {"refs": 0.0, "cert": 0.0, "metrics": 0.0}
            for cls in fp64.CLASSES:
                kv = {k[2]: v for k, v in rec.kv.items()}
                t0 = time.perf_counter()
                ev = evaluate(cls, rec.samples[(ks, path, cls)], rec.params, kv)
                t1 = time.perf_counter()
                st = fp64.error_stats(ev)
                cert = certify(ev, fp64.pick_elements(ev, int(p["fp64_cert"]), 0, st["eta"]), rec.params, kv)
                t2 = time.perf_counter()
                fp64.make_row(ev, decode_evs.get(cls), cert, {"path": path}, st)
                t3 = time.perf_counter()
                t["refs"] += t1 - t0
                t["cert"] += t2 - t1
                t["metrics"] += t3 - t2
                if path == "decode":
                    decode_evs[cls] = ev
            total = (t_tap - t_run) + sum(t.values())
            rows.append([ks, path, t_run, t_tap, t["refs"], t["cert"], t["metrics"], total, total / t_run])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="ci")
    ap.add_argument("--tokens", type=int, default=None, help="prompt tokens (default: fp64.capture_plan's)")
    ap.add_argument("--rows", type=int, default=64, help="positions sampled per class (fp64_rows)")
    ap.add_argument("--cert", type=int, default=12, help="elements certified per row (fp64_cert)")
    ap.add_argument("--reps", type=int, default=2, help="untapped repetitions (best is kept)")
    ap.add_argument("--kernel-sets", nargs="*", default=None)
    a = ap.parse_args(argv)
    p = {**fp64.DEFAULTS, **get_profile(a.profile).parameters(), "fp64_tokens": a.tokens, "fp64_rows": a.rows,
         "fp64_cert": a.cert}
    if a.kernel_sets:
        p["kernel_sets"] = a.kernel_sets
    plan = fp64.capture_plan(p)
    print(f"profile {a.profile}: preset {p['preset']} on {p['device']}, {p['dtype']}, prompt {plan['prompt']} "
          f"{plan['tokens']} tokens, step {plan['step']}, deep_threshold {p['deep_threshold']}, "
          f"{len(plan['positions'])} positions, {a.cert} certified per row")
    rows = bench(p, a.reps)
    heads = ["set", "path", "run s", "tapped run s", "refs s", "cert s", "metrics s", "FP64 pass s", "pass / run"]
    print(tabulate(rows, headers=heads, floatfmt=".3f", tablefmt="github"))
    tot_run, tot_pass = sum(r[2] for r in rows), sum(r[7] for r in rows)
    print(f"total: paths {tot_run:.2f} s, FP64 pass {tot_pass:.2f} s, ratio {tot_pass / tot_run:.2f} "
          f"(certification {sum(r[5] for r in rows):.2f} s of it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
