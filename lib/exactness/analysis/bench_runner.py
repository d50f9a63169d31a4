"""The bench's timed requests: one greedy request at a time (plain, drafted, cold exact-length, streams) through the
engine's paths with the metrics analysis/bench.py defines (TTFT, tok/s, ITL gaps, peak memory) and the rows each
plan served; analysis/bench.py runs the section from them.
"""
from __future__ import annotations

import inspect
import time
from contextlib import ExitStack, contextmanager
from dataclasses import replace

import numpy as np
import torch

from ..paths import PATHS, Schedule, generate
from ..receipt.params import BenchParams
from .hashes import token_hash

MTP_K = 2                # drafts per verify round


# ----------------------------------------------------------------------------------------------------- timing

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing_metrics(n_prompt: int, ttft_s: float, token_times: list[float]) -> dict:
    """Metrics of one stream (defined in analysis/bench.py's module docstring).

    Args:
        n_prompt: prompt tokens; ttft_s: seconds to the first token; token_times: seconds since the request of
            every generated token (non-decreasing).
    Returns:
        ttft_s, prefill_tps, decode_tps and itl_mean_ms (None for fewer than 2 tokens or a zero span),
        itl_p50_ms / itl_p95_ms (None for fewer than 2 tokens), generated.
    """
    n = len(token_times)
    span = token_times[-1] - token_times[0] if n > 1 else 0.0
    gaps = np.diff(np.asarray(token_times, dtype=np.float64)) * 1e3                   # ms
    return {"ttft_s": ttft_s, "prefill_tps": n_prompt / ttft_s if ttft_s > 0 else None,
            "decode_tps": (n - 1) / span if span > 0 else None,
            "itl_mean_ms": span / (n - 1) * 1e3 if n > 1 else None,
            "itl_p50_ms": float(np.percentile(gaps, 50)) if n > 1 else None,
            "itl_p95_ms": float(np.percentile(gaps, 95)) if n > 1 else None, "generated": n}


@contextmanager
def after_calls(module, name: str, callback, device: torch.device):
    """Within the block, ``module.<name>`` calls ``callback(bound_arguments, result)`` right after each call
    (device synchronised first, so a timestamp taken there is the result's); restored on exit."""
    original = getattr(module, name)
    sig = inspect.signature(original)

    def wrapped(*args, **kwargs):
        out = original(*args, **kwargs)
        _sync(device)
        callback(sig.bind(*args, **kwargs).arguments, out)
        return out

    setattr(module, name, wrapped)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextmanager
