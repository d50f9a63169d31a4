"""Every GPU speed goal in one run: one table of measure, goal, invariant and fast figures side by side, their
ratio, the roofline bound of each row and met or missed (benchmark, not a test).

Run from the repository root on a CUDA machine (small preset, bf16, the ~16k-token code prompt):

    bash scripts/setup_python.sh python3 .whl .deps exactness      # mpmath (the pinned prompts) into .deps/
    PYTHONPATH=lib:.deps python3 benchmarks/bench_gpu_goals.py [--out DIR]
    python3 benchmarks/bench_gpu_goals.py --from-json DIR/goals.json   # the table again from a run's goals.json
    python3 benchmarks/bench_gpu_goals.py --from-json K.json O.json    # or from bench_gpu_kernels.json and
                                                                       # bench_offload's JSON

It runs, in one process and one after the other, bench_gpu_kernels' ceilings, decode_step, gemm, e2e and drafted
sections, a decode step of STREAMS concurrent streams, bench_launch_chain's cost of one more chained kernel, and
bench_offload (experts in pinned host memory, batched@2048 vs deep), then the GPU time by kernel of the invariant
set's batched and deep prefills (torch.profiler). The fast set
is the best stock PyTorch offers (cuBLAS, FlashAttention-2, torch._grouped_mm experts, CUDA graphs: kernels/sets.py).

Bounds: a prefill's FLOP bound is its FLOPs / the measured matmul peak; a decode step's memory bound is the bytes it
must read (decode_bytes: attention and router weights, the routed experts' weights, the KV cache, the LM head) / the
measured device copy rate; an offloaded prefill's bound is bench_offload's (FLOPs or host->device bytes). The GEMM
rows at M = 64..512 get their own roofline table. The receipt's own time (goal: ``make receipts PROFILE=gpu`` within
5 minutes) is read from a receipt run folder given with ``--receipt DIR`` (its notebooks' times), not measured here.
"deep ≤ batched" is a tie, not missed, where deep is slower by less than the wider range of the two runs' repeats
(at one segment the invariant set's deep prefill makes the batched prefill's kernel calls). A goal that weighs the
fast set's figures is "not judged", with the reason, where one of the fast set's CUDA kernels (grouped GEMMs,
FlashAttention, its compiled graphs) had failed by the end of the section that measured them, so its fallback served
(fast_cuda.served, recorded after each section): not the baseline the goal names.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

from tabulate import tabulate

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "lib"))

CONTEXT, STREAMS = 4096, 8          # decode steps: positions in the cache, concurrent streams
PATH_GOAL, DECODE_MS, FLOP_GOAL, GEMM_GOAL = 1.10, 0.25, 1.5, 1.25


def _fmt(x, unit: str = "") -> str:
    return "—" if x is None else (f"{x:.4g}{unit}" if isinstance(x, float) else str(x))


def _row(measure, goal, inv=None, fast=None, bound=None, met=None, unit="", ratio=None) -> dict:
    """One goal: figures side by side, their ratio, the bound (label, value) and each figure over it."""
    b = bound[1] if bound else None
    if ratio is None and inv is not None and fast:
        ratio = inv / fast
    return {"measure": measure, "goal": goal, "invariant": _fmt(inv, unit), "fast": _fmt(fast, unit),
            "inv/fast": _fmt(ratio), "bound": f"{bound[0]} {_fmt(b, unit)}" if bound else "—",
            "inv/bound": _fmt(inv / b if inv is not None and b else None),
            "fast/bound": _fmt(fast / b if fast is not None and b else None),
            "met": "—" if met is None else met if isinstance(met, str) else ("met" if met else "MISSED")}


def _label(shape: str) -> str:
    """A GEMM shape's name without the pipe that would split a markdown table cell (gate|up: one projection)."""
    return shape.replace("|", "/")


