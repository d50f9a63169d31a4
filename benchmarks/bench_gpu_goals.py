"""Every GPU speed goal in one run: one table of measure, goal, figure, met or missed (benchmark, not a test).

Run from the repository root on a CUDA machine (small preset, bf16, the ~16k-token code prompt):

    bash scripts/setup_python.sh python3 .whl .deps exactness      # mpmath (the pinned prompts) into .deps/
    PYTHONPATH=lib:.deps python3 benchmarks/bench_gpu_goals.py [--out DIR]
    python3 benchmarks/bench_gpu_goals.py --from-json DIR/goals.json   # the table again from a run's goals.json
    python3 benchmarks/bench_gpu_goals.py --from-json K.json O.json    # or from bench_gpu_kernels.json (ceilings
                                                                       # optional) and bench_offload's JSON

It runs, in one process and one after the other, bench_gpu_kernels' ceilings, decode_step, gemm and e2e sections
and bench_offload (experts in pinned host memory, batched@2048 vs deep on the whole prompt), then the GPU time by
kernel of the invariant set's batched and deep prefills (torch.profiler), and prints the goals table. The GEMM rows
at M = 64..512 add a roofline: max(FLOPs / measured matmul peak, bytes of x, w and y / measured device-memory
bandwidth (bench_gpu_kernels.ceilings' copy rate)), against which cuBLAS and the invariant kernel are both timed.
The receipt's own time (goal: one ``make receipts PROFILE=gpu`` within 10 minutes) is not measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from types import SimpleNamespace

from tabulate import tabulate

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "lib"))


def _row(measure: str, goal: str, figure: str, met) -> dict:
    return {"measure": measure, "goal": goal, "figure": figure,
            "met": "—" if met is None else ("met" if met else "MISSED")}


def _label(shape: str) -> str:
    """A GEMM shape's name without the pipe that would split a markdown table cell (gate|up: one projection)."""
    return shape.replace("|", "/")


def _e2e(k: dict, path: str, step) -> float:
    return [r["prefill_s"] for r in k["e2e"]["rows"] if r["set"] == "invariant" and r["path"] == path
            and r["step"] == step][0]


def goal_rows(k: dict, off: dict) -> list[dict]:
    """The goals table from bench_gpu_kernels' results ``k`` (ceilings, decode_step, gemm, e2e) and
    bench_offload's JSON ``off``: one row per goal, its figure and whether it is met. The FLOP bound takes
    bench_offload's FLOP count of the prompt and the matmul peak of ``k``'s ceilings (else bench_offload's).

    Raises:
        ValueError: the two results are of different prompts (their prompt_tokens differ).
    """
    P = {r.get("prompt_tokens") for r in k["e2e"]["rows"]} | {off.get("prompt_tokens")}
    if len(P - {None}) > 1:
        raise ValueError(f"the results are of different prompts: prompt_tokens {sorted(P - {None})}")
    peak = k["ceilings"]["matmul_tflops"] * 1e12 if "ceilings" in k else off["peak_flops"]
    rows = []
    g = {r["set"]: r for r in k["decode_step"]["graphs"]}
    for ks in ("invariant", "fast"):
        rows.append(_row(f"decode step at 4,096 context, CUDA graphs, {ks}", "≤ 1.0 ms",
                         f"{g[ks]['graphs_ms']:.3f} ms", g[ks]["graphs_ms"] <= 1.0))
    ratio = g["invariant"]["graphs_ms"] / g["fast"]["graphs_ms"]
    rows.append(_row("decode step invariant / fast, graphs", "≤ 1.05", f"{ratio:.3f}", ratio <= 1.05))
    one = _e2e(k, "batched", None)
    bound = off["flops"] / peak
    rows.append(_row("batched one-chunk prefill (invariant) / FLOP bound", "≤ 2",
                     f"{one:.4f} s / {bound:.4f} s = {one / bound:.2f}", one / bound <= 2))
    for r in k["e2e"]["ratios"]:
        rows.append(_row(f"prefill invariant / fast, {r['path']}@{r['step'] or 'one segment'}", "≤ 1.10",
                         f"{r['ratio']:.3f}", r["met"]))
    for step in (None, 2048):
        d, b = _e2e(k, "deep", step), _e2e(k, "batched", step)
        rows.append(_row(f"deep vs batched, experts resident, invariant, step {step or 'whole prompt'}",
                         "deep ≤ batched", f"{d:.4f} vs {b:.4f} s ({d / b - 1:+.1%})", d <= b))
    for ks in sorted({r["kernels"] for r in off["rows"]}):
        deep = [r for r in off["rows"] if r["kernels"] == ks and r["path"] == "deep"][0]
        rows.append(_row(f"offloaded deep / offloaded batched@2048, {ks}", "≥ 5",
                         f"{deep['speedup_over_batched']:.2f}", deep["speedup_over_batched"] >= 5))
        rows.append(_row(f"offloaded deep / copy bound, {ks}", "≤ 1.25",
                         f"{deep['ratio']:.2f} (bytes moved); {deep['ratio_min_bytes']:.2f} (routed experts' bytes)",
                         max(deep["ratio"], deep["ratio_min_bytes"]) <= 1.25))
    for lo, hi, gl in ((64, 512, 1.25), (4096, 16384, 1.05)):
        sel = [r for r in k["gemm"]["rows"] if r["goal"] is not None and lo <= r["M"] <= hi]
        fig = "; ".join(f"{_label(s)} {min(r['ratio'] for r in sel if r['shape'] == s):.2f}–"
                        f"{max(r['ratio'] for r in sel if r['shape'] == s):.2f}"
                        for s in dict.fromkeys(r["shape"] for r in sel))
        n = sum(r["met"] for r in sel)
        rows.append(_row(f"GEMM invariant / cuBLAS, GPU time, M = {lo}–{hi}", f"≤ {gl}",
                         f"{fig} ({n} of {len(sel)} met)", n == len(sel)))
    return rows


