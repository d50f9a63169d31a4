"""Benchmark (not a test): offloaded deep prefill against the offloaded batched pass, and both against a bound.

    python benchmarks/bench_offload.py            # small preset, CUDA, the ~16k-token code prompt, batched@2048 vs deep
    python benchmarks/bench_offload.py --deep-step 2048    # deep on the same segments as the batched pass
    python benchmarks/bench_offload.py --preset tiny --device cpu --tokens 96 --deep-threshold 32   # CPU smoke

With the experts in pinned host memory (offload.ExpertStore), it times the prefill of one prompt on the deep path
(experts staged on a copy stream: whole layers through the layer ring for a set with a grouped expert kernel, one
expert at a time through the expert ring otherwise) and on the batched path (each expert fetched synchronously),
and prints, per kernel set: achieved seconds, the bound max(FLOPs / measured matmul peak, expert bytes moved /
measured host-to-device bandwidth), achieved / bound, and deep speed-up over batched. Peak and bandwidth are
measured in this same process. On CPU the ratios mean nothing (no copy engine, "host" = "device"); the CPU run only
shows that the script works.

Segments: the batched pass runs at ``--step`` (2048, the gpu profile's first step) and fetches every expert with
members once per segment; the deep path by default prefills the whole prompt as one segment, so each (layer,
expert) crosses the bus once. ``--deep-step 2048`` compares on equal segments: both then move the same bytes and
the deep path gains only the overlap of copies with compute. Each line also prints the bound at the minimum bytes
(every (layer, expert) the prompt routes to, moved once).

FLOPs counted (2 per multiply-add), per prompt of P rows: q/k/v/o projections, router, k routed experts and the
shared expert per row, causal attention scores and values (sum over rows of 4·Hq·D·(p+1)), and lm_head on every
prompt row; norms, RoPE, softmax and the combine are left out (they are memory-bound and small).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lib"))

from exactness.cache import KVCache  # noqa: E402
from exactness.config import get_preset  # noqa: E402
from exactness.kernels import fast_cuda  # noqa: E402
from exactness.offload import ExpertStore  # noqa: E402
from exactness.paths import Schedule, prefill  # noqa: E402
from exactness.prompts import build_prompt  # noqa: E402
from exactness.weights import synthetic_weights  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def prefill_flops(cfg, P: int) -> float:
    """Matmul FLOPs of prefilling P rows from position 0 (see the module docstring for what is counted)."""
    H, D, Hq, Hkv = cfg.hidden, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    per_row = (2 * H * (Hq * D + 2 * Hkv * D) + 2 * Hq * D * H + 2 * H * cfg.n_experts
               + 2 * cfg.top_k * 3 * cfg.expert_inter * H + 2 * 3 * cfg.shared_expert_inter * H)
    attention = 4 * Hq * D * P * (P + 1) / 2
    return cfg.n_layers * (per_row * P + attention) + 2 * P * cfg.vocab_size * H


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """Measured FLOP/s of one n x n x n matmul in ``dtype`` (2·n³ FLOPs per call)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n ** 3 / _timed(lambda: a @ b, device, 10)


