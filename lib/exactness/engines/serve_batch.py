"""Continuous batching for ``exactness serve``: one scheduler thread owns one KV cache of ``max_batch`` slots.

Between decode steps the scheduler admits waiting requests (FIFO) into free slots: each admitted prompt is
prefilled alone by ``paths.prefill`` into its slot under the served Schedule, and its token 0 is loop.first_token
(the argmax of ``schedule.role`` over the last prompt row). Then ONE decode forward (loop.Loop.advance) carries one
row per active request (slots ascending, each row at its request's own position), and the argmax of ``"decode"``
picks each row's next token -- the greedy loop every run kind shares, with requests joining and leaving at any step
(each request a loop.Stream whose callback emits its tokens). A request
leaves when it has its tokens, stops at EOS, or its client is gone (cancelled); its slot is then free for the next
waiting request. A freed slot is not zeroed: its stale positions lie past the new prompt's and every attention
kernel masks keys past a row's position, so they are never read into a result.

With row-invariant kernels (the invariant set) every request's tokens and logits rows equal ``paths.generate``
alone whatever the batch around it; with the fast set a row's bytes may depend on the batch.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from ..cache import KVCache
from ..kernels import KernelSet
from ..loop import DecodeStep, Loop, Stream
from ..paths import Schedule, prefill, served_counts
from ..weights import Weights

END = object()   # the last item a request's emit receives after its Steps


@dataclass
class Job:
    """One parsed request.

    Attributes:
        ids: prompt ids [P] int64; max_tokens: tokens to generate (>= 0).
        logprobs: top-N per generated token (None: none computed); prompt_top: top-N per prompt row (None: no
            prompt logprobs computed).
        ignore_eos: keep generating past the EOS token; the rest are reply-format fields (serve_api).
        served: plan -> {"segments", "rows"} the prefill ran (filled by the run).
    """

    ids: torch.Tensor
    max_tokens: int
    logprobs: int | None = None
    ignore_eos: bool = False
    prompt_top: int | None = None
    stream: bool = False
    id_strings: bool = False
    chat: bool = False
    echo: bool = False
    prompt_logprobs: int | None = None
    template: str | None = None
    served: dict = field(default_factory=served_counts)


@dataclass
class Step:
    """One generated token: its id, (token_logprob, [(id, logprob)] top-N best first) or None, finish reason."""

    token: int
    logprobs: tuple | None
    finish: str | None


@dataclass
class PromptRows:
    """Log-probabilities of prompt tokens 1..P-1, each from the fp32 prompt logit row before it (log_softmax).

    Attributes:
        logprob: [P-1] the prompt token's logprob; rank: [P-1] its rank in the row (1 = best);
        top: [P-1] lists of (id, logprob) pairs, top-N best first. Python floats of the fp32 values.
    """

    logprob: list[float]
    rank: list[int]
    top: list[list[tuple[int, float]]]


def top_of(row: torch.Tensor, n: int | None, token: int) -> tuple | None:
    """row [1, V] fp32 -> (logprob of ``token``, top-n (id, logprob) pairs best first), or None for n None."""
    if n is None:
        return None
    lp = torch.log_softmax(row.float(), dim=-1)[0]
    vals, idx = torch.topk(lp, n)
    return float(lp[token]), [(int(i), float(v)) for i, v in zip(idx.tolist(), vals.tolist())]


def prompt_rows(logits: torch.Tensor, ids: torch.Tensor, n: int) -> PromptRows:
    """logits [P, V] fp32 of the prompt rows, ids [P] int64 -> PromptRows of tokens 1..P-1 with top-``n``."""
    lp = torch.log_softmax(logits.float(), dim=-1)[:-1]                               # [P-1, V] fp32
    tok = ids.to(lp.device)[1:, None]                                                 # [P-1, 1]
    chosen = lp.gather(1, tok)                                                        # [P-1, 1]
    rank = (lp > chosen).sum(dim=1) + 1
    vals, idx = torch.topk(lp, n, dim=1)
    top = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return PromptRows(chosen[:, 0].tolist(), rank.tolist(), top)


@dataclass
class Request:
    """A job in the scheduler: ``emit`` receives PromptRows (when asked), Steps, then END or an exception, all
    called from the scheduler thread; ``cancel()`` (any thread) makes it leave at the next step."""

    job: Job
    emit: object
    cancelled: threading.Event = field(default_factory=threading.Event)
    slot: int = -1
    stream: Stream | None = None     # its tokens in the greedy loop (after its prefill)

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    """The scheduler thread and its KV cache (module docstring); the thread runs while requests are queued or
    active and is started again by the next submit.

    Args:
        w, kernels, schedule, kv_dtype: the served model, kernel set, prefill Schedule and KV-cache dtype.
        max_batch: cache slots = most requests decoded in one forward; max_len: positions per slot.
    Attributes:
        max_rows: the largest decode batch run so far; decode_forwards: decode forwards run; batch_sizes: the row
            count of each decode forward (the last 10,000).
    """

    def __init__(self, w: Weights, kernels: KernelSet, schedule: Schedule, kv_dtype: str, max_batch: int,
                 max_len: int):
        self.w, self.ks, self.sched = w, kernels, schedule
        self.cache = KVCache(w.cfg, max_len, max_batch, w.dtype, w.device, kv_dtype)
        self.loop = Loop(kernels, DecodeStep(w, self.cache, kernels))
        self.max_batch, self.max_len = max_batch, max_len
        self.waiting: deque[Request] = deque()
        self.active: dict[int, Request] = {}
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.max_rows, self.decode_forwards = 0, 0
        self.batch_sizes: deque[int] = deque(maxlen=10_000)

    def submit(self, job: Job, emit) -> Request:
        """Queue ``job`` (FIFO); ``emit`` receives its items (Request). Returns the Request (to cancel it)."""
        req = Request(job, emit)
        with self.cond:
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="serve-scheduler", daemon=True)
                self.thread.start()
            self.waiting.append(req)
            self.cond.notify()
        return req

    def _loop(self) -> None:
        while True:
            with self.cond:
                if not self.waiting and not self.active:   # idle: the thread ends; the next submit starts one
                    self.thread = None
                    return
                admitted = self._take()
            for r in admitted:
                self._guarded(self._prefill, [r])
            for r in [r for r in self.active.values() if r.cancelled.is_set()]:
                self._release(r)
            batch = [self.active[s] for s in sorted(self.active)]
            if batch:
                self._guarded(self._decode, batch)

    def _take(self) -> list[Request]:
        """Waiting requests moved into free slots, oldest first (cancelled ones dropped); under the lock."""
        free = [s for s in range(self.max_batch) if s not in self.active]
        out = []
        while self.waiting and free:
            r = self.waiting.popleft()
            if r.cancelled.is_set():
                continue
            r.slot = free.pop(0)
            self.active[r.slot] = r
            out.append(r)
        return out

    def _guarded(self, fn, reqs: list[Request]) -> None:
        """Run fn(reqs); an exception goes to each of ``reqs``, which then leave."""
        try:
            fn(reqs)
        except Exception as e:  # noqa: BLE001 -- handed to each request's client
            for r in reqs:
                if r.slot in self.active:
                    self._release(r, e)

    def _prefill(self, reqs: list[Request]) -> None:
        r = reqs[0]
        job, ks = r.job, self.ks
        self.cache.lengths[r.slot] = 0
        logits = prefill(self.w, self.cache, job.ids, ks, self.sched, slot=r.slot, served=job.served).logits
        if job.prompt_top is not None:
            r.emit(prompt_rows(logits, job.ids, job.prompt_top))
        if job.max_tokens == 0:
            self._release(r)
            return
        r.stream = Stream(r.slot, int(job.ids.numel()), job.max_tokens, keep_rows=False,
                          on_token=lambda _s, token, row: self._step(r, token, row))
        self.loop.start(r.stream, logits[-1:], self.sched.role)

    def _decode(self, batch: list[Request]) -> None:
        self.loop.advance([r.stream for r in batch])                                     # ONE decode forward
        self.decode_forwards, self.max_rows = self.loop.forwards, self.loop.max_rows
        self.batch_sizes.append(len(batch))

    def _step(self, r: Request, token: torch.Tensor, row: torch.Tensor) -> bool:
        """Emit ``token`` [1] just picked for ``r`` from logits ``row`` [1, V]; release ``r`` when it is done.
        Returns whether ``r`` left (its stream stops)."""
        t, n = int(token.reshape(-1)[0]), len(r.stream.ids)
        eos = not r.job.ignore_eos and t == self.w.cfg.eos_id
        finish = "stop" if eos else ("length" if n == r.job.max_tokens else None)
        r.emit(Step(t, top_of(row, r.job.logprobs, t), finish))
        if finish or r.cancelled.is_set():
            self._release(r)
            return True
        return False

    def _release(self, r: Request, error: Exception | None = None) -> None:
        """Free ``r``'s slot (the next prefill there starts at position 0) and send END or ``error``."""
        self.active.pop(r.slot, None)
        self.cache.lengths[r.slot] = 0
        r.emit(END if error is None else error)