def decode_bytes(cfg, context: int, streams: int = 1, elem: int = 2) -> float:
    """Bytes one decode step must read: per layer the attention and router weights, the distinct routed experts'
    weights (expected under uniform routing: E (1 - (1 - k/E)^B) for B streams) and the shared expert's, the
    KV cache (keys and values at ``context`` positions per stream); the LM head once."""
    H, D, E, k, I = cfg.hidden, cfg.head_dim, cfg.n_experts, cfg.top_k, cfg.expert_inter
    attn = 2 * H * cfg.n_heads * D + 2 * H * cfg.n_kv_heads * D
    experts = E * (1 - (1 - k / E) ** streams) * 3 * I * H + 3 * cfg.shared_expert_inter * H
    kv = 2 * context * cfg.n_kv_heads * D * streams
    return elem * (cfg.n_layers * (attn + E * H + experts + kv) + cfg.vocab_size * H)


def _e2e(k: dict, ks: str, path: str, step, field: str = "prefill_s"):
    t = [r.get(field) for r in k["e2e"]["rows"] if r["set"] == ks and r["path"] == path and r["step"] == step]
    return t[0] if t else None


def _no_slower(k: dict, d: float, b: float, step) -> bool | str:
    """Whether the invariant deep prefill at ``step`` (d seconds) is no slower than batched (b): True where d <= b;
    where d > b by no more than the wider of the two runs' ranges over their repeats (bench_gpu_kernels e2e's
    prefill_range_s), a tie, said as such; False beyond it, or where a run has no range."""
    if d <= b:
        return True
    ranges = [_e2e(k, "invariant", path, step, "prefill_range_s") for path in ("deep", "batched")]
    if None in ranges:
        return False
    spread = max(hi - lo for lo, hi in ranges)
    if d - b > spread:
        return False
    return f"tie: deep {(d - b) * 1e3:.3f} ms slower, within the repeats' range {spread * 1e3:.3f} ms"


def _failed(k: dict, section: str, own: dict | None = None) -> str | None:
    """Which of the fast set's CUDA kernels had failed by the end of ``section`` and why ("inductor failed (...)"),
    from k["fast_served"][section], else ``own`` (a section's own JSON's record: bench_offload's), else the run's
    k["fast_kernels"]; None where the record names no failure (fast_cuda.failed: "untried" is none)."""
    from exactness.kernels.fast_cuda import failed
    served = k.get("fast_served") or {}
    rec = served[section] if section in served else own if own is not None else k.get("fast_kernels") or {}
    return "; ".join(f"{n} failed ({str(v).replace('|', '/')[:100]})" for n, v in failed(rec).items()) or None


def baseline_note(k: dict, section: str, own: dict | None = None) -> str | None:
    """Why a goal that weighs the fast set's figures of ``section`` is not judged (its fallback served, not the
    baseline the goal names: _failed), or None."""
    failed = _failed(k, section, own)
    return f"not judged: the fast set's {failed}; its fallback served" if failed else None


def _judge(met: bool, note: str | None):
    """A goal that weighs the fast set's figures: ``note`` (baseline_note) where its baseline did not run, else met."""
    return note or met


def _decode_rows(k: dict, cfg, bw) -> list[dict]:
    rows, g = [], {r["set"]: r["graphs_ms"] for r in k["decode_step"]["graphs"]}
    b = ("memory", decode_bytes(cfg, CONTEXT) / bw * 1e3) if bw else None
    inv_met = g["invariant"] <= DECODE_MS                # missed by the invariant set alone whatever the fast set ran
    rows.append(_row(f"decode step, {CONTEXT:,} context, 1 stream, CUDA graphs", f"each ≤ {DECODE_MS} ms",
                     g["invariant"], g["fast"], b,
                     _judge(g["fast"] <= DECODE_MS, baseline_note(k, "decode_step")) if inv_met else False, " ms"))
    s = k.get("streams")
    if s and "error" not in s:
        b = ("memory", decode_bytes(cfg, CONTEXT, s["streams"]) / bw * 1e3) if bw else None
        i, f = s["graphs_ms"]["invariant"], s["graphs_ms"]["fast"]
        rows.append(_row(f"concurrent streams: decode step of {s['streams']}, CUDA graphs", f"inv/fast ≤ {PATH_GOAL}",
                         i, f, b, _judge(i / f <= PATH_GOAL, baseline_note(k, "streams")), " ms"))
    else:
        rows.append(_row("concurrent streams: decode step, CUDA graphs", f"inv/fast ≤ {PATH_GOAL}",
                         ratio=(s or {}).get("error", "not measured")))
    return rows