def h2d_bandwidth(device: torch.device, nbytes: int) -> float:
    """Measured bytes/s of one host->device copy of ``nbytes`` from pinned memory (plain memory on CPU)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _timed(lambda: dst.copy_(src, non_blocking=True), device, 5)


def time_prefill(store: ExpertStore, ids: torch.Tensor, kernels: str, path: str, step, threshold: int,
                 reps: int) -> dict:
    """Median prefill seconds of ``ids`` on ``path`` with the store's experts, and the store's counters of the
    last repetition (bytes moved, fetches by route, unique experts touched)."""
    w = store.weights

    def run():
        store.reset_stats()
        cache = KVCache(w.cfg, ids.numel(), 1, w.dtype, w.device)
        served = {p: {"segments": 0, "rows": 0} for p in ("decode", "batched", "deep")}
        prefill(w, cache, ids, kernels, Schedule(path, step, threshold), served=served, experts=store)
        return served

    seconds = _timed(run, w.device, reps)
    served = run()
    return {"seconds": seconds, "served": served, **store.info()["stats"]}


def _row(kernels, path, step, r, flops, peak, bw, min_bytes) -> dict:
    bound = max(flops / peak, r["bytes_moved"] / bw)
    bound_min = max(flops / peak, min_bytes / bw)
    return {"kernels": kernels, "path": path, "step": step, "seconds": r["seconds"],
            "bytes_moved": r["bytes_moved"], "ring_fetches": r["ring_fetches"], "sync_fetches": r["sync_fetches"],
            "layer_fetches": r["layer_fetches"],
            "bound_s": bound, "ratio": r["seconds"] / bound, "bound_min_bytes_s": bound_min,
            "ratio_min_bytes": r["seconds"] / bound_min, "served": r["served"]}


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--prompt", default="code")
    ap.add_argument("--tokens", type=int, default=None, help="cut the prompt to this many tokens")
    ap.add_argument("--kernels", default="fast,invariant", help="comma-separated kernel sets")
    ap.add_argument("--step", type=int, default=2048, help="batched pass step (tokens; 0 = whole prompt)")
    ap.add_argument("--deep-step", type=int, default=0, help="deep path step (tokens; 0 = whole prompt, default)")
    ap.add_argument("--deep-threshold", type=int, default=512)
    ap.add_argument("--ring-slots", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--weights", default="synthetic", choices=("synthetic", "device"),
                    help="synthetic: the seeded CPU draw (slow: ~2.4 G values for the small preset); device: "
                         "drawn on the GPU with the same distributions (weights.device_random_weights; fast). "
                         "Timings do not depend on the values")
    a = ap.parse_args(argv)
    if a.weights == "device" and not a.device.startswith("cuda"):
        ap.error("--weights device needs --device cuda")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: torch sees no CUDA device (use --device cpu)")
    return a


def _header(a, device, P, peak, bw, flops, info) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}), preset {a.preset}, {a.dtype}, prompt {a.prompt} ({P} tokens), batched step "
          f"{a.step or 'whole prompt'}, deep step {a.deep_step or 'whole prompt'}")
    print(f"measured: matmul peak {peak / 1e12:.4g} TFLOP/s, host->device {bw / 1e9:.4g} GB/s; "
          f"prefill {flops / 1e12:.4g} TFLOP")
    why_no_layer = f"; {info['layer_ring_reason']}" if info["layer_ring_reason"] else ""
    print(f"offload: {info['device_bytes_saved'] / 2**20:.1f} MiB of experts off the device; the rings reserve "
          f"{info['ring_bytes']} bytes (expert ring {info['ring_slots']} slots x {info['expert_bytes']}, layer ring "
          f"{info['layer_slots']} slots: {info['layer_ring_bytes']}{why_no_layer}); "
          f"deep_ready={info['deep_ready']} {info['fallback_reason'] or ''}")


def _print_row(ks: str, r: dict, P: int) -> None:
    label = f"{r['path']}@{r['step'] or 'all'}"
    print(f"{ks:9s} {label:12s} achieved {r['seconds']:.3f} s ({P / r['seconds']:.0f} tok/s), bound "
          f"{r['bound_s']:.3f} s (moved {r['bytes_moved'] / 2**20:.4g} MiB), ratio {r['ratio']:.2f}; "
          f"bound at min bytes {r['bound_min_bytes_s']:.3f} s, ratio {r['ratio_min_bytes']:.2f}; "
          f"fetches ring {r['ring_fetches']} layer {r['layer_fetches']} sync {r['sync_fetches']}")


def main(argv=None) -> int:
    """Run the benchmark (arguments: see --help); prints one line per (kernel set, path) and the ratios."""
    a = _args(argv)
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    cfg = get_preset(a.preset)
    if a.weights == "device":
        from exactness.weights import device_random_weights
        w_host = device_random_weights(cfg, dtype, device).to(device="cpu")
        torch.cuda.empty_cache()
    else:
        w_host = synthetic_weights(cfg, dtype=dtype)
    store = ExpertStore(w_host, "offload", a.ring_slots, device)
    ids = build_prompt(a.prompt, a.tokens).ids
    P, big = ids.numel(), device.type == "cuda"
    peak = matmul_peak(device, dtype, 8192 if big else 256)
    bw = h2d_bandwidth(device, (1 << 30) if big else (16 << 20))
    flops = prefill_flops(cfg, P)
    _header(a, device, P, peak, bw, flops, store.info())
    rows, steps = [], {"batched": a.step or None, "deep": a.deep_step or None}
    for ks in a.kernels.split(","):
        res = {p: time_prefill(store, ids, ks, p, steps[p], a.deep_threshold, a.reps) for p in steps}
        min_bytes = res["deep"]["unique_experts"] * store.expert_bytes
        for p in ("batched", "deep"):
            rows.append(_row(ks, p, steps[p], res[p], flops, peak, bw, min_bytes))
            _print_row(ks, rows[-1], P)
        rows[-1]["speedup_over_batched"] = rows[-2]["seconds"] / rows[-1]["seconds"]
        print(f"{ks:9s} deep speed-up over batched {rows[-1]['speedup_over_batched']:.2f}x (goal >= 5); "
              f"deep / bound {rows[-1]['ratio']:.2f} (goal <= 1.25)")
    if a.json:
        Path(a.json).write_text(json.dumps({"peak_flops": peak, "h2d_bytes_per_s": bw, "flops": flops,
                                            "prompt_tokens": P, "store": store.info(), "rows": rows,
                                            "fast_served": fast_cuda.served()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
