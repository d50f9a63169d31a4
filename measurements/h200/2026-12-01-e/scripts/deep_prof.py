"""Where the deep path's time goes (small preset, code prompt, experts resident): GPU time by kernel
(torch.profiler) of one prefill per (set, plan), and cProfile of the invariant deep one-segment prefill's host time."""
import cProfile, io, os, pstats, sys, time
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import bench_gpu_kernels as b
from exactness import paths
from exactness.cache import KVCache
from exactness.prompts import build_prompt

w = b._weights("device")
ids = build_prompt("code").ids.to(w.device)
P = ids.numel()
def run(ks, path, step):
    cache = KVCache(w.cfg, P + 1, 1, w.dtype, w.device)
    paths.prefill(w, cache, ids, ks, paths.Schedule(path, step, 512))
for ks, path, step in (("invariant", "batched", None), ("invariant", "deep", None), ("invariant", "deep", 2048),
                       ("fast", "batched", None), ("fast", "deep", None)):
    b._step_kernels(f"{ks} {path}@{step or 'one segment'} ({P} rows)", lambda: run(ks, path, step), top=14)
run("invariant", "deep", None); torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable(); t0 = time.perf_counter()
run("invariant", "deep", None); torch.cuda.synchronize()
wall = time.perf_counter() - t0; pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
print(f"invariant deep one segment under cProfile: {wall:.3f} s wall"); print(s.getvalue()[-7000:])
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
print(s.getvalue()[-7000:])