def _prefill_rows(k: dict, off: dict, peak: float) -> list[dict]:
    rows, bound = [], ("FLOP", off["flops"] / peak) if "flops" in off else None
    for path, step in (("batched", None), ("batched", 2048), ("deep", 2048), ("deep", None)):
        i, f = _e2e(k, "invariant", path, step), _e2e(k, "fast", path, step)
        name = "one chunk" if (path, step) == ("batched", None) else f"{path}@{step or 'one segment'}"
        rows.append(_row(f"prefill, {name}", f"inv/fast ≤ {PATH_GOAL}", i, f, bound,
                         _judge(i / f <= PATH_GOAL, baseline_note(k, "e2e")) if i and f else None, " s"))
    one = _e2e(k, "invariant", "batched", None)
    if bound:
        rows.append(_row("one-chunk prefill, invariant / FLOP bound", f"≤ {FLOP_GOAL}", one, None, bound,
                         one / bound[1] <= FLOP_GOAL, " s"))
    for step in (None, 2048):
        d, b = _e2e(k, "invariant", "deep", step), _e2e(k, "invariant", "batched", step)
        rows.append(_row(f"deep vs batched, experts resident, invariant, step {step or 'whole prompt'}",
                         "deep ≤ batched", d, None, ("batched", b), _no_slower(k, d, b, step), " s"))
    return rows


def _offload_rows(k: dict, off: dict) -> list[dict]:
    deep = {r["kernels"]: r for r in off["rows"] if r["path"] == "deep"}
    rows, note = [], baseline_note(k, "offload", off.get("fast_served"))
    if "invariant" in deep and "fast" in deep:
        i, f = deep["invariant"], deep["fast"]
        rows.append(_row("offloaded deep prefill", f"inv/fast ≤ {PATH_GOAL}", i.get("seconds"), f.get("seconds"),
                         ("copy/FLOP", i.get("bound_s")), _judge(i["seconds"] / f["seconds"] <= PATH_GOAL, note)
                         if "seconds" in i and "seconds" in f else None, " s"))
    for ks, r in sorted(deep.items()):
        mine = note if ks == "fast" else None
        rows.append(_row(f"offloaded deep / offloaded batched@2048, {ks}", "≥ 5",
                         ratio=f"{r['speedup_over_batched']:.2f}", met=_judge(r["speedup_over_batched"] >= 5, mine)))
        rows.append(_row(f"offloaded deep / copy bound, {ks}", "≤ 1.25",
                         ratio=f"{r['ratio']:.2f} (bytes moved); {r['ratio_min_bytes']:.2f} (routed experts' bytes)",
                         met=_judge(max(r["ratio"], r["ratio_min_bytes"]) <= 1.25, mine)))
    return rows


def _drafted_row(k: dict) -> dict:
    d, name = k.get("drafted") or {}, "drafted verify (MTP k=2), ms per generated token, CUDA graphs"
    sel = {r["set"]: r["ms_per_token"] for r in d.get("rows", []) if r["run"] == "drafted graphs"}
    if len(sel) < 2:
        return _row(name, f"inv/fast ≤ {PATH_GOAL}", ratio=d.get("error", "not measured"))
    i, f = sel["invariant"], sel["fast"]
    return _row(name, f"inv/fast ≤ {PATH_GOAL}", i, f, None, _judge(i / f <= PATH_GOAL, baseline_note(k, "drafted")),
                " ms")


def _gemm_rows(k: dict) -> list[dict]:
    rows = []
    for lo, hi, gl in ((64, 512, GEMM_GOAL), (4096, 16384, 1.05)):
        sel = [r for r in k["gemm"]["rows"] if r["goal"] is not None and lo <= r["M"] <= hi]
        fig = "; ".join(f"{_label(s)} {min(r['ratio'] for r in sel if r['shape'] == s):.2f}–"
                        f"{max(r['ratio'] for r in sel if r['shape'] == s):.2f}"
                        for s in dict.fromkeys(r["shape"] for r in sel))
        n = sum(r["met"] for r in sel)
        rows.append(_row(f"GEMM invariant / cuBLAS, GPU time, M = {lo}–{hi}", f"≤ {gl}",
                         ratio=f"{fig} ({n} of {len(sel)} met)", met=n == len(sel)))
    return rows


RECEIPT_S = 300


