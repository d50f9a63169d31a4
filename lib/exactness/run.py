"""The run record: what one greedy run returned, whoever computed it (our engine, transformers, llama.cpp, a server).

Parts an engine does not expose are None (never estimated, never faked). Our engine's runs also carry, in ``info``,
what served them (``path``, ``step``, ``kernels``, ``deep_threshold``, ``kv_dtype``, ``served``, ``graphs``, and per
run kind ``draft``, ``k``, ``draft_stats``, ``mtp_source``, ``key``, ``stored``, ``stream``, ``join_step`` ...); the
properties below read them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Run:
    """One prompt run greedily under one configuration.

    Attributes:
        config: the configuration's name (our engine: ``decode``, ``batched``, ``batched-7``, ``deep-64``,
            ``packed-batched``, as ReferenceEngine names them).
        gen_ids: [G] int64 cpu, the greedily generated token ids.
        prompt_logits: [R, V] fp32 cpu (R = P - prompt_start, exactly upcast from the engine's dtype) or None.
        gen_logits: [G, V] fp32 cpu, the row each generated token was chosen from (row 0 = last prompt row), or None.
        top_logprobs: per generated token, a list of (token id, logprob) pairs, best first, or None.
        kv: the KV cache as stored after the run, 2L tensors (keys of layers 0..L-1, then values), each
            position-major [T, ...], or None.
        ttft_s: seconds from the request to the first generated token; decode_s: seconds of the other G-1.
        token_times: seconds from the request to each generated token (len G), or None.
        info: anything else the engine reports about the run (served plans, acceptance, resume point), JSON-ready
            for adapters; our engine's internal runs may hold a DraftStats (``draft_stats``) and the MTP head's
            cache (``mtp_cache``).
        greedy: whether every generated token was checked to be the top-1 of its row (None: not checked).
        prompt_logprobs: [R, 1+N] float64 (a server's prompt logprobs: the token's, then the top-N) or None.
        prompt_logprob_ids: [R, 1+N] int64, the matching token ids (-1: named by text only), or None.
        prompt_ids: [P] int64 cpu or None.
        prompt_start: the first prompt row whose logits were computed (a resumed run's resume point).
        cache: our engine's KV cache object after the run (cache.KVCache), kept only when asked.
    """

    config: str
    gen_ids: torch.Tensor
    prompt_logits: torch.Tensor | None = None
    gen_logits: torch.Tensor | None = None
    top_logprobs: list | None = None
    kv: list[torch.Tensor] | None = None
    ttft_s: float = 0.0
    decode_s: float = 0.0
    token_times: list[float] | None = None
    info: dict = field(default_factory=dict)
    greedy: bool | None = None
    prompt_logprobs: torch.Tensor | None = None
    prompt_logprob_ids: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    prompt_start: int = 0
    cache: object = None

    # What served our engine's runs (None / {} for other engines').
    path = property(lambda self: self.info.get("path"), doc="prefill path: decode, batched, deep or packed")
    step = property(lambda self: self.info.get("step"), doc="prefill step size (tokens), None = unbounded")
    kernels = property(lambda self: self.info.get("kernels"), doc="kernel set name")
    deep_threshold = property(lambda self: self.info.get("deep_threshold"), doc="rows a deep segment needs")
    kv_dtype = property(lambda self: self.info.get("kv_dtype"), doc="what the KV cache stored (cache.KV_DTYPES)")
    served = property(lambda self: self.info.get("served"), doc="prefill plan -> {segments, rows} actually run")
    graphs = property(lambda self: self.info.get("graphs", {}), doc="CUDA graphs' info, {} when not asked for")
    stats = property(lambda self: self.info.get("draft_stats"), doc="a drafted run's mtp.DraftStats")
    mtp_cache = property(lambda self: self.info.get("mtp_cache"), doc="a drafted run's MTP head cache, when kept")
    resumed_from = property(lambda self: self.prompt_start, doc="prefix length restored from a prompt cache")

    def graphs_record(self) -> dict | None:
        """What a report keeps of ``graphs``: None when CUDA graphs were not asked for; else {"served", "replays",
        "eager_steps", "reason": why a graph did not serve (None when it did)} and, on the decode path, "prompt"
        ("replayed" or "eager: <why>"); a drafted run's per-shape info is summed, its reasons "<shape>: <why>"
        joined with "; "."""
        g = self.graphs
        if not g:
            return None
        if "served" in g:   # one decoder's info
            return {k: g[k] for k in ("served", "replays", "eager_steps", "reason", "prompt") if k in g}
        why = [f"{key}: {s['reason']}" for key, s in g.items() if s["reason"] is not None]
        return {"served": any(s["served"] for s in g.values()), "replays": sum(s["replays"] for s in g.values()),
                "eager_steps": sum(s["eager_steps"] for s in g.values()), "reason": "; ".join(why) or None}


def cache_kv(cache, slot: int = 0) -> list[torch.Tensor] | None:
    """Run.kv of ``slot`` of a cache.KVCache: its 2L tensors' positions 0..length-1 (None for no cache)."""
    if cache is None:
        return None
    return [t[slot, :cache.lengths[slot]] for t in (*cache.k, *cache.v)]
