"""Bench tables of engines under test, measured through the Engine protocol (the measures are analysis/bench.py's:
TTFT, prefill tok/s = prompt tokens / TTFT, decode tok/s = (generated - 1) / (last - first token time), mean ITL,
ITL p50/p95; aggregate tok/s of 1 and 2 concurrent streams).

cold is the first request of a prompt to a configuration, warm its identical repeat (an engine's own prompt cache
may serve warm; the server's ``usage.prompt_tokens_details.cached_tokens`` is recorded where it reports one). The
cold-prefill rows use prompts of exactly the asked lengths that no earlier request shares a prefix with (each starts
at its own offset in the source text), and a row whose server reports cached prompt tokens is marked as not cold.
"""
from __future__ import annotations

import time

from ..engines.base import Engine, NotAvailable
from ..exact import token_hash
from .bench_runner import timing_metrics


def _cached(info: dict) -> int | None:
    usage = (info or {}).get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


def _metrics(engine: Engine, ids: list[int], gen_tokens: int, config: str) -> tuple[dict, str]:
    g = engine.generate(ids, gen_tokens, config)
    times = g.token_times or [g.ttft_s + g.decode_s * i / max(1, len(g.gen_ids) - 1) for i in range(len(g.gen_ids))]
    m = timing_metrics(len(ids), g.ttft_s, times)
    return {**m, "token_times": "engine" if g.token_times else "spread evenly (engine gave no stamps)",
            "cached_tokens": _cached(g.info)}, token_hash(g.gen_ids)


def streams_rows(engine: Engine, ids: list[int], gen_tokens: int, config: str, alone: str) -> list[dict] | str:
    """1 and 2 copies of the prompt at once: wall seconds, aggregate tok/s and whether every stream's tokens equal
    the prompt's run alone (token hash ``alone``); or the reason concurrency is not available."""
    rows = []
    for n in (1, 2):
        t0 = time.perf_counter()
        try:
            gens = engine.concurrent([list(ids)] * n, gen_tokens, config)
        except NotAvailable as e:
            return f"not available from this engine: {e}"
        wall = time.perf_counter() - t0
        rows.append({"streams": n, "wall_s": wall, "aggregate_tps": sum(int(g.gen_ids.numel()) for g in gens) / wall,
                     "equal_to_alone": all(token_hash(g.gen_ids) == alone for g in gens)})
    return rows


def cold_rows(engine: Engine, source: list[int], lengths: list[int], gen_tokens: int, config: str) -> list[dict]:
    """Cold prefill at exact prompt lengths, each prompt a slice of ``source`` at its own offset (no shared prefix
    with any earlier request); lengths longer than the source are recorded as skipped with the reason."""
    rows = []
    for i, n in enumerate(lengths):
        start = i + 1
        if start + n > len(source):
            rows.append({"length": n, "skipped": f"the source prompt has {len(source)} tokens"})
            continue
        m, _ = _metrics(engine, source[start:start + n], gen_tokens, config)
        rows.append({"length": n, **m, "cold": not m["cached_tokens"]})
    return rows


def bench_engine(engine: Engine, prompts: dict[str, list[int]], gen_tokens: int, cold_lengths: list[int],
                 source: list[int]) -> dict:
    """Every configuration of ``engine`` on every prompt: cold and warm metrics, 1 and 2 streams (first prompt),
    cold prefill at ``cold_lengths`` (sliced from ``source``, token ids: the full prompts one after another)."""
    out = {"runs": [], "streams": {}, "cold": {}}
    for c in engine.configurations():
        for name, ids in prompts.items():
            cold, _ = _metrics(engine, ids, gen_tokens, c.name)
            warm, h = _metrics(engine, ids, gen_tokens, c.name)
            out["runs"] += [{"config": c.name, "prompt": name, "prompt_tokens": len(ids), "run": k, **m}
                            for k, m in (("cold", cold), ("warm", warm))]
        first = next(iter(prompts.values()))
        out["streams"][c.name] = streams_rows(engine, first, gen_tokens, c.name,
                                              _metrics(engine, first, gen_tokens, c.name)[1])
        out["cold"][c.name] = cold_rows(engine, source, cold_lengths, gen_tokens, c.name)
    return out
