"""Per-row time of the serial oracle's steps (graph replay vs eager) for both sets, and the fast set's attention
calls at new key lengths (after the SDPA backend choice)."""
import sys, time, torch
sys.path.insert(0, "lib")
from torch.profiler import profile, ProfilerActivity
from exactness.analysis.hashes import load_model
from exactness.cache import KVCache
from exactness.graphs import GraphDecoder
from exactness.kernels import attention as A
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
              f"graph {rows(gstep, start + 40, 200):.2f} ms/row, eager {rows(estep, start + 240, 100):.2f} ms/row, "
              f"graph again {rows(gstep, start + 340, 200):.2f} ms/row  {dec.info()}", flush=True)
        if ks == "fast" and start == 0:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                rows(gstep, 600, 20)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                rows(estep, 620, 20)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
H, D, Hkv = 32, 128, 4
kc = torch.randn(1, 17000, Hkv, D, device=dev, dtype=torch.bfloat16); vc = torch.randn_like(kc)
for M, T0 in ((1, 4000), (1000, 4000), (1000, 16000)):
    q = torch.randn(M, H, D, device=dev, dtype=torch.bfloat16)
    for fn in (A.attention_fast_decode, A.attention_fast_prompt):
        ts = []
        for j in range(6):
            pos = torch.arange(T0 + j * 7 - M + 1, T0 + j * 7 + 1, device=dev)
            torch.cuda.synchronize(); t0 = time.perf_counter()
            fn(q, kc, vc, torch.zeros(M, dtype=torch.int64, device=dev), pos)
            torch.cuda.synchronize(); ts.append((time.perf_counter() - t0) * 1e3)
        if fn is A.attention_fast_decode and M > 1:
            continue
        print(f"{fn.__name__} M={M} keys~{T0}: ms per call at 6 new lengths {[round(t, 2) for t in ts]}", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        A.attention_fast_prompt(q, kc, vc, torch.zeros(M, dtype=torch.int64, device=dev), pos); torch.cuda.synchronize()
    print([e.key for e in prof.key_averages()][:6])