def receipt_row(receipt: dict | None) -> dict:
    """The whole-receipt goal from a receipt.json's notebook times: the side-by-side notebooks' longest plus the
    timed ones run alone after them (the notebooks' wall time; setup and the HTML page are not in it)."""
    name, goal = "whole GPU receipt (make receipts PROFILE=gpu)", f"≤ {RECEIPT_S // 60} min"
    if receipt is None:
        return _row(name, goal, ratio="not measured here (--receipt DIR reads a receipt's notebook times)")
    from exactness.receipt.sections import SECTIONS, section_of
    nbs, side = receipt["notebooks"], receipt.get("side_by_side", 1)
    timed = {e["name"] for e in nbs if side > 1 and getattr(SECTIONS.get(section_of(e["name"])), "timed", False)}
    shared = [e["seconds"] for e in nbs if e["name"] not in timed]
    alone = [e["seconds"] for e in nbs if e["name"] in timed]
    total = (max(shared, default=0.0) if side > 1 else sum(shared)) + sum(alone)
    how = (f"{max(shared, default=0.0):.0f} s side by side + {sum(alone):.0f} s alone" if side > 1
           else f"{len(shared)} notebooks in turn")
    return _row(name, goal, inv=total, unit=" s", ratio=f"{receipt['status']}; {how}",
                met=receipt["status"] == "ok" and total <= RECEIPT_S)


def goal_rows(k: dict, off: dict, cfg=None, receipt: dict | None = None) -> list[dict]:
    """The goals table from bench_gpu_kernels' results ``k`` (ceilings, decode_step, gemm, e2e; streams and drafted
    optional; fast_served or fast_kernels: what served the fast set, baseline_note) and bench_offload's JSON ``off``:
    one row per goal (module docstring). ``cfg``: the model (default the small preset) for the decode memory bound;
    ``receipt``: a GPU receipt.json for the whole-receipt row.

    Raises:
        ValueError: the two results are of different prompts (their prompt_tokens differ).
    """
    from exactness.config import get_preset
    P = {r.get("prompt_tokens") for r in k["e2e"]["rows"]} | {off.get("prompt_tokens")}
    if len(P - {None}) > 1:
        raise ValueError(f"the results are of different prompts: prompt_tokens {sorted(P - {None})}")
    peak = k["ceilings"]["matmul_tflops"] * 1e12 if "ceilings" in k else off["peak_flops"]
    bw = k["ceilings"]["copy_gbs"] * 1e9 if "ceilings" in k else None
    cfg = cfg or get_preset("small")
    return (_decode_rows(k, cfg, bw) + _prefill_rows(k, off, peak) + _offload_rows(k, off) + [_drafted_row(k)]
            + _gemm_rows(k) + [receipt_row(receipt)])


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


# Decode-step kernels by what they read (name prefixes as the profiler prints them): the routed experts' weights,
# the dense weights (q, k, v, o, router, LM head; the o projection's launch also adds the residual and norms, the
# router's also takes the softmax/top-k) or the KV cache.
_READS = {"experts": ("_grouped_kernel", "_ZN7cutlass"),
          "dense": ("_gemm", "_split_reduce", "nvjet", "_dense_norm", "_router_split"),
          "KV cache": ("_attn", "_combine_kernel", "void pytorch_flash")}


def own_times(k: dict, ks: str) -> tuple[dict | None, str]:
    """Kernel set ``ks``'s decode-step profile on graphs whose kernel times are the kernels' own: the one captured
    without PDL where the run has it (with PDL a kernel's time counts its wait for the one before), and a label."""
    profs = (k.get("decode_step") or {}).get("kernels") or {}
    off = profs.get(f"{ks} (PDL off) (graphs)")
    return (off, " (profiled without PDL)") if off else (profs.get(f"{ks} (graphs)"), "")