def roofline_rows(k: dict) -> list[dict]:
    """GEMM rows at M = 64..512: cuBLAS and invariant GPU time against max(FLOPs / peak, bytes / bandwidth)."""
    peak, bw = k["ceilings"]["matmul_tflops"] * 1e12, k["ceilings"]["copy_gbs"] * 1e9
    out = []
    for r in k["gemm"]["rows"]:
        if r["goal"] is None or not 64 <= r["M"] <= 512:
            continue
        M, N, K = r["M"], r["N"], r["K"]
        roof = max(2 * M * N * K / peak, 2 * (M * K + N * K + M * N) / bw) * 1e6      # bf16: 2 bytes a value
        out.append({"shape": _label(r["shape"]), "M": M, "roofline_us": roof, "cublas_gpu_us": r["cublas_gpu_us"],
                    "invariant_gpu_us": r["invariant_gpu_us"], "cublas/roof": r["cublas_gpu_us"] / roof,
                    "invariant/roof": r["invariant_gpu_us"] / roof})
    return out


def measure(out_dir: str) -> tuple[dict, dict, dict]:
    """Run the sections and the offload bench on this machine's GPU; returns (kernels, offload, profiles).

    Raises:
        SystemExit: torch sees no CUDA device.
    """
    import bench_gpu_kernels as bg
    import bench_offload as bo
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_goals needs a CUDA device (or --from-json)")
    args = SimpleNamespace(e2e_weights="device", e2e_tokens=0, e2e_reps=3, e2e_oracle=False, tune=False)
    k = {s: getattr(bg, s)(args) for s in ("ceilings", "decode_step", "gemm", "e2e")}
    off_json = os.path.join(out_dir or tempfile.mkdtemp(), "offload.json")
    bo.main(["--weights", "device", "--json", off_json])
    with open(off_json) as f:
        off = json.load(f)
    prof = _prefill_profiles(bg)
    return k, off, prof


def _prefill_profiles(bg) -> dict:
    """GPU time by kernel of one invariant prefill of the code prompt, batched one chunk and deep one segment."""
    from exactness import paths
    from exactness.cache import KVCache
    from exactness.prompts import build_prompt
    w = bg._weights("device")
    ids = build_prompt("code").ids.to(w.device)

    def run(path):
        cache = KVCache(w.cfg, ids.numel() + 1, 1, w.dtype, w.device)
        paths.prefill(w, cache, ids, "invariant", paths.Schedule(path, None, 512))
    return {p: bg._step_kernels(f"invariant {p} prefill, one segment", lambda: run(p), top=6)
            for p in ("batched", "deep")}


def main(argv=None) -> int:
    """Measure (or read with --from-json), print the goals table and the GEMM roofline; write goals.json to --out."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""),
                    help="folder for goals.json and offload.json (default: $OUT; none: not saved)")
    ap.add_argument("--from-json", nargs="+", metavar="JSON",
                    help="a run's goals.json, or bench_gpu_kernels.json (decode_step, gemm, e2e; ceilings "
                         "optional) and bench_offload's JSON")
    a = ap.parse_args(argv)
    if a.from_json:
        if len(a.from_json) > 2:
            ap.error(f"--from-json takes 1 or 2 files, got {len(a.from_json)}")
        docs = []
        for path in a.from_json:
            with open(path) as f:
                docs.append(json.load(f))
        k, off = (docs[0]["kernels"], docs[0]["offload"]) if len(docs) == 1 else docs
        prof = None
    else:
        if a.out:
            os.makedirs(a.out, exist_ok=True)
        k, off, prof = measure(a.out)
    try:
        rows = goal_rows(k, off)
    except KeyError as e:
        ap.error(f"the results lack {e}: the kernels JSON needs decode_step, gemm and e2e; the offload JSON is "
                 "bench_offload.py --json's")
    print("## every GPU speed goal, this run")
    print(tabulate(rows, headers="keys", tablefmt="github"))
    roof = roofline_rows(k) if "ceilings" in k else []
    if roof:
        print("## GEMM at M = 64–512 against its roofline (GPU time, µs)")
        print(tabulate(roof, headers="keys", floatfmt=".2f", tablefmt="github"))
    if a.out:
        with open(os.path.join(a.out, "goals.json"), "w") as f:
            json.dump({"goals": rows, "roofline": roof, "kernels": k, "offload": off, "profiles": prof}, f,
                      indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
