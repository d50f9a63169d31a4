"""The engine's concurrent streams: N greedy requests decoded in one batch; with exact kernels each equals its run
alone. (The receipt's ``streams`` section, which compares them, is analysis/streams.py.)

Timeline (one global step counter t = 0, 1, ...): stream j joins at t = j * offset; its prefill runs alone through
paths.prefill into cache slot j, and its first token comes from its last prompt row. Then, at every step, ONE decode
forward carries one row per active stream (slots = stream ids, rows in ascending stream order, each at its own
position); a stream leaves once it has ``gen_tokens`` tokens. Prompts may differ in length, so rows of one forward
sit at different positions. With row-invariant decode kernels each stream equals its run alone (paths.generate on
the same prefill path) and the serial no-draft oracle (paths.generate on ``decode``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import KVCache
from .kernels import KernelSet, get_set
from .model import ExpertProvider
from .paths import Schedule, check_run_args, decode_step, prefill
from .weights import Weights

BATCH_LIMIT = 4  # streams one batch (one cache with this many slots) may hold


@dataclass
class StreamRun:
    """One stream of a concurrent run: id, join step, prompt_ids [P], gen_ids [N] int64, prompt_logits [P, V] and
    gen_logits [N, V] fp32 (row 0 = last prompt row), all cpu."""

    stream: int
    join_step: int
    prompt_ids: torch.Tensor
    gen_ids: torch.Tensor
    prompt_logits: torch.Tensor
    gen_logits: torch.Tensor


@dataclass
class StreamsResult:
    """A concurrent run: the streams, global steps taken, decode forwards run and the largest batch (rows)."""

    streams: list[StreamRun] = field(default_factory=list)
    steps: int = 0
    decode_forwards: int = 0
    max_batch_rows: int = 0


def check_streams(n: int, offset: int, max_batch: int = BATCH_LIMIT) -> None:
    """Raises ValueError: n outside 1..max_batch (the batch limit), or offset not an int >= 0 (steps)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_batch:
        raise ValueError(f"stream count must be an int in 1..{max_batch} (the batch limit), got {n!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"stream offset must be an int >= 0 (steps between joins), got {offset!r}")


def run_streams(w: Weights, prompts: list[torch.Tensor], gen_tokens: int, kernels: KernelSet | str = "fast",
                schedule: Schedule = Schedule("batched"), *, offset: int = 2, max_batch: int = BATCH_LIMIT,
                experts: ExpertProvider | None = None) -> StreamsResult:
    """Decode ``len(prompts)`` streams concurrently (module docstring).

    Args:
        prompts: token ids [P_j] int64 per stream (stream j = prompts[j]); gen_tokens: tokens per stream (>= 1).
        schedule: each stream's prefill (as paths.prefill); offset: steps between joins.
        experts: the expert provider (None: the resident weights).
    Returns:
        StreamsResult with one StreamRun per stream.
    Raises:
        ValueError: more streams than ``max_batch``, a bad offset, gen_tokens < 1, or what check_run_args raises.
    """
    check_streams(len(prompts), offset, max_batch)
    if isinstance(gen_tokens, bool) or not isinstance(gen_tokens, int) or gen_tokens < 1:
        raise ValueError(f"gen_tokens must be an int >= 1 for concurrent streams, got {gen_tokens!r}")
    for p in prompts:
        check_run_args(w, int(p.numel()), gen_tokens)
    ks, N = get_set(kernels), len(prompts)
    cache = KVCache(w.cfg, max(int(p.numel()) for p in prompts) + gen_tokens, N, w.dtype, w.device)
    gen: list[list] = [[] for _ in prompts]
    glog: list[list] = [[] for _ in prompts]
    plog: list = [None] * N
    res, t = StreamsResult(), 0
    while any(len(g) < gen_tokens for g in gen):
        for j in range(N):
            if j * offset == t:  # join: prefill alone into slot j
                plog[j] = prefill(w, cache, prompts[j], ks, schedule, slot=j, experts=experts).logits  # [P_j, V]
                gen[j].append(ks.fn("argmax", schedule.role)(plog[j][-1:]))
                glog[j].append(plog[j][-1:])
        active = [j for j in range(N) if gen[j] and len(gen[j]) < gen_tokens]
        if active:
            _batched_step(w, cache, ks, prompts, gen, glog, active, experts)
            res.decode_forwards += 1
            res.max_batch_rows = max(res.max_batch_rows, len(active))
        t += 1
    res.steps = t
    res.streams = [StreamRun(j, j * offset, prompts[j].cpu(), torch.cat(gen[j]).cpu(), plog[j].cpu(),
                             torch.cat(glog[j]).cpu()) for j in range(N)]
    return res


def _batched_step(w, cache, ks, prompts, gen, glog, active, experts) -> None:
    """One decode forward with one row per active stream; appends each stream's token and logits row."""
    dev = w.device
    tokens = torch.cat([gen[j][-1] for j in active])                                   # [B] int64
    pos = torch.tensor([int(prompts[j].numel()) + len(gen[j]) - 1 for j in active], device=dev)  # [B]
    slots = torch.tensor(active, device=dev)                                           # [B]
    logits = decode_step(w, cache, tokens, pos, slots, ks, experts=experts)            # [B, V] fp32
    ids = ks.fn("argmax", "decode")(logits)                                            # [B]
    for r, j in enumerate(active):
        gen[j].append(ids[r:r + 1])
        glog[j].append(logits[r:r + 1])
