"""Host-to-device copy of a large fp32 CPU tensor: which way is fast on this machine."""
import time, torch
def T(name, fn, n=1):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): r = fn()
    torch.cuda.synchronize(); dt = (time.perf_counter() - t0) / n
    print(f"{name:48s} {dt*1e3:9.1f} ms"); return r
print("threads", torch.get_num_threads())
g = torch.Generator().manual_seed(0)
N = 300_000_000   # 1.2 GB fp32
t = T("randn 300M fp32 (generator)", lambda: torch.randn(N, generator=g))
gb = N * 4 / 1e9
torch.empty(1, device="cuda")
T("t.to(cuda) fp32 pageable", lambda: t.to("cuda"))
T("t.to(cuda) fp32 pageable again", lambda: t.to("cuda"))
T("t.to(cuda, bf16) (cast on CPU)", lambda: t.to("cuda", torch.bfloat16))
b = T("t.to(bf16) on CPU", lambda: t.to(torch.bfloat16))
T("bf16 .to(cuda) pageable", lambda: b.to("cuda"))
p = T("t.pin_memory()", lambda: t.pin_memory())
T("pinned .to(cuda, non_blocking)", lambda: p.to("cuda", non_blocking=True))
def staged(src, chunk=32 << 20):
    flat = src.view(-1); dst = torch.empty_like(flat, device="cuda")
    bufs = [torch.empty(chunk, dtype=src.dtype).pin_memory() for _ in range(2)]
    evs = [None, None]; s = torch.cuda.current_stream()
    for i, a in enumerate(range(0, flat.numel(), chunk)):
        j = i % 2; n = min(chunk, flat.numel() - a)
        if evs[j] is not None: evs[j].synchronize()
        bufs[j][:n].copy_(flat[a:a + n])
        dst[a:a + n].copy_(bufs[j][:n], non_blocking=True)
        evs[j] = torch.cuda.Event(); evs[j].record(s)
    return dst.view_as(src)
d = T("staged 2x32M-value pinned buffers", lambda: staged(t))
print("staged equal:", torch.equal(d.cpu(), t))
T("staged again", lambda: staged(t))
T("staged bf16 on CPU then staged", lambda: staged(t.to(torch.bfloat16)))
T("CPU memcpy clone", lambda: t.clone())
