"""Why a pieced graph replay is slow on the serial oracle's prompt rows: per-row time and a torch.profiler table
of GraphDecoder.step on prompt rows (fast set) vs eager decode steps, and after a 4,096-row prefill."""
import sys, time, torch
sys.path.insert(0, "lib")
from torch.profiler import profile, ProfilerActivity
from exactness.analysis.hashes import load_model
from exactness.cache import KVCache
from exactness.graphs import GraphDecoder
from exactness.paths import decode_step, prefill, Schedule
w, _ = load_model("small", "cuda", "bfloat16")
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, 256, (5000,), generator=g).cuda()
dev = w.device


def rows(step, start, n):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for i in range(n):
        step(ids[start + i:start + i + 1], start + i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


for ks in ("fast", "invariant"):
    for start in (0, 4096):
        cache = KVCache(w.cfg, 5000, 1, w.dtype, dev)
        if start:
            prefill(w, cache, ids[:start], ks, Schedule("batched"))
        dec = GraphDecoder(w, cache, ks)
        gstep = lambda t, p: dec.step(t, [p], [0])
        slots = torch.zeros(1, dtype=torch.int64, device=dev)
        estep = lambda t, p: decode_step(w, cache, t, torch.tensor([p], device=dev), slots, ks)
        print(f"{ks} start={start}: graph {rows(gstep, start, 40):.2f} ms/row (capture incl.), "
              f"graph {rows(gstep, start + 40, 100):.2f} ms/row, eager {rows(estep, start + 140, 100):.2f} ms/row, "
              f"graph again {rows(gstep, start + 240, 100):.2f} ms/row  {dec.info()}", flush=True)
        if ks == "fast":
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                rows(gstep, start + 340, 20)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                rows(estep, start + 360, 20)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