def decode_roofline(k: dict, cfg, bw: float) -> list[dict]:
    """The decode step's top kernels (profiled, 1 stream at CONTEXT) against the bytes their class must read:
    per set, GPU µs of the experts', dense and attention kernels, their memory bound and the ratio. A kernel
    launched with PDL starts before its predecessor ends and waits, so its duration counts that wait: own_times."""
    H, D, E = cfg.hidden, cfg.head_dim, cfg.n_experts
    need = {"experts": cfg.n_layers * cfg.top_k * 3 * cfg.expert_inter * H * 2,
            "dense": (cfg.n_layers * (2 * H * cfg.n_heads * D + 2 * H * cfg.n_kv_heads * D + E * H)
                      + cfg.vocab_size * H) * 2,
            "KV cache": cfg.n_layers * 2 * CONTEXT * cfg.n_kv_heads * D * 2}
    out = []
    for ks in ("invariant", "fast"):
        exact, _ = own_times(k, ks)
        if not exact:
            continue
        for cls, prefixes in _READS.items():
            us = sum(t["us"] for t in exact["top"] if t["kernel"].startswith(prefixes))
            bound = need[cls] / bw * 1e6
            out.append({"set": ks, "reads": cls, "MB": need[cls] / 1e6, "gpu_us (top kernels)": us,
                        "bound_us": bound, "ratio": us / bound})
        out.append({"set": ks, "reads": "whole step", "MB": sum(need.values()) / 1e6,
                    "gpu_us (top kernels)": exact["gpu_us"], "bound_us": sum(need.values()) / bw * 1e6,
                    "ratio": exact["gpu_us"] / (sum(need.values()) / bw * 1e6), "launches": exact["launches"]})
    return out


def streams_step(bg, n: int = STREAMS) -> dict:
    """Median wall ms of one decode step of ``n`` streams at CONTEXT positions each (graphs.GraphDecoder), each
    set, whether a replay's logits equal the eager step's as bytes, and the graph pieces per step (1: attention
    captured; more: it runs eagerly between pieces)."""
    import torch
    from exactness import paths
    from exactness.cache import KVCache
    from exactness.exact import bytes_equal
    from exactness.graphs import GraphDecoder
    from exactness.model import DECODE, forward
    w = bg._weights("device")
    cache = KVCache(w.cfg, CONTEXT + 64, n, w.dtype, w.device)
    ids = torch.randint(0, 256, (CONTEXT,), generator=torch.Generator().manual_seed(0))
    for s in range(n):
        paths.prefill(w, cache, ids, "fast", paths.Schedule("batched", CONTEXT), slot=s)
    tok = ids[-n:].to(w.device)
    pos, slots = [CONTEXT] * n, list(range(n))
    out = {"streams": n, "graphs_ms": {}, "same_logits": {}, "reason": {}, "pieces": {}}
    for ks in ("fast", "invariant"):
        dec = GraphDecoder(w, cache, ks, batch=n)
        dec.step(tok, pos, slots)                                              # eager, then capture
        eager = forward(w, tok, torch.tensor(pos, device=w.device), cache, ks, DECODE,
                        slots=torch.tensor(slots, device=w.device)).logits.clone()
        out["same_logits"][ks] = bytes_equal(eager, dec.step(tok, pos, slots))
        times = []
        for i in range(40):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dec.step(tok, [CONTEXT + i % 8] * n, slots)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out["graphs_ms"][ks] = statistics.median(times[8:]) * 1e3
        out["reason"][ks], out["pieces"][ks] = dec.info()["reason"], dec.info()["pieces"]
    print(f"decode step of {n} streams at {CONTEXT}: {out}")
    return out


def _section(fn, *a) -> dict:
    """fn(*a), or {"error": ...} where it raised (the other sections still run)."""
    try:
        return fn(*a)
    except Exception as e:  # a benchmark section's failure is reported in its row, not fatal
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:200]}


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
    args = SimpleNamespace(e2e_weights="device", e2e_tokens=0, e2e_reps=5, e2e_oracle=False, tune=False,
                           drafted_tokens=4096)
    from exactness.kernels import fast_cuda
    k, served = {}, {}
    bg._step_kernels = functools.partial(bg._step_kernels, top=40)   # every kernel of a step, for decode_roofline
    for s in ("ceilings", "decode_step", "gemm", "e2e", "drafted"):
        t0 = time.perf_counter()
        k[s] = _section(getattr(bg, s), args)
        served[s] = fast_cuda.served()
        print(f"[{s}: {time.perf_counter() - t0:.1f} s]", flush=True)
    k["streams"] = _section(streams_step, bg)
    served["streams"] = fast_cuda.served()
    k["chain"] = _section(chain_floor)
    off_json = os.path.join(out_dir or tempfile.mkdtemp(), "offload.json")
    err = _section(bo.main, ["--weights", "device", "--json", off_json, "--reps", "1"])
    served["offload"] = fast_cuda.served()
    k["fast_served"] = served                    # per section: what served the fast set up to its end (sticky)
    k["fast_kernels"] = dict(fast_cuda.STATUS)   # what served the fast set in the whole run
    off = {"rows": [], "error": err["error"]} if isinstance(err, dict) else {}
    if os.path.exists(off_json):
        with open(off_json) as f:
            off = json.load(f)
    prof = _section(_prefill_profiles, bg)
    return k, off, prof


