"""The serial decode oracle (decode path) per prompt row, with and without CUDA graphs, both kernel sets (one H200;
run from the repository root). benchmarks/bench_gpu_kernels.py --sections oracle measures the same."""
import sys, time, torch
sys.path.insert(0, "lib")
from exactness.analysis.hashes import load_model
from exactness.paths import generate, Schedule
w, _ = load_model("small", "cuda", "bfloat16")
g = torch.Generator().manual_seed(0)
for P in (600, 3000):
    ids = torch.randint(0, 256, (P,), generator=g)
    for ks in ("invariant", "fast"):
        for graphs in (True, False):
            if not graphs and P > 600:
                continue
            torch.cuda.synchronize(); t0 = time.perf_counter()
            r = generate(w, ids, 4, ks, Schedule("decode"), graphs=graphs)
            torch.cuda.synchronize(); dt = time.perf_counter() - t0
            print(f"P={P} {ks} graphs={graphs}: {dt:.2f} s, {dt / P * 1e3:.2f} ms/row, {r.graphs}", flush=True)
