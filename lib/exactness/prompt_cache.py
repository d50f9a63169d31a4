"""Prompt cache: KV states of prompt prefixes kept within a memory budget, and requests that resume from them.

A state is ``KVCache.snapshot(slot, n)``: the keys/values of positions 0..n-1 of one request, together with the n
token ids they were computed from. Two modes decide which prefix lengths are kept after a request's prefill:

    grid   the multiples of the step size that fit in the prompt (n = s, 2s, ...): a
           resumed request's tail chunks then start where a fresh request's chunks start
    any    the end of each request's prompt (n = P), so a resume may start at any position

Matching is exact: a cached prefix is reused only when its n token ids equal the prompt's first n ids (compared
element by element, never by hash alone), and only when n < P, so that at least the last prompt row is prefilled
and yields the first token's logits. ``lookup`` takes the longest such prefix; ``get`` resumes from a named state and
raises on a mismatch, so a mismatched prefix is never silently reused.

Eviction: least recently used first, by bytes. Storing a state that would push the total over the budget evicts
the least recently stored-or-hit states until it fits; a state larger than the whole budget is not kept. A budget
of 0 GiB disables the cache (nothing is stored, every lookup misses).
"""
from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .cache import KVCache, KVFormat, KVState
from .expert_providers import ExpertProvider
from .kernels import KernelSet, get_set
from .loop import DecodeStep, Loop, Stream
from .paths import Schedule, check_run_args, prefill, run_info, served_counts, stream_run
from .run import Run
from .weights import Weights

MODES = ("grid", "any")
GIB = 2 ** 30


def prefix_key(ids: torch.Tensor) -> str:
    """Key of a token prefix: its length and the first 16 hex of SHA-256 over the ids as little-endian int32."""
    arr = np.asarray(ids.cpu().numpy(), dtype="<i4")
    return f"{arr.size}:{hashlib.sha256(arr.tobytes()).hexdigest()[:16]}"


@dataclass
class CachedPrefix:
    """One kept state: its key, the token ids [n] int64 (cpu) it was computed from, and the KV copy."""

    key: str
    tokens: torch.Tensor
    state: KVState

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    @property
    def nbytes(self) -> int:
        return self.state.nbytes()