def chain_floor() -> dict:
    """What one more kernel costs a CUDA-graph step: bench_launch_chain's slope for kernels of 132 programs launched
    with PDL (as the invariant set launches on sm_90)."""
    import bench_launch_chain as bl
    row = bl.chain_rows(programs=(132,), pdls=(True,))[0]
    print(f"launch chain: {row['per_kernel_us']:.2f} us a kernel (132 programs, PDL)", flush=True)
    return row


def _prefill_profiles(bg) -> dict:
    """GPU time by kernel of one prefill of the code prompt per set, batched one chunk and deep one segment; the
    invariant kernels without programmatic dependent launch (with it, a kernel's time counts its wait for the one
    before: bench_gpu_kernels._step_kernels)."""
    from exactness import paths
    from exactness.cache import KVCache
    from exactness.kernels import triton_rows as tr
    from exactness.prompts import build_prompt
    w = bg._weights("device")
    ids = build_prompt("code").ids.to(w.device)

    def run(ks, path):
        cache = KVCache(w.cfg, ids.numel() + 1, 1, w.dtype, w.device)
        paths.prefill(w, cache, ids, ks, paths.Schedule(path, None, 512))
    with tr.launch_settings(pdl=False):
        return {f"{ks} {p}": bg._step_kernels(f"{ks} {p} prefill, one segment", lambda: run(ks, p), top=6)
                for ks in ("invariant", "fast") for p in ("batched", "deep")}


def limits(rows: list[dict], k: dict, prof: dict | None) -> list[str]:
    """The closing note: for each goal not judged, why (baseline_note); for each missed goal, its figures against its
    bound, and the measured kernel profile (the top kernels by GPU time of the step or prefill behind it) where this
    run has one; for the decode step also the part of its wall time its launches account for (_chain_part), and
    where the fast set's figure in it is of a fallback, why."""
    out = []
    dec = (k.get("decode_step") or {}).get("kernels") or {}
    for r in rows:
        if r["met"].startswith("not judged"):
            out.append(f"- {r['measure']}: {r['met']}")
        if r["met"] != "MISSED":
            continue
        line = f"- {r['measure']}: invariant {r['invariant']}, fast {r['fast']}, bound {r['bound']}"
        src, how, tail = None, "", ""
        if r["measure"].startswith("decode step"):
            src, how = own_times(k, "invariant")
            f = dec.get("fast (graphs)")
            if f:
                line += (f"; fast GPU {f['gpu_us']:.0f} us in {f['launches']} launches "
                         f"({f['gpu_us'] / f['launches']:.1f} us a launch on average)")
            tail = _chain_part(k, src)
            fell = _failed(k, "decode_step")
            tail += f"; the fast figure is its fallback's: {fell}" if fell else ""
        elif r["measure"].startswith(("prefill, one chunk", "one-chunk")) and prof and "error" not in prof:
            src = prof.get("invariant batched")
        elif r["measure"].startswith("prefill, deep@one") and prof and "error" not in prof:
            src = prof.get("invariant deep")
        elif r["measure"].startswith("concurrent") and "pieces" in (k.get("streams") or {}):
            line += f"; graph pieces per step: {k['streams']['pieces']}"
        elif r["measure"].startswith("GEMM") and "ceilings" in k:
            roof = roofline_rows(k)
            if roof and "64–512" in r["measure"]:
                inv, cub = ([x[c] for x in roof] for c in ("invariant/roof", "cublas/roof"))
                line += (f"; GPU time / roofline (max of FLOPs and bytes): invariant {min(inv):.2f}–{max(inv):.2f}, "
                         f"cuBLAS {min(cub):.2f}–{max(cub):.2f}")
        if src:
            top = ", ".join(f"{t['kernel'][:40]} {t['us']:.0f} us" for t in src["top"][:3])
            line += f"; invariant GPU {src['gpu_us']:.0f} us in {src['launches']} launches{how}, top: {top}"
        out.append(line + tail)
    return out


