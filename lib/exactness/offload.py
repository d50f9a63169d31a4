"""Expert offload: routed experts kept in (pinned) host memory and staged through a ring of device buffers.

An :class:`ExpertStore` is an expert provider (expert_providers.ExpertProvider) for
``model.forward(..., experts=store)``: ``store.fetch(layer, e) -> (w_gate [I, H], w_up [I, H], w_down [H, I])`` on
the compute device.

    resident  every expert stays on the device; the provider returns views of the stacked weights (no copy).
    offload   the experts of every layer live in host memory (pinned when the device is CUDA) and the Weights
              handed to forward (``store.weights``) hold only the non-expert tensors on the device (the expert
              fields are empty ``[0, ...]`` placeholders: a forward without the provider raises IndexError).
              Experts reach the device two ways:
              * ring: for the deep plan, ``store.prepare(layer, expert_ids, plan)`` announces the experts that have
                members in this MoE call (ascending ids, the order moe_block computes them). Up to ``ring_slots``
                experts are copied host->device on a separate copy stream ahead of use, so that copying expert e'
                overlaps computing expert e. CUDA events order each compute after its copy and each copy after
                the previous use of its slot. When the announced list runs out, the ring speculatively copies the
                next experts in (layer, id) order (the next layer's first experts), so the copies also overlap
                attention.
              * layer: for the deep plan of a set that computes all of a layer's routed experts in one launch
                (the kernel-set option ``grouped_experts``, asked first whether it serves the layer's shapes),
                ``store.stacked(layer, plan, idx, accept)`` hands it the whole
                layer (w_gate [E, I, H], w_up [E, I, H], w_down [E, H, I]) from a second ring of ``layer_slots``
                layer-sized buffers (default 2 on CUDA, 0 elsewhere). Taking layer L issues the copy of layer
                L + 1 (after the last layer: layer 0, for the next segment), which then overlaps layer L's experts
                and layer L + 1's attention; each (layer, expert) crosses the bus once per deep segment. The
                copy is issued before layer L + 1's router runs, so it moves every expert of the layer, not only
                the routed ones (a deep segment of >= 512 rows routes to nearly all of them). A layer ring that
                cannot be reserved is recorded in ``layer_ring_reason``; the expert ring then serves.
              * sync: batched/decode plans, calls that were not announced, and stores without a ring fetch the
                expert into fresh device tensors on the compute stream, ahead of the kernels that read them (the
                batched pass "fetches each expert"; the host queues the copy and goes on).
              On CPU the "device" and the "host" are the same memory: copies are plain synchronous ``copy_`` and
              no streams or events exist; every other line of the ring runs as on CUDA.

Copies move bytes unchanged, so offload cannot change a result: tests/test_offload.py compares prompt logits,
tokens and KV bytes of offload against resident runs (and catches a one-ulp perturbation of the host copy).

If the ring cannot be reserved (``torch.cuda.OutOfMemoryError``, or ``max_ring_bytes`` below what it needs), the
store records why in ``fallback_reason`` and sets ``deep_ready = False``; paths.prefill then serves deep segments
with the batched pass and records ``served["fallback"]``.
"""
from __future__ import annotations

from dataclasses import fields

import torch

from .ring import ExpertRing, host_copy, ring_counters
from .weights import LayerWeights, Weights

MODES = ("resident", "offload")
EXPERT_FIELDS = ("w_gate", "w_up", "w_down")


