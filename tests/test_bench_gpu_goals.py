"""benchmarks/bench_gpu_goals.py renders its goals table from saved results on any machine (no GPU needed)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_goals_table_from_saved_results(tmp_path):
    """bench_gpu_goals.py --from-json prints a goal row per measure, met where the figure meets its goal and MISSED
    where it does not; saved results made up for the test put one figure of each goal kind on either side. A run's
    goals.json renders the same table; results that lack a section are refused with a one-line error."""
    runs = (("batched", None, 0.05), ("deep", None, 0.04), ("batched", 2048, 0.07), ("deep", 2048, 0.08))
    e2e = [{"set": "invariant", "path": p, "step": s, "prefill_s": t} for p, s, t in runs]
    kernels = {"ceilings": {"matmul_tflops": 750.0, "copy_gbs": 4000.0},
               "decode_step": {"graphs": [{"set": "invariant", "graphs_ms": 0.8}, {"set": "fast", "graphs_ms": 2.0}]},
               "e2e": {"rows": e2e, "ratios": [{"path": "batched", "step": None, "ratio": 0.2, "met": True}]},
               "gemm": {"rows": [{"shape": "gate|up", "M": 64, "N": 768, "K": 2048, "ratio": 1.2, "goal": 1.25,
                                  "met": True, "cublas_gpu_us": 5.0, "invariant_gpu_us": 6.0},
                                 {"shape": "q", "M": 4096, "N": 4096, "K": 2048, "ratio": 1.3, "goal": 1.05,
                                  "met": False, "cublas_gpu_us": 100.0, "invariant_gpu_us": 130.0}]}}
    offload = {"flops": 15e12, "peak_flops": 750e12,
               "rows": [{"kernels": "invariant", "path": "deep", "speedup_over_batched": 18.0, "ratio": 1.1,
                         "ratio_min_bytes": 1.2}]}
    (tmp_path / "k.json").write_text(json.dumps(kernels))
    (tmp_path / "o.json").write_text(json.dumps(offload))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu_goals.py"), "--from-json",
                           str(tmp_path / "k.json"), str(tmp_path / "o.json")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = {ln.split("|")[1].strip(): ln.split("|")[-2].strip() for ln in proc.stdout.splitlines()
             if ln.startswith("| ") and "measure" not in ln}
    assert lines["decode step at 4,096 context, CUDA graphs, invariant"] == "met"
    assert lines["decode step at 4,096 context, CUDA graphs, fast"] == "MISSED"
    assert lines["batched one-chunk prefill (invariant) / FLOP bound"] == "MISSED"      # 0.05 s / 0.02 s = 2.5
    assert lines["deep vs batched, experts resident, invariant, step whole prompt"] == "met"
    assert lines["deep vs batched, experts resident, invariant, step 2048"] == "MISSED"
    assert lines["offloaded deep / offloaded batched@2048, invariant"] == "met"
    assert lines["GEMM invariant / cuBLAS, GPU time, M = 64–512"] == "met"
    assert lines["GEMM invariant / cuBLAS, GPU time, M = 4096–16384"] == "MISSED"
    assert "gate/up" in proc.stdout and "gate|up" not in proc.stdout
    (tmp_path / "goals.json").write_text(json.dumps({"kernels": kernels, "offload": offload}))
    again = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu_goals.py"), "--from-json",
                            str(tmp_path / "goals.json")], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == proc.stdout, again.stderr
    del kernels["decode_step"]
    (tmp_path / "k.json").write_text(json.dumps(kernels))
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu_goals.py"), "--from-json",
                          str(tmp_path / "k.json"), str(tmp_path / "o.json")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "the results lack 'decode_step'" in bad.stderr