def _chain_part(k: dict, src: dict | None) -> str:
    """The decode step's launches times what one more chained kernel costs (chain_floor), where this run has both:
    the part of the step's wall time its launches alone account for."""
    c = k.get("chain") or {}
    if not src or "per_kernel_us" not in c:
        return ""
    return (f"; launch chain: {src['launches']} launches x {c['per_kernel_us']:.2f} us = "
            f"{src['launches'] * c['per_kernel_us']:.0f} us (bench_launch_chain, PDL)")


def main(argv=None) -> int:
    """Measure (or read with --from-json), print the goals table, the GEMM roofline and the closing note; write
    goals.json to --out."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""),
                    help="folder for goals.json and offload.json (default: $OUT; none: not saved)")
    ap.add_argument("--from-json", nargs="+", metavar="JSON",
                    help="a run's goals.json, or bench_gpu_kernels.json (decode_step, gemm, e2e; ceilings, "
                         "streams, drafted optional) and bench_offload's JSON")
    ap.add_argument("--receipt", metavar="DIR", help="a `make receipts PROFILE=gpu` run folder: its notebook times "
                    "fill the whole-receipt row")
    a = ap.parse_args(argv)
    prof, receipt = None, None
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    if a.receipt:
        with open(os.path.join(a.receipt, "receipt.json")) as f:
            receipt = json.load(f)
    if a.from_json:
        if len(a.from_json) > 2:
            ap.error(f"--from-json takes 1 or 2 files, got {len(a.from_json)}")
        docs = []
        for path in a.from_json:
            with open(path) as f:
                docs.append(json.load(f))
        k, off = (docs[0]["kernels"], docs[0]["offload"]) if len(docs) == 1 else docs
        prof = docs[0].get("profiles") if len(docs) == 1 else None
    else:
        k, off, prof = measure(a.out)
    try:
        rows = goal_rows(k, off, receipt=receipt)
    except (KeyError, TypeError) as e:
        ap.error(f"the results lack {e}: the kernels JSON needs decode_step, gemm and e2e; the offload JSON is "
                 "bench_offload.py --json's")
    print("## every GPU speed goal, this run (invariant and fast side by side; bound: the row's roofline)")
    print(tabulate(rows, headers="keys", tablefmt="github"))
    if "fast_kernels" in k:
        print("fast set's CUDA kernels on this machine: "
              + ", ".join(f"{n} {v}" for n, v in k["fast_kernels"].items()))
    first = (k.get("decode_step") or {}).get("fast_first_prefill")
    if first:
        print(f"fast set's first 4,096-row prefill in the process (its graphs compiled): "
              f"{first['first_prefill_s']:.1f} s; the same prefill again: {first['again_s']:.3f} s")
    roof = roofline_rows(k) if "ceilings" in k else []
    if roof:
        print("## GEMM at M = 64–512 against its roofline (GPU time, µs)")
        print(tabulate(roof, headers="keys", floatfmt=".2f", tablefmt="github"))
    if "ceilings" in k:
        from exactness.config import get_preset
        dr = decode_roofline(k, get_preset("small"), k["ceilings"]["copy_gbs"] * 1e9)
        if dr:
            print(f"## decode step ({CONTEXT:,} context, CUDA graphs) against its memory bound, by what the kernels "
                  "read (profiled GPU time)")
            print(tabulate(dr, headers="keys", floatfmt=".3g", tablefmt="github"))
    note = limits(rows, k, prof)
    print("## what limits the missed goals, and why a goal is not judged (measured in this run)")
    ties = [r["measure"] for r in rows if r["met"].startswith("tie")]
    print("\n".join(note) if note else "no measured goal is missed" + (f" ({len(ties)} a tie)" if ties else ""))
    if a.out:
        with open(os.path.join(a.out, "goals.json"), "w") as f:
            json.dump({"goals": rows, "roofline": roof, "limits": note, "kernels": k, "offload": off,
                       "profiles": prof}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