def _strip_experts(w: Weights, device: torch.device) -> Weights:
    """A Weights copy on ``device`` whose expert fields are empty ``[0, I, H]`` / ``[0, H, I]`` placeholders (no
    bytes; indexing an expert raises IndexError, so a forward without the provider fails loudly). The experts
    themselves are not copied to the device."""
    def layer(lw: LayerWeights) -> LayerWeights:
        out = {}
        for f in fields(lw):
            t = getattr(lw, f.name)
            if t is None:
                out[f.name] = None
            elif f.name in EXPERT_FIELDS:
                out[f.name] = torch.empty((0, *t.shape[1:]), dtype=t.dtype, device=device)  # [0, ., .]
            else:
                out[f.name] = t.to(device)
        return LayerWeights(**out)
    extra = {k: v.to(device) for k, v in getattr(w, "extra", {}).items()}  # e.g. a checkpoint's MTP tensors
    return Weights(cfg=w.cfg, embed=w.embed.to(device), layers=[layer(lw) for lw in w.layers],
                   final_norm=w.final_norm.to(device), lm_head=w.lm_head.to(device), extra=extra)


class ExpertStore:
    """The expert provider (expert_providers.ExpertProvider) of a model, resident or offloaded (the module
    docstring).

    Args:
        weights: the model's weights, on any device (pass CPU weights in offload mode so that the experts never
            occupy the device).
        mode: ``"resident"`` or ``"offload"``.
        ring_slots: device buffers of the ring (offload mode), each one expert (3·I·H elements).
        device: compute device (default: the weights' device).
        max_ring_bytes: refuse to reserve rings larger than this many bytes together (None: no limit); the
            expert ring is reserved first, the layer ring only where both fit.
        speculate: copy the next (layer, id) experts (the layer ring: the next layer) ahead once the announced
            ones are issued.
        layer_slots: buffers of the layer ring (offload mode), each one layer's experts (3·E·I·H elements);
            None: 2 on a CUDA device, 0 (no layer ring) elsewhere.
    Attributes:
        weights: the Weights to hand to ``model.forward`` / ``paths.generate`` with ``experts=store``.
        deep_ready: False when offloaded without a ring (the deep plan must fall back to the batched pass).
        fallback_reason: why there is no ring (None when there is one or in resident mode).
        layer_ring: the layer ring (an ExpertRing keyed by layer), or None; layer_slots: its buffers asked for.
        layer_ring_reason: why there is no layer ring although layer_slots asked for one (None otherwise).
        stats: the expert ring's and the synchronous fetches' counters (fetches by route, copies, speculative hits,
            bytes moved host->device); layer_stats: the layer ring's; ``info()`` reports both, bytes summed.
        touched: the (layer, expert) keys asked for since the last reset_stats.
    Raises:
        ValueError: unknown mode, ring_slots < 1, max_ring_bytes < 0, layer_slots not None or an int >= 0.
    """

    def __init__(self, weights: Weights, mode: str = "resident", ring_slots: int = 4,
                 device: str | torch.device | None = None, max_ring_bytes: int | None = None,
                 speculate: bool = True, layer_slots: int | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown expert store mode {mode!r}; allowed: {', '.join(MODES)}")
        if not isinstance(ring_slots, int) or ring_slots < 1:
            raise ValueError(f"ring_slots must be an int >= 1, got {ring_slots!r}")
        if max_ring_bytes is not None and max_ring_bytes < 0:
            raise ValueError(f"max_ring_bytes must be >= 0 or None, got {max_ring_bytes!r}")
        if layer_slots is not None and (not isinstance(layer_slots, int) or layer_slots < 0):
            raise ValueError(f"layer_slots must be None or an int >= 0, got {layer_slots!r}")
        self.mode, self.ring_slots, self.cfg = mode, ring_slots, weights.cfg
        self.device = torch.device(device) if device is not None else weights.device
        self.stats, self.touched = ring_counters(), set()  # touched: (layer, expert) keys asked for
        self.layer_stats = ring_counters()
        self.plan, self.ring, self.fallback_reason = None, None, None
        self.layer_ring, self.layer_ring_reason = None, None
        self.layer_slots = (2 if self.device.type == "cuda" else 0) if layer_slots is None else layer_slots
        lw0 = weights.layers[0]
        self.shapes = tuple(tuple(getattr(lw0, f).shape[1:]) for f in EXPERT_FIELDS)
        self.expert_bytes = sum(getattr(lw0, f)[0].nbytes for f in EXPERT_FIELDS)  # one expert's three matrices
        if mode == "resident":
            self.weights, self.host = weights.to(device=self.device), None
            self.device_bytes_saved = 0
            return
        pin = self.device.type == "cuda"
        self.host = [tuple(host_copy(getattr(lw, f), pin) for f in EXPERT_FIELDS) for lw in weights.layers]
        self.weights = _strip_experts(weights, self.device)
        self.device_bytes_saved = sum(t.nbytes for layer in self.host for t in layer)
        self._reserve_ring(max_ring_bytes, speculate, lw0.w_gate.dtype)
        if self.ring is not None and self.layer_slots:
            self._reserve_layer_ring(max_ring_bytes, speculate, lw0.w_gate.dtype)

    def _reserve_ring(self, max_ring_bytes, speculate: bool, dtype) -> None:
        needed = self.ring_slots * self.expert_bytes
        if max_ring_bytes is not None and needed > max_ring_bytes:
            self.fallback_reason = (f"the expert ring needs {needed} bytes ({self.ring_slots} slots x "
                                    f"{self.expert_bytes}) > max_ring_bytes={max_ring_bytes}")
            return
        try:
            self.ring = ExpertRing(self.shapes, dtype, self.device, self.ring_slots, self._source,
                                   self._successor if speculate else None, self.stats)
        except torch.cuda.OutOfMemoryError as e:  # the same class as torch.OutOfMemoryError
            self.fallback_reason = f"device out of memory reserving the expert ring ({needed} bytes): {e}"

    def _reserve_layer_ring(self, max_ring_bytes, speculate: bool, dtype) -> None:
        layer_bytes = sum(t.nbytes for t in self.host[0])
        needed = self.layer_slots * layer_bytes
        if max_ring_bytes is not None and self.ring.nbytes + needed > max_ring_bytes:
            self.layer_ring_reason = (f"the layer ring needs {needed} bytes ({self.layer_slots} slots x "
                                      f"{layer_bytes}) beside the expert ring's {self.ring.nbytes} > "
                                      f"max_ring_bytes={max_ring_bytes}")
            return
        shapes = tuple(tuple(t.shape) for t in self.host[0])
        try:
            self.layer_ring = ExpertRing(shapes, dtype, self.device, self.layer_slots, self.host.__getitem__,
                                         (lambda L: (L + 1) % self.cfg.n_layers) if speculate else None,
                                         self.layer_stats)
        except torch.cuda.OutOfMemoryError as e:
            self.layer_ring_reason = f"device out of memory reserving the layer ring ({needed} bytes): {e}"

    @property
    def deep_ready(self) -> bool:
        """True unless the experts are offloaded and the ring could not be reserved."""
        return self.mode == "resident" or self.ring is not None

    @property
    def ring_bytes(self) -> int:
        """Device bytes the rings reserve, the expert ring and the layer ring together (0 without a ring)."""
        return sum(r.nbytes for r in (self.ring, self.layer_ring) if r is not None)

    def _source(self, key) -> tuple:
        layer, e = key
        return tuple(t[e] for t in self.host[layer])

    def _successor(self, key):
        layer, e = key
        if e + 1 < self.cfg.n_experts:
            return layer, e + 1
        return ((layer + 1) % self.cfg.n_layers, 0)

    def prepare(self, layer: int, expert_ids: list[int], plan: str) -> None:
        """Announce the experts (ascending ids with members) that moe_block will ask for next, and the plan kind
        (``"decode"``, ``"batched"``, ``"deep"``) of the forward; only the deep plan stages through the ring."""
        self.stats["prepare_calls"] += 1
        self.plan = plan
        if self.ring is None:
            return
        if plan == "deep":
            self.ring.schedule([(layer, int(e)) for e in expert_ids])
        else:
            self.ring.clear()

    def fetch(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_gate [I, H], w_up [I, H], w_down [H, I]) of expert ``e`` of ``layer`` on the compute device
        (storage dtype). Raises IndexError for a layer or expert id out of range."""
        if not (0 <= layer < self.cfg.n_layers and 0 <= e < self.cfg.n_experts):
            raise IndexError(f"expert ({layer}, {e}) outside layers 0..{self.cfg.n_layers - 1}, "
                             f"experts 0..{self.cfg.n_experts - 1}")
        self.touched.add((layer, e))
        if self.host is None:
            self.stats["resident_fetches"] += 1
            lw = self.weights.layers[layer]
            return lw.w_gate[e], lw.w_up[e], lw.w_down[e]
        if self.ring is not None and self.plan == "deep":
            bufs = self.ring.take((layer, e))
            if bufs is not None:
                return bufs
            self.stats["unannounced_calls"] += 1
        return self._fetch_sync(layer, e)

    def stacked(self, layer: int, plan: str, idx: torch.Tensor, accept=None) -> tuple | None:
        """Every expert of ``layer`` stacked on the compute device (w_gate [E, I, H], w_up [E, I, H], w_down
        [E, H, I], storage dtype) for a set that computes all routed experts in one launch, from the layer ring on
        the deep plan (the compute stream waits for the copy); None elsewhere (resident mode, other plans, no layer
        ring, or ``accept(w_gate, w_up, w_down)`` false for the host copies: that launch would not serve them), and
        the caller then announces and fetches expert by expert. ``idx`` [M, k] int64, the routed ids, is recorded in
        ``touched``.

        Raises:
            IndexError: layer outside 0..n_layers-1.
        """
        if not 0 <= layer < self.cfg.n_layers:
            raise IndexError(f"layer {layer} outside layers 0..{self.cfg.n_layers - 1}")
        if self.layer_ring is None or plan != "deep" or (accept is not None and not accept(*self.host[layer])):
            return None
        # one device read per layer: a store is never captured in a CUDA graph, and the copies take far longer
        self.touched.update((layer, int(e)) for e in torch.unique(idx).tolist())
        self.layer_ring.schedule([layer])
        return self.layer_ring.take(layer)

    def _fetch_sync(self, layer: int, e: int) -> tuple:
        src = self._source((layer, e))
        # pinned host memory the store never writes: the copy queues on the compute stream, ahead of the kernels
        # that read it, and the host goes on
        out = tuple(torch.empty(s.shape, dtype=s.dtype, device=self.device).copy_(s, non_blocking=True) for s in src)
        self.stats["sync_fetches"] += 1
        self.stats["bytes_moved"] += sum(t.nbytes for t in src)
        return out

    def reset_stats(self) -> None:
        """Zero the counters and forget the experts touched (e.g. between timed runs)."""
        self.stats.update(ring_counters())
        self.layer_stats.update(ring_counters())
        self.touched.clear()

    def info(self) -> dict:
        """JSON-ready summary: mode, ring slots and bytes (both rings), the layer ring's slots and why it is
        missing, device bytes saved, deep_ready, fallback_reason, one expert's bytes, and the counters
        (``layer_fetches``, ``layer_copies``: the layer ring's; ``bytes_moved``: both rings' and the
        synchronous fetches')."""
        ls = self.layer_stats
        return {"mode": self.mode, "ring_slots": self.ring_slots if self.ring is not None else 0,
                "ring_bytes": self.ring_bytes, "expert_bytes": self.expert_bytes,
                "layer_slots": self.layer_slots if self.layer_ring is not None else 0,
                "layer_ring_bytes": self.layer_ring.nbytes if self.layer_ring is not None else 0,
                "layer_ring_reason": self.layer_ring_reason,
                "device_bytes_saved": self.device_bytes_saved, "deep_ready": self.deep_ready,
                "fallback_reason": self.fallback_reason,
                "stats": {**self.stats, "unique_experts": len(self.touched), "layer_fetches": ls["ring_fetches"],
                          "layer_copies": ls["copies"], "bytes_moved": self.stats["bytes_moved"] + ls["bytes_moved"]}}

