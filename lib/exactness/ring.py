"""The staging ring of expert offload: device buffers filled host->device on a copy stream ahead of use.

:class:`ExpertRing` holds ``slots`` buffers of one unit each (an expert's three matrices, or a layer's stacked
experts) and hands them out in announced order; CUDA events order each compute after its copy and each copy after
the previous use of its slot. offload.ExpertStore builds its expert ring and its layer ring from it;
:class:`StagedWeights` feeds the kernel contract's offload check through a one-slot ring behind a decoy.
"""
from __future__ import annotations

from collections import deque

import torch


def ring_counters() -> dict:
    """Fresh zeroed counters of a ring and its store (fetches by route, copies, speculation, bytes moved)."""
    return {"prepare_calls": 0, "ring_fetches": 0, "sync_fetches": 0, "resident_fetches": 0, "copies": 0,
            "speculative_copies": 0, "speculative_hits": 0, "dropped_copies": 0, "unannounced_calls": 0,
            "bytes_moved": 0}


class ExpertRing:
    """``slots`` device buffers, each holding one unit of expert weights: an expert's (w_gate [I, H], w_up [I, H],
    w_down [H, I]), or a layer's stacked experts ([E, I, H], [E, I, H], [E, H, I]).

    Keys are (layer, expert id) or the layer (any hashable the ``source`` understands). ``schedule(keys)``
    announces the order in which ``take`` will ask for them; copies are issued ahead into free slots (slots neither
    handed to compute nor holding an untaken copy).

    Args:
        shapes: the three tensor shapes; dtype, device: of the buffers.
        slots: number of buffers (>= 1).
        source: ``source(key) -> (w_gate, w_up, w_down)`` host tensors of the key's unit.
        successor: ``successor(key) -> key | None``, the guess copied speculatively once the announced keys are
            all issued (None: no speculation).
        stats: the store's counters, updated in place.
    Raises:
        torch.cuda.OutOfMemoryError: the buffers do not fit on the device.
    """

    def __init__(self, shapes, dtype, device: torch.device, slots: int, source, successor, stats: dict):
        self.bufs = [tuple(torch.empty(s, dtype=dtype, device=device) for s in shapes) for _ in range(slots)]
        self.device, self.source, self.successor, self.stats = device, source, successor, stats
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.ready = [None] * slots     # event: the slot's last copy is done (CUDA only)
        self.free = [None] * slots      # event: compute is done with the slot's previous contents (CUDA only)
        self.slot_of: dict = {}         # key -> slot of an issued copy not yet taken
        self.speculative: set = set()   # keys in slot_of issued on a guess
        self.queue: deque = deque()     # announced keys not yet taken, in order
        self.held: int | None = None    # slot handed to compute by the last take

    @property
    def nbytes(self) -> int:
        """Device bytes the buffers reserve."""
        return sum(t.nbytes for buf in self.bufs for t in buf)

    def release(self) -> None:
        """Mark the slot last handed to compute reusable once the compute enqueued so far has run."""
        if self.held is None:
            return
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.free[self.held] = ev
        self.held = None

    def schedule(self, keys: list) -> None:
        """Announce ``keys`` (taken next, in this order); untaken copies of other keys are dropped."""
        self.release()
        wanted = set(keys)
        for key in [k for k in self.slot_of if k not in wanted]:
            del self.slot_of[key]
            self.speculative.discard(key)
            self.stats["dropped_copies"] += 1
        self.queue = deque(keys)
        self._top_up()

    def clear(self) -> None:
        """Forget the announced keys (a non-deep plan follows); issued copies stay for a later schedule."""
        self.release()
        self.queue.clear()

    def take(self, key):
        """The buffers of ``key`` if it is the next announced key (waiting on its copy), else None."""
        if not self.queue or self.queue[0] != key:
            return None
        self.release()
        if key not in self.slot_of:
            self._top_up()
        if key not in self.slot_of:  # every slot holds a copy wanted later: reuse the latest-wanted one's
            victim = max(self.slot_of, key=lambda k: self.queue.index(k) if k in self.queue else len(self.queue))
            self.speculative.discard(victim)
            self.stats["dropped_copies"] += 1
            self._issue(key, self.slot_of.pop(victim))
        self.queue.popleft()
        slot = self.slot_of.pop(key)
        if key in self.speculative:
            self.speculative.discard(key)
            self.stats["speculative_hits"] += 1
        self.held = slot
        self._top_up()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
        self.stats["ring_fetches"] += 1
        return self.bufs[slot]

    def _free_slots(self) -> list[int]:
        busy = set(self.slot_of.values()) | ({self.held} if self.held is not None else set())
        return [s for s in range(len(self.bufs)) if s not in busy]

    def _top_up(self) -> None:
        free = self._free_slots()
        for key in self.queue:
            if not free:
                return
            if key not in self.slot_of:
                self._issue(key, free.pop(0))
        key = self.queue[-1] if self.queue and self.successor is not None else None
        for _ in range(len(self.bufs)):  # at most one guess per slot, so the walk ends
            if not free or key is None:
                return
            key = self.successor(key)
            if key is not None and key not in self.slot_of:
                self._issue(key, free.pop(0))
                self.speculative.add(key)
                self.stats["speculative_copies"] += 1

    def _issue(self, key, slot: int) -> None:
        src = self.source(key)
        if self.cuda:
            with torch.cuda.stream(self.stream):
                if self.free[slot] is not None:
                    self.stream.wait_event(self.free[slot])
                for dst, s in zip(self.bufs[slot], src):
                    dst.copy_(s, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                self.ready[slot] = ev
        else:
            for dst, s in zip(self.bufs[slot], src):
                dst.copy_(s)
        self.slot_of[key] = slot
        self.stats["copies"] += 1
        self.stats["bytes_moved"] += sum(t.nbytes for t in src)


def host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """``t`` in host memory, contiguous, pinned when ``pin`` (a CUDA device will read it asynchronously)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    out.copy_(t)
    return out


class StagedWeights:
    """Fixed kernel weights kept in host memory (pinned on CUDA) and handed to each call by one of offload's two
    routes; the kernel contract's offload check (analysis/contract/cases.py, ``contract_offload``) feeds expert
    kernels through it.

    ``fetch("ring")`` (the deep plan's route): a one-slot :class:`ExpertRing` on the copy stream stages a *decoy*
    (the weights negated: every nonzero element differs in its sign bit) and then the weights into the same slot.
    A kernel that ran before its copy landed, or a copy that overwrote the slot before the previous kernel had read
    it, reads the decoy, and the contract sees different bytes. ``fetch("sync")`` (decode's and the batched pass's
    route): copied into fresh device tensors, as ExpertStore._fetch_sync does. With several *units* (the weights
    of several experts) the one slot holds different experts over time, as offload's ring slots do: a kernel that
    keeps what it derived from a buffer by the buffer's address reads a stale unit.

    Args:
        tensors: the weights on the compute device (one dtype), e.g. (w_gate [I, H], w_up [I, H]).
        more: further units of the same shapes (other experts' weights), fetched by index 1, 2, ...
    Raises:
        ValueError: an unknown route; torch.cuda.OutOfMemoryError: the slot does not fit.
    """

    ROUTES = ("ring", "sync")

    def __init__(self, tensors: tuple, more: tuple = ()):
        self.device = tensors[0].device
        pin = self.device.type == "cuda"
        self.units = [tuple(host_copy(t, pin) for t in ts) for ts in (tensors, *more)]
        self.decoys = [tuple(host_copy(-t, pin) for t in ts) for ts in self.units]
        self.host, self.decoy = self.units[0], self.decoys[0]
        self.stats = ring_counters()
        self.ring = ExpertRing([t.shape for t in tensors], tensors[0].dtype, self.device, 1,
                               lambda key: (self.decoys if key[1] == "decoy" else self.units)[key[2]], None,
                               self.stats)
        self.calls = 0

    def fetch(self, route: str, unit: int = 0) -> tuple:
        """Unit ``unit``'s weights on the device by ``route`` ("ring" or "sync"), one fresh copy per call."""
        if not 0 <= unit < len(self.units):
            raise ValueError(f"unit {unit!r} outside 0..{len(self.units) - 1}")
        if route == "sync":
            self.stats["sync_fetches"] += 1
            return tuple(torch.empty(h.shape, dtype=h.dtype, device=self.device).copy_(h, non_blocking=True)
                         for h in self.units[unit])   # queued on the compute stream, as ExpertStore._fetch_sync
        if route != "ring":
            raise ValueError(f"unknown route {route!r}; allowed: {', '.join(self.ROUTES)}")
        self.calls += 1
        decoy, real = (self.calls, "decoy", unit), (self.calls, "real", unit)
        self.ring.schedule([decoy, real])
        self.ring.take(decoy)      # the slot holds the decoy; taking the weights next must copy over it
        return self.ring.take(real)
