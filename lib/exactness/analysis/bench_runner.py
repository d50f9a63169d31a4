"""The bench's timed requests: one greedy request at a time (plain, drafted, cold exact-length, streams) through our
engine (engines/reference.py) with the metrics analysis/bench.py defines (TTFT, tok/s, ITL gaps, peak memory) and
the rows each plan served; analysis/bench.py runs the section from them.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from ..engines.reference import ReferenceEngine
from ..exact import token_hash
from ..params import BenchParams

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


PATHS = ReferenceEngine.PATHS


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
    """Timed greedy requests on our engine (``engine``: weights, expert provider, KV format and graphs as the bench
    asks; one engine per kernel set, engine.with_kernels) with the bench's prefill path.

    Each method returns a record (``_record``): kind, prompt_tokens, hash, path_served, prefilled_rows,
    cache_state, peak_mem_bytes, decode_graphs (None without graphs, else whether they served, replays, eager
    steps and why not), the timing_metrics fields and ``_gen_ids`` (dropped before the JSON).
    """

    def __init__(self, engine: ReferenceEngine, p: BenchParams):
        self.base, self.engines = engine, {}
        self.experts, self.device = engine.experts, engine.w.device
        self.path, self.step = p.bench_path, p.bench_step

    def engine(self, ks: str) -> ReferenceEngine:
        """Our engine with kernel set ``ks`` (made on first use, sharing the base engine's model)."""
        if ks not in self.engines:
            self.engines[ks] = self.base.with_kernels(ks)
        return self.engines[ks]

    def plain(self, ids: torch.Tensor, ks: str, gen: int, path: str | None = None) -> dict:
        """One plain request (``path`` overrides the bench path, e.g. for the memory comparison)."""
        eng = self.engine(ks)
        config = eng.configuration(path or self.path, self.step)
        with peak_memory(self.device) as mem:
            r = eng.run(ids, gen, config)
        return self._note(_record("plain", ids, r.gen_ids, r.served, r.ttft_s, list(r.token_times),
                                  mem["peak_bytes"], r.graphs_record()))

    def _note(self, rec: dict) -> dict:
        """Say so in ``path_served`` when offloaded experts had no ring (deep rows then fetched synchronously)."""
        if self.experts is not None and not self.experts.deep_ready:
            rec["path_served"] += f"; expert ring not reserved ({self.experts.fallback_reason})"
        return rec

    def drafted(self, ids: torch.Tensor, ks: str, gen: int) -> dict:
        """One drafted request (MTP head, MTP_K drafts); a round's tokens are stamped at its end."""
        eng = self.engine(ks)
        eng.load_mtp()  # the head is loaded once, before any timed request
        with peak_memory(self.device) as mem:
            r = eng.run_drafted(ids, gen, eng.configuration(self.path, self.step), draft="mtp")
        times = list(r.token_times)
        rec = _record("drafted", ids, r.gen_ids, r.served, times[0], times, mem["peak_bytes"], r.graphs_record())
        rec["acceptance"] = r.stats.acceptance_rate
        return self._note(rec)

    def streams(self, ids: torch.Tensor, n: int, ks: str, gen: int) -> list[dict]:
        """``n`` concurrent streams of the same prompt joining at step 0 (the engine's run_concurrent); one record
        per stream (TTFT counted from the start of the whole run)."""
        eng = self.engine(ks)
        with peak_memory(self.device) as mem:
            res = eng.run_concurrent([ids] * n, gen, eng.configuration(self.path, self.step), offset=0)
        g = res.graphs.get(n)   # all n streams join at step 0 and leave together: every forward has n rows
        graphs = {k: g[k] for k in ("served", "replays", "eager_steps", "reason")} if g else None
        out = []
        for s in res.streams:
            times = list(s.token_times)
            served = {p: {"segments": 0, "rows": 0} for p in PATHS}  # a stream's record leaves its prefill out
            rec = _record("stream", ids, s.gen_ids, served, times[0], times, mem["peak_bytes"], graphs)
            rec.update(prefilled_rows=None, cache_state="cold (fresh cache per run)", path_served=None)
            out.append(rec)
        return out
