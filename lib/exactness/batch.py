"""The engine's concurrent streams: N greedy requests decoded in one batch; with exact kernels each equals its run
alone. (The receipt's ``streams`` section, which compares them, is analysis/streams.py.)

Timeline (one global step counter t = 0, 1, ...): stream j joins at t = j * offset; its prefill runs alone through
paths.prefill into cache slot j, and its first token comes from its last prompt row. Then, at every step, ONE decode
forward of the greedy loop (loop.Loop) carries one row per active stream (slots = stream ids, rows in ascending
stream order, each at its own position); a stream leaves once it has ``gen_tokens`` tokens. Prompts may differ in
length, so rows of one forward sit at different positions. With row-invariant decode kernels each stream equals its
run alone (paths.generate on the same prefill path) and the serial no-draft oracle (paths.generate on ``decode``).

With ``graphs`` each decode forward of B active streams replays a CUDA graph captured for B rows
(graphs.GraphDecoder, one per active count, the slots loaded per step): the eager forward's bytes. Where a graph
cannot serve (the fast set at B > 1: its per-expert GEMM shapes follow the routing) the eager forward runs and
StreamsResult.graphs says why.

Packed prefill (``packed``): several prompts in ONE prefill forward, prompt j's rows at positions 0..P_j-1 of cache
slot j, rows concatenated in prompt order (a varlen batch; attention is per slot, so a row sees only its own
sequence's keys). run_packed then decodes the prompts together, one decode forward per step. With row-invariant
kernels each packed prompt's logits and KV bytes equal its prefill alone and the decode oracle.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache import KVCache, KVFormat
from .expert_providers import ExpertProvider, ResidentExperts
from .kernels import KernelSet, get_set
from .loop import DecodeStep, Loop, Stream
from .model import BATCHED, DEEP, ForwardOut, forward
from .paths import Schedule, check_run_args, prefill, run_info, served_counts, stream_run
from .run import Run
from .weights import Weights

BATCH_LIMIT = 4  # streams one batch (one cache with this many slots) may hold


@dataclass
class StreamsResult:
    """A concurrent run: one Run per stream (info: stream, join_step), global steps taken, decode forwards run, the
    largest batch (rows), and with graphs, per active count B the GraphDecoder.info() of its forwards ({} when
    graphs were not asked for)."""

    streams: list[Run] = field(default_factory=list)
    steps: int = 0
    decode_forwards: int = 0
    max_batch_rows: int = 0
    graphs: dict[int, dict] = field(default_factory=dict)


def check_streams(n: int, offset: int, max_batch: int = BATCH_LIMIT) -> None:
    """Raises ValueError: n outside 1..max_batch (the batch limit), or offset not an int >= 0 (steps)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_batch:
        raise ValueError(f"stream count must be an int in 1..{max_batch} (the batch limit), got {n!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"stream offset must be an int >= 0 (steps between joins), got {offset!r}")


def run_streams(w: Weights, prompts: list[torch.Tensor], gen_tokens: int, kernels: KernelSet | str = "fast",
                schedule: Schedule = Schedule("batched"), *, offset: int = 2, max_batch: int = BATCH_LIMIT,
                experts: ExpertProvider | None = None, kv_dtype: str | KVFormat = "bf16",
                graphs: bool = False) -> StreamsResult:
    """Decode ``len(prompts)`` streams concurrently (module docstring).

    Args:
        prompts: token ids [P_j] int64 per stream (stream j = prompts[j]); gen_tokens: tokens per stream (>= 1).
        schedule: each stream's prefill (as paths.prefill); offset: steps between joins.
        experts: the expert provider (None: the resident weights); kv_dtype: what the KV cache stores;
        graphs: decode forwards replayed from CUDA graphs, one per active count (module docstring).
    Returns:
        StreamsResult with one Run per stream (config ``schedule.name``; token times from the run's start).
    Raises:
        ValueError: more streams than ``max_batch``, a bad offset, gen_tokens < 1, or what check_run_args raises.
    """
    check_streams(len(prompts), offset, max_batch)
    if isinstance(gen_tokens, bool) or not isinstance(gen_tokens, int) or gen_tokens < 1:
        raise ValueError(f"gen_tokens must be an int >= 1 for concurrent streams, got {gen_tokens!r}")
    for p in prompts:
        check_run_args(w, int(p.numel()), gen_tokens)
    ks, N = get_set(kernels), len(prompts)
    cache = KVCache(w.cfg, max(int(p.numel()) for p in prompts) + gen_tokens, N, w.dtype, w.device, kv_dtype)
    step = DecodeStep(w, cache, ks, experts=experts, graphs=graphs)
    loop = Loop(ks, step, timed=True)
    streams = [Stream(j, int(p.numel()), gen_tokens) for j, p in enumerate(prompts)]
    plog, served = [None] * N, [served_counts() for _ in prompts]
    t, t0 = 0, time.perf_counter()
    while any(len(s.ids) < gen_tokens for s in streams):
        for j in range(N):
            if j * offset == t:  # join: prefill alone into slot j
                plog[j] = prefill(w, cache, prompts[j], ks, schedule, slot=j, served=served[j],
                                  experts=experts).logits                                   # [P_j, V]
                loop.start(streams[j], plog[j][-1:], schedule.role)
        loop.advance(streams)
        t += 1
    runs = [stream_run(schedule.name, s, w.cfg.vocab_size,
                       run_info(schedule, ks, cache, served[j], stream=j, join_step=j * offset), t0,
                       prompt_ids=prompts[j], prompt_logits=plog[j]) for j, s in enumerate(streams)]
    return StreamsResult(runs, t, loop.forwards, loop.max_rows, step.info())


PACKED_PLANS = {"batched": BATCHED, "deep": DEEP}   # plans a packed prefill may run


def prefill_packed(w: Weights, cache: KVCache, prompts: list[torch.Tensor], kernels: KernelSet | str,
                   plan: str = "batched", *, slots: list[int] | None = None,
                   experts: ExpertProvider | None = None) -> list[ForwardOut]:
    """Prefill all ``prompts`` (token ids [P_j] int64) in one forward: prompt j at positions 0..P_j-1 of cache slot
    ``slots[j]`` (default j), its rows after those of prompts 0..j-1.

    Args:
        plan: ``"batched"`` or ``"deep"`` (PACKED_PLANS): the plan of the one forward (the deep plan's tiles then
            span prompts).
    Returns:
        ForwardOut per prompt: logits [P_j, V] fp32, hidden [P_j, H] storage dtype.
    Raises:
        ValueError: no prompts, an empty prompt, an unknown plan, slots not distinct or not one per prompt, a slot
            outside the cache or already holding positions, or a position outside the cache (model.forward).
    """
    slots = list(range(len(prompts))) if slots is None else list(slots)
    _check_packed(cache, prompts, plan, slots)
    dev = w.device
    lens = [int(p.numel()) for p in prompts]
    tokens = torch.cat([p.to(dev) for p in prompts])                                       # [sum P] int64
    pos = torch.cat([torch.arange(n, device=dev) for n in lens])                          # [sum P]
    rows = torch.cat([torch.full((n,), s, device=dev) for n, s in zip(lens, slots)])     # [sum P] slot per row
    out = forward(w, tokens, pos, cache, kernels, PACKED_PLANS[plan], slots=rows, experts=experts)
    return [ForwardOut(lg, h) for lg, h in zip(out.logits.split(lens), out.hidden.split(lens))]


def _check_packed(cache: KVCache, prompts: list[torch.Tensor], plan: str, slots: list[int]) -> None:
    if not prompts:
        raise ValueError("a packed prefill needs at least one prompt, got none")
    if any(int(p.numel()) < 1 for p in prompts):
        raise ValueError("a packed prompt is empty; at least one token each is needed")
    if plan not in PACKED_PLANS:
        raise ValueError(f"unknown packed plan {plan!r}; allowed: {', '.join(PACKED_PLANS)}")
    n_slots = len(cache.lengths)
    if len(slots) != len(prompts) or len(set(slots)) != len(slots) or not all(0 <= s < n_slots for s in slots):
        raise ValueError(f"packed slots {slots} must be {len(prompts)} distinct slots in 0..{n_slots - 1}")
    busy = [s for s in slots if cache.lengths[s]]
    if busy:
        raise ValueError(f"packed prefill starts at position 0, but cache slots {busy} already hold positions")


def run_packed(w: Weights, prompts: list[torch.Tensor], gen_tokens: int, kernels: KernelSet | str = "fast",
               plan: str = "batched", *, keep_cache: bool = False, experts: ExpertProvider | None = None,
               kv_dtype: str | KVFormat = "bf16", max_batch: int = BATCH_LIMIT) -> list[Run]:
    """Prefill ``prompts`` packed into one forward (prefill_packed), then greedily decode ``gen_tokens`` tokens for
    all of them, one decode forward per step with one row per prompt (ascending slot).

    Returns:
        one Run per prompt (config ``packed-<plan>``, path ``"packed"``, step None; ``served`` counts the one packed
        forward under the plan and its ``packed`` entry the prompts and rows it held; ``cache``, when kept, is a
        one-slot copy of the prompt's slot, comparable with exact.kv_first_difference). Token times count from
        the packed prefill's start.
    Raises:
        ValueError: more prompts than ``max_batch``, what check_run_args or prefill_packed raises.
    """
    check_streams(len(prompts), 0, max_batch)
    for p in prompts:
        check_run_args(w, int(p.numel()), gen_tokens)
    ks, N = get_set(kernels), len(prompts)
    cache = KVCache(w.cfg, max(int(p.numel()) for p in prompts) + max(gen_tokens, 1), N, w.dtype, w.device,
                    kv_dtype)
    experts = ResidentExperts(w.layers) if experts is None else experts
    loop = Loop(ks, DecodeStep(w, cache, ks, experts=experts), timed=True)
    t0 = time.perf_counter()
    plog = [o.logits for o in prefill_packed(w, cache, prompts, ks, plan, experts=experts)]   # [P_j, V] each
    streams = [Stream(j, int(p.numel()), gen_tokens) for j, p in enumerate(prompts)]
    for s, lg in zip(streams, plog):
        loop.start(s, lg[-1:], "prompt")   # the packed forward ran the prompt kernels
    loop.run(streams)
    threshold = 1 if plan == "deep" else Schedule("batched").deep_threshold   # the one forward's plan
    runs = []
    for j, s in enumerate(streams):
        served = served_counts()
        served[plan] = {"segments": 1, "rows": int(prompts[j].numel())}
        served["packed"] = {"prompts": N, "rows": sum(int(p.numel()) for p in prompts)}
        info = {**run_info(Schedule("batched", None, threshold), ks, cache, served), "path": "packed"}
        runs.append(stream_run(f"packed-{plan}", s, w.cfg.vocab_size, info, t0, prompt_ids=prompts[j],
                               prompt_logits=plog[j], cache=cache.select(j) if keep_cache else None))
    return runs