def first_mismatch(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First index < min(len) where token ids a [n], b [m] differ (None when the common part is equal)."""
    n = min(a.numel(), b.numel())
    diff = (a[:n].cpu() != b[:n].cpu()).nonzero()
    return int(diff[0]) if diff.numel() else None


class PromptCache:
    """KV states of prompt prefixes under a byte budget, least recently used evicted first.

    Args:
        budget_gib: memory budget in GiB (2^30 bytes); 0 disables the cache.
        mode: ``"grid"`` (keep states at multiples of ``step``) or ``"any"`` (keep the state at each prompt's end).
        step: prefill step size in tokens (required for ``grid``).
    Raises:
        ValueError: a negative or non-finite budget, an unknown mode, or grid mode without a positive int step.
    """

    def __init__(self, budget_gib: float, mode: str = "grid", step: int | None = None):
        if isinstance(budget_gib, bool) or not isinstance(budget_gib, (int, float)) or not math.isfinite(budget_gib) \
                or budget_gib < 0:
            raise ValueError(f"prompt cache budget must be a finite number of GiB >= 0 (0 disables it), "
                             f"got {budget_gib!r}")
        if mode not in MODES:
            raise ValueError(f"unknown prompt cache mode {mode!r}; allowed: {', '.join(MODES)}")
        if mode == "grid" and (isinstance(step, bool) or not isinstance(step, int) or step <= 0):
            raise ValueError(f"grid mode needs the step size as a positive int (tokens), got {step!r}")
        self.budget_bytes, self.mode, self.step = int(budget_gib * GIB), mode, step
        self._entries: OrderedDict[str, CachedPrefix] = OrderedDict()  # least recently used first
        self.stats = {"hits": 0, "misses": 0, "stored": 0, "evicted": 0, "rejected": 0}

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the kept states."""
        return sum(e.nbytes for e in self._entries.values())

    def keys(self) -> list[str]:
        """Keys of the kept states, least recently used first."""
        return list(self._entries)

    def keep_lengths(self, n_prompt: int) -> list[int]:
        """Prefix lengths this mode keeps for a prompt of ``n_prompt`` tokens."""
        if self.mode == "any":
            return [n_prompt]
        return list(range(self.step, n_prompt + 1, self.step))

    def store(self, ids: torch.Tensor, cache: KVCache, slot: int = 0) -> list[str]:
        """Keep the states of ``ids`` [P] (already prefilled into ``slot`` of ``cache``) at this mode's lengths.

        Returns the keys now kept for this prompt (a length already kept is only marked recently used).
        """
        kept = []
        for n in (self.keep_lengths(int(ids.numel())) if self.enabled else []):
            key = prefix_key(ids[:n])
            if key in self._entries and torch.equal(self._entries[key].tokens, ids[:n].cpu()):
                self._entries.move_to_end(key)
                kept.append(key)
                continue
            entry = CachedPrefix(key, ids[:n].cpu().clone(), cache.snapshot(slot, n))
            if self._insert(entry):
                kept.append(key)
        return kept

    def _insert(self, entry: CachedPrefix) -> bool:
        if entry.nbytes > self.budget_bytes:
            self.stats["rejected"] += 1
            return False
        self._entries.pop(entry.key, None)
        while self._entries and self.nbytes + entry.nbytes > self.budget_bytes:
            self._entries.popitem(last=False)
            self.stats["evicted"] += 1
        self._entries[entry.key] = entry
        self.stats["stored"] += 1
        return True

    def lookup(self, ids: torch.Tensor) -> CachedPrefix | None:
        """The longest kept prefix whose token ids equal ``ids``' first n (n < len(ids)); None on a miss."""
        P, best = int(ids.numel()), None
        for e in self._entries.values():
            longer = best is None or e.length > best.length
            if e.length < P and longer and torch.equal(e.tokens, ids[:e.length].cpu()):
                best = e
        self.stats["hits" if best else "misses"] += 1
        if best is not None:
            self._entries.move_to_end(best.key)
        return best

    def get(self, key: str, ids: torch.Tensor) -> CachedPrefix:
        """Resume request naming state ``key`` for prompt ``ids`` [P].

        Raises:
            ValueError: no state ``key`` is kept; the state is not shorter than the prompt; or its token ids differ
                from the prompt's (the message gives the first differing index and both ids).
        """
        e = self._entries.get(key)
        if e is None:
            raise ValueError(f"no cached prompt state {key!r}; kept: {self.keys()[:8]}")
        if e.length >= ids.numel():
            raise ValueError(f"cached state {key!r} covers {e.length} tokens; the prompt has {ids.numel()} "
                             f"(a resume needs at least one tail token)")
        i = first_mismatch(e.tokens, ids)
        if i is not None:
            raise ValueError(f"cached state {key!r} does not match the prompt: token {i} is {int(e.tokens[i])} in "
                             f"the cached prefix and {int(ids[i])} in the prompt; a mismatched prefix is never reused")
        self._entries.move_to_end(key)
        self.stats["hits"] += 1
        return e


def generate_cached(w: Weights, pc: PromptCache, prompt_ids: torch.Tensor, gen_tokens: int,
                    kernels: KernelSet | str = "fast", schedule: Schedule = Schedule("batched"), *,
                    resume_key: str | None = None, keep_cache: bool = False,
                    experts: ExpertProvider | None = None, kv_dtype: str | KVFormat = "bf16") -> Run:
    """One request: restore the longest cached prefix (or the state ``resume_key``), prefill only the tail
    ``prompt_ids[n:]`` with paths.prefill(start=n), keep this prompt's states in ``pc``, then decode ``gen_tokens``
    greedy tokens (loop.Loop; token 0 under ``schedule.role``, as a fresh run's).

    The tail's chunks of ``schedule.step`` rows start at the resume point n, so they line up with a fresh prefill's
    chunks exactly when n is a multiple of the step (grid mode); elsewhere only row-invariant kernels keep the
    bytes. ``kv_dtype`` (cache.KV_DTYPES name or a KVFormat) is what the request's cache stores; a cached state of
    another format is refused by KVCache.restore.
    Returns:
        Run named ``schedule.name``: prompt_start = n (0: a fresh prefill), prompt_logits [P - n, V] the prefilled
        rows; info adds ``key`` (the restored state's, or None) and ``stored`` (keys kept after the prefill).
    Raises:
        ValueError: what paths.check_run_args raises, PromptCache.get's mismatch errors, an unknown kv_dtype.
    """
    ks, P = get_set(kernels), int(prompt_ids.numel())
    check_run_args(w, P, gen_tokens)
    entry = pc.get(resume_key, prompt_ids) if resume_key is not None else pc.lookup(prompt_ids)
    cache = KVCache(w.cfg, P + max(gen_tokens, 1), 1, w.dtype, w.device, kv_dtype)
    start = 0
    if entry is not None:
        cache.restore(entry.state, 0)
        start = entry.length
    served, t0 = served_counts(), time.perf_counter()
    tail = prefill(w, cache, prompt_ids[start:], ks, schedule, start=start, served=served,
                   experts=experts).logits                                             # [P - start, V] fp32
    stored = pc.store(prompt_ids, cache, 0)
    loop, s = Loop(ks, DecodeStep(w, cache, ks, experts=experts), timed=True), Stream(0, P, gen_tokens)
    loop.start(s, tail[-1:], schedule.role)
    loop.run([s])
    info = run_info(schedule, ks, cache, served, key=entry.key if entry else None, stored=stored)
    return stream_run(schedule.name, s, w.cfg.vocab_size, info, t0, prompt_ids=prompt_ids, prompt_logits=tail,
                      prompt_start=start, cache=cache if keep_cache else None)