def peak_memory(device: torch.device):
    """Yields a dict whose ``peak_bytes`` is set on exit to torch.cuda.max_memory_allocated over the block
    (None on CPU)."""
    out = {"peak_bytes": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        yield out
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            out["peak_bytes"] = int(torch.cuda.max_memory_allocated(device))


def _served_rows(served: dict) -> int:
    return sum(served[p]["rows"] for p in PATHS)


def _path_served(served: dict) -> str:
    """e.g. "deep 2048 rows/1 seg, batched 40 rows/1 seg (fallback: ...)"."""
    parts = [f"{p} {served[p]['rows']} rows/{served[p]['segments']} seg" for p in PATHS if served[p]["rows"]]
    if served.get("fallback", {}).get("rows"):
        parts.append(f"fallback {served['fallback']['rows']} rows: {served['fallback'].get('reason')}")
    return ", ".join(parts)


def _record(kind: str, ids: torch.Tensor, gen_ids, served: dict, ttft: float, times: list, peak,
            graphs: dict | None = None) -> dict:
    P = int(ids.numel())
    rows = _served_rows(served)
    return {"kind": kind, "prompt_tokens": P, "hash": token_hash(gen_ids), "_gen_ids": gen_ids.cpu(),
            "decode_graphs": graphs,
            "served": served, "path_served": _path_served(served), "prefilled_rows": rows,
            "cache_state": "cold" if rows == P else f"hit ({P - rows} rows not prefilled)",
            "peak_mem_bytes": peak, "last_token_s": times[-1] if times else None,
            "_gaps_ms": np.diff(np.asarray(times, dtype=np.float64)) * 1e3, **timing_metrics(P, ttft, times)}


# ------------------------------------------------------------------------------------------------------ runner

class Runner:
    """Timed greedy requests on one model (weights, optional expert store) with the bench's prefill path.

    Each method returns a record (``_record``): kind, prompt_tokens, hash, path_served, prefilled_rows,
    cache_state, peak_mem_bytes, decode_graphs (None without graphs, else whether they served, replays, eager
    steps and why not), the timing_metrics fields and ``_gen_ids`` (dropped before the JSON).
    """

    def __init__(self, w, experts, p: BenchParams):
        self.w, self.experts, self.device = w, experts, w.device
        self.schedule = Schedule(p.bench_path, p.bench_step, p.deep_threshold)
        self.mtp, self.kv_dtype = None, p.kv_dtype   # what every request's KV cache stores
        self.graphs = p.bench_graphs and w.device.type == "cuda"   # replay what can be captured after prefill

    def plain(self, ids: torch.Tensor, ks: str, gen: int, path: str | None = None) -> dict:
        """One paths.generate request (``path`` overrides the bench path, e.g. for the memory comparison)."""
        schedule = self.schedule if path is None else replace(self.schedule, path=path)
        with peak_memory(self.device) as mem:
            r = generate(self.w, ids, gen, ks, schedule, experts=self.experts, kv_dtype=self.kv_dtype,
                         graphs=self.graphs)
        return self._note(_record("plain", ids, r.gen_ids, r.served, r.ttft_s, list(r.token_times),
                                  mem["peak_bytes"], r.graphs_record()))

    def _note(self, rec: dict) -> dict:
        """Say so in ``path_served`` when offloaded experts had no ring (deep rows then fetched synchronously)."""
        if self.experts is not None and not self.experts.deep_ready:
            rec["path_served"] += f"; expert ring not reserved ({self.experts.fallback_reason})"
        return rec

    def drafted(self, ids: torch.Tensor, ks: str, gen: int) -> dict:
        """One mtp.generate_drafted request (MTP head, MTP_K drafts); tokens stamped at each round's end."""
        from .. import mtp
        if self.mtp is None:
            self.mtp = mtp.resolve_mtp(self.w)  # the head is loaded once, before any timed request
        stamps = []

        def first(args, out):
            stamps.append(time.perf_counter())

        def round_done(args, out):
            stamps.extend([time.perf_counter()] * (len(args["state"].gen) - len(stamps)))

        with ExitStack() as stack, peak_memory(self.device) as mem:
            stack.enter_context(after_calls(mtp, "prefill", first, self.device))
            stack.enter_context(after_calls(mtp, "_round", round_done, self.device))
            t0 = time.perf_counter()
            r = mtp.generate_drafted(self.w, ids, gen, ks, self.schedule, k=MTP_K, draft="mtp", mtp=self.mtp,
                                     experts=self.experts, kv_dtype=self.kv_dtype, graphs=self.graphs)
        times = [t - t0 for t in stamps[:gen]]
        rec = _record("drafted", ids, r.gen_ids, r.served, times[0], times, mem["peak_bytes"], r.graphs_record())
        rec["acceptance"] = r.stats.acceptance_rate
        return self._note(rec)

    def streams(self, ids: torch.Tensor, n: int, ks: str, gen: int) -> list[dict]:
        """``n`` concurrent streams of the same prompt joining at step 0 (batch.run_streams); one record per
        stream (TTFT counted from the start of the whole run)."""
        from .. import batch
        stamps: list[list[float]] = [[] for _ in range(n)]

        def prefilled(args, out):
            stamps[args.get("slot", 0)].append(time.perf_counter())

        def stepped(args, out):
            now = time.perf_counter()
            for j in args["active"]:
                stamps[j].append(now)

        with ExitStack() as stack, peak_memory(self.device) as mem:
            stack.enter_context(after_calls(batch, "prefill", prefilled, self.device))
            stack.enter_context(after_calls(batch, "_batched_step", stepped, self.device))
            t0 = time.perf_counter()
            res = batch.run_streams(self.w, [ids] * n, gen, ks, self.schedule, offset=0, experts=self.experts,
                                    kv_dtype=self.kv_dtype, graphs=self.graphs)
        g = res.graphs.get(n)   # all n streams join at step 0 and leave together: every forward has n rows
        graphs = {k: g[k] for k in ("served", "replays", "eager_steps", "reason")} if g else None
        out = []
        for j, s in enumerate(res.streams):
            times = [t - t0 for t in stamps[j]]
            served = {p: {"segments": 0, "rows": 0} for p in PATHS}  # run_streams does not report it
            rec = _record("stream", ids, s.gen_ids, served, times[0], times, mem["peak_bytes"], graphs)
            rec.update(prefilled_rows=None, cache_state="cold (fresh cache per run)", path_served=None)
            out.append(rec)
        return out
