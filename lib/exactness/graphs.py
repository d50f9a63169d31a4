"""CUDA graphs: a fixed-shape forward (a decode step, a drafted verify, an MTP head's rows) captured once per
shape and replayed for every later call of that shape.

A decode step launches many small kernels whose host launch time exceeds their GPU time; a CUDA graph records
them once and replays them with one call. The graph reads static device tensors (input tokens, positions and slots
[N] int64, the MTP head's hidden rows [N, H], the KV cache's tensors), so each call copies its inputs into them and
replays; the host keeps the cache's lengths. The kernels, their shapes and their order are those of the eager
forward (model.forward, or mtp.MTPHead.forward, on the same plan), so a replay writes the bytes the eager forward
writes, which tests/test_cuda_graphs.py checks as bytes. GraphDecoder serves the decode steps of B streams (one row
each); a drafted run (mtp.generate_drafted) keeps one GraphForward per shape it meets more than once
(stream_forwards.StreamForwards): its verify of k+1 rows of one stream on the batched plan, its plain decode steps,
and the head's one-row and catch-up forwards.

Two parts of a forward cannot always be recorded as they are, and are handled so that the bytes stay the eager ones:

    attention  a kernel whose launch depends on the position (the per-row SDPA fallback over keys 0..p) or that
               reads positions on the host (over an fp8 cache) runs eagerly between graph pieces, writing a static
               buffer the next piece reads. A kernel whose ``captures(k_cache, rows)`` says it reads slots and
               positions on the device with a fixed launch is captured: the invariant set's Triton kernel on a
               model-dtype cache (kernels/cuda.py), and the fast set's FlashAttention on CUDA bf16
               (kernels/fast_cuda.py: decode rows, and prompt calls of a few rows such as a verify).
    experts    a set without a grouped expert kernel (the fast set off CUDA bf16) runs one GEMM chain per routed
               expert, chosen on the host. For one row the graph gathers the k experts' weights by the device-side
               ids and runs the same per-expert kernels on the same [1, H] row (the eager bytes, at the cost of
               copying k experts' weights per layer); with more rows the member counts vary: not captured.

Kernel taps (model.tapping): a forward that an active recorder asks for (model.taps_want) runs eagerly, so every
call reaches it; one that no recorder asks for replays untapped. Tapped forwards run each routed expert's kernels
(model.moe_block) and each class's kernel (no fused options), so a one-row graph made while taps are active gathers
the experts (as a set without a grouped kernel does) and runs without the set's fused options, and a forward of more
rows is not captured: replays and tapped forwards write the same bytes.

Where a graph cannot serve (no CUDA device, taps started or ended after the graph was made, an expert provider
other than the resident weights, quantized or expert-id-aware experts, an exception during capture) the forward
runs eagerly and records why (GraphForward.info).
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import torch

from .cache import KVCache
from .expert_providers import ExpertProvider, ResidentExperts
from .kernels import KernelSet, get_set
from .model import _TAPS, DECODE, FUSED_OPTIONS, ForwardOut, Ops, Plan, forward, run_rows, taps_want, untapped
from .weights import Weights


class Head(Protocol):
    """What a head's forwards need of mtp.MTPHead (typed here so that graphs needs no import of mtp): its own
    one-layer cache, its weights ``m`` (``m.layer``), its eager forward and its body on given Ops."""

    cache: KVCache
    m: object

    def forward(self, tokens, hidden, positions, kernels, plan=DECODE, slot: int = 0) -> ForwardOut: ...

    def body(self, ops, tokens, positions, slots, hidden) -> ForwardOut: ...


def _host_indexed_attention() -> tuple:
    """Attention kernels that read slots and positions only through int(): given host tensors they need no device
    read (the fast set's per-row SDPA)."""
    from .kernels import attention
    return (attention.attention_fast_decode,)


def why_not(w: Weights, kernels: KernelSet | str, batch: int = 1, experts: ExpertProvider | None = None, *,
            rows: int = 1, layers: list | None = None) -> str | None:
    """Why a forward of ``batch`` streams with ``rows`` rows each cannot be captured (None: it can be tried).

    ``layers``: the layers the forward runs (default w.layers; the MTP head passes its own block's).
    Raises:
        ValueError: batch or rows is not a positive int.
    """
    for name, n in (("batch", batch), ("rows", rows)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    ks = get_set(kernels)
    if w.device.type != "cuda":
        return f"CUDA graphs need a CUDA device; the weights are on {w.device}"
    if _TAPS and batch * rows > 1:
        return "kernel taps are active: a forward of several rows runs its experts one by one, chosen on the host"
    if experts is not None and type(experts) is not ResidentExperts:
        return f"experts come from {type(experts).__name__}, which stages them on the host per call"
    if not all(torch.is_tensor(lw.w_gate) for lw in (w.layers if layers is None else layers)):
        return "quantized expert weights: the experts run a per-expert loop chosen on the host"
    if ks.options.expert_id_aware:
        return f"set {ks.name!r} picks expert kernels by expert id on the host"
    if ks.options.grouped_experts is None and batch * rows > 1:
        many = f"{batch} streams" if batch > 1 else f"{rows} rows of one stream (a drafted verify or MTP catch-up)"
        return (f"set {ks.name!r} runs one kernel chain per routed expert over its member rows; with {many} the "
                "member counts (GEMM shapes) depend on the routing")
    return None


def attention_in_graph(attn, k_cache: torch.Tensor, rows: int) -> bool:
    """Whether a CUDA graph can hold a call of attention kernel ``attn`` over ``rows`` rows of a cache whose keys
    are ``k_cache``: only where the kernel carries ``captures(k_cache, rows)`` and it says so (module docstring)."""
    captures = getattr(attn, "captures", None)
    return captures is not None and bool(captures(k_cache, rows))


def _gathered_experts(ks: KernelSet, role: str):
    """A grouped_experts option for a one-row forward of a set without one: y [1, k, H] from the set's expert
    kernels of ``role`` on the row h [1, H], with each expert's weights gathered by the device-side ids idx [1, k]."""
    gate_up, down = ks.fn("expert_gate_up", role), ks.fn("expert_down", role)

    def grouped(h, idx, w_gate, w_up, w_down):
        e = idx[0]                                                                   # [k] int64, device
        g, u, d = w_gate[e], w_up[e], w_down[e]                                      # [k, I, H], [k, I, H], [k, H, I]
        return torch.stack([down(gate_up(h, g[j], u[j]), d[j]) for j in range(e.shape[0])], dim=1)
    return grouped


class _Eager:
    """An attention call between graph pieces: out.copy_(fn(*args)) at replay."""

    def __init__(self, fn, args: tuple, out: torch.Tensor):
        self.fn, self.args, self.out = fn, args, out

    def replay(self) -> None:
        self.out.copy_(self.fn(*self.args))


class Capture:
    """Graph pieces captured into one memory pool, cut where ``cut`` is called."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.pieces: list = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        g, self.graph = self.graph, None
        g.capture_end()
        self.pieces.append(g)

    def cut(self, fn, args: tuple, like: torch.Tensor) -> torch.Tensor:
        """End the current piece, record fn(*args) to run eagerly into a static buffer shaped like ``like``, begin
        the next piece; returns the buffer."""
        self.end()
        out = torch.empty_like(like)
        self.pieces.append(_Eager(fn, args, out))
        self.begin()
        return out

    def abort(self) -> None:
        if self.graph is not None:
            try:
                self.graph.capture_end()
            except Exception:   # an invalidated capture cannot end cleanly; the graph is dropped either way
                pass
            self.graph = None


class GraphForward:
    """Forwards of one fixed shape (``batch`` streams x ``rows`` rows on ``plan``) over one cache, replayed from a
    CUDA graph (module docstring): a drafted run's verify (k+1 rows, batched plan), an MTP head's rows, or a
    decode step (GraphDecoder).

    The first call runs eagerly (it warms every kernel up) and then captures; later calls replay. Where a graph
    cannot serve, every call runs the eager forward (model.forward, or the head's MTPHead.forward), and ``reason``
    says why.

    Args:
        w: weights; cache: the KV cache the forwards write (its tensors are the graph's, so keep using this one;
            the head's own cache when ``head`` is given); kernels: the kernel set; batch: streams (one slot each);
        rows: rows per stream; plan: the forward's plan (model.DECODE, BATCHED; a deep plan on a few rows is the
            batched one); experts: the main model's expert provider (None: resident);
        head: an mtp.MTPHead whose block runs instead of the main model (one stream; its forwards take hidden rows
            [N, H]; ``cache`` must be the head's own).
    Raises:
        ValueError: batch or rows is not a positive int; a head with more than one stream or another cache.
    """

    def __init__(self, w: Weights, cache: KVCache, kernels: KernelSet | str, *, batch: int = 1, rows: int = 1,
                 plan: Plan = DECODE, experts: ExpertProvider | None = None, head: Head | None = None):
        if head is not None and (cache is not head.cache or batch != 1):
            raise ValueError("an MTP head's forwards run one stream over the head's own cache (head.cache); got "
                             f"batch={batch!r} and {'its' if cache is head.cache else 'another'} cache")
        self.w, self.cache, self.ks, self.plan = w, cache, get_set(kernels), plan
        self.experts, self.head = experts, head
        self.reason = why_not(w, self.ks, batch, experts, rows=rows, layers=None if head is None else [head.m.layer])
        self.n, self.batch = batch * rows, batch
        self.replays, self.eager_steps, self.tapped_steps, self.pieces, self._out = 0, 0, 0, None, None
        self.tapped = bool(_TAPS)       # made under taps: its experts are the tapped forward's (module docstring)
        if self.reason is None:
            dev, i64, n = w.device, torch.int64, self.n
            self.tokens, self.positions, self.slots = (torch.zeros(n, dtype=i64, device=dev) for _ in range(3))
            self.hidden = None if head is None else torch.zeros(n, w.cfg.hidden, dtype=w.dtype, device=dev)
            self.host_positions, self.host_slots = torch.zeros(n, dtype=i64), torch.zeros(n, dtype=i64)
            opts = self.ks.options
            if opts.grouped_experts is None or self.tapped:
                opts = dataclasses.replace(opts, grouped_experts=_gathered_experts(self.ks, plan.role))
            if self.tapped:   # the tapped forward runs each class's kernel, not a set's fused options
                opts = opts.without(*FUSED_OPTIONS)
            self._set = dataclasses.replace(self.ks, options=opts)
            self._attn = attn = self.ks.fn("attention", plan.role)
            self._attn_in_graph = attention_in_graph(attn, cache.k[0], self.n)
            self._attn_host = attn in _host_indexed_attention()

    def info(self) -> dict:
        """{"served": any call replayed, "replays", "eager_steps" (tapped ones included), "pieces": graph pieces +
        eager attention calls per call (0 before capture), "reason": why a graph did not serve (None when it did)}
        and, where taps asked for forwards, "tapped_steps"."""
        reason = self.reason
        if reason is None and self.tapped_steps and self.tapped_steps == self.eager_steps and not self.replays:
            reason = "kernel taps asked for every forward: each ran eagerly"
        return {"served": self.replays > 0, "replays": self.replays, "eager_steps": self.eager_steps,
                "pieces": len(self.pieces or ()), "reason": reason,
                **({"tapped_steps": self.tapped_steps} if self.tapped_steps else {})}

    def run(self, tokens: torch.Tensor, positions: Sequence[int], slots: Sequence[int],
            hidden: torch.Tensor | None = None) -> ForwardOut:
        """One forward: tokens [N] int64 (device) at host ``positions`` of cache ``slots`` (N = batch x rows;
        hidden [N, H]: the head's input rows) -> ForwardOut(logits [N, V] fp32, hidden [N, H]), the cache's lengths
        advanced.

        Raises:
            ValueError: wrong lengths, hidden given or missing, or a position or slot outside the cache's.
        """
        positions, slots = [int(p) for p in positions], [int(s) for s in slots]
        n = self.n
        if tokens.shape != (n,) or len(positions) != n or len(slots) != n:
            raise ValueError(f"a forward of {n} rows needs tokens [{n}], {n} positions and slots; got "
                             f"{tuple(tokens.shape)}, {len(positions)}, {len(slots)}")
        if (hidden is None) != (self.head is None):
            raise ValueError("hidden rows [N, H] go with an MTP head's forward, and only with it")
        if min(positions) < 0 or max(positions) >= self.cache.capacity:
            raise ValueError(f"positions {min(positions)}..{max(positions)} outside the cache capacity "
                             f"0..{self.cache.capacity - 1}")
        if min(slots) < 0 or max(slots) >= len(self.cache.lengths):
            raise ValueError(f"slots {min(slots)}..{max(slots)} outside the cache's slots "
                             f"0..{len(self.cache.lengths) - 1}")
        if self.reason is None and bool(_TAPS) != self.tapped:
            self.reason = ("kernel taps started or ended after the graph was made: its expert route is not the "
                           "eager forward's")
        if self.reason is not None or (_TAPS and taps_want(positions)):
            self.eager_steps += 1
            self.tapped_steps += bool(_TAPS)
            return self._eager(tokens, positions, slots, hidden)
        with untapped():               # no recorder asked for this forward (none sees a replay either)
            self._load(tokens, positions, slots, hidden)
            if self.pieces is None:
                out = self._warm_and_capture()
                self.eager_steps += 1
            else:
                for p in self.pieces:
                    p.replay()
                out = ForwardOut(self._out.logits.clone(), self._out.hidden.clone())
                self.replays += 1
        self.cache.advance(self.host_slots, self.host_positions)
        return out

    def _eager(self, tokens, positions, slots, hidden) -> ForwardOut:
        pos = torch.tensor(positions, device=self.w.device)
        if self.head is not None:
            return self.head.forward(tokens, hidden, pos, self.ks, self.plan, slot=slots[0])
        slot = torch.tensor(slots, device=pos.device)
        return forward(self.w, tokens, pos, self.cache, self.ks, self.plan, slots=slot, experts=self.experts)

    def _load(self, tokens: torch.Tensor, positions: list[int], slots: list[int], hidden) -> None:
        self.tokens.copy_(tokens)
        if hidden is not None:
            self.hidden.copy_(hidden)
        if self.n == 1:                              # fill_: the value travels as a launch argument, no copy
            self.positions.fill_(positions[0])
            if int(self.host_slots[0]) != slots[0] or self.pieces is None:
                self.slots.fill_(slots[0])
        else:
            self.positions.copy_(torch.tensor(positions))
            self.slots.copy_(torch.tensor(slots))
        self.host_positions[:] = torch.tensor(positions)
        self.host_slots[:] = torch.tensor(slots)

    def _forward(self, cap: Capture | None) -> ForwardOut:
        """The forward on the static inputs; attention cut out of the capture where it must run eagerly."""
        ops = Ops(self._set, self.plan)
        ops.positions = self.positions
        if not self._attn_in_graph:
            ops.attention = lambda q, k, v, s, p: self._attention(cap, q, k, v, s, p)
        if self.head is not None:
            return self.head.body(ops, self.tokens, self.positions, self.slots, self.hidden)
        experts = ResidentExperts(self.w.layers)
        return run_rows(self.w, ops, self.tokens, self.positions, self.slots, self.cache, experts)

    def _attention(self, cap, q, k_cache, v_cache, slots, positions):
        if self._attn_host:
            slots, positions = self.host_slots, self.host_positions
        if cap is None:
            return self._attn(q, k_cache, v_cache, slots, positions)
        return cap.cut(self._attn, (q, k_cache, v_cache, slots, positions), q)

    def _warm_and_capture(self) -> ForwardOut:
        """Run this call eagerly (every kernel warmed up, the library handles of the capture stream made), then
        capture it on the same side stream. -> this call's ForwardOut."""
        dev = self.w.device
        main, side = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)
        side.wait_stream(main)
        cap = Capture()
        with torch.cuda.stream(side):
            out = self._forward(None)
            torch.cuda.synchronize(dev)
            try:
                cap.begin()
                graph_out = self._forward(cap)
                cap.end()
                self.pieces, self._out = cap.pieces, graph_out
            except Exception as e:  # whatever the kernels raise under capture: the eager calls serve instead
                cap.abort()
                self.reason = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                torch.cuda.synchronize(dev)
        main.wait_stream(side)
        for t in out.logits, out.hidden:
            t.record_stream(main)
        return out


class GraphDecoder(GraphForward):
    """Decode steps of ``batch`` streams over one cache (one row per stream, the decode plan), replayed from a
    CUDA graph: GraphForward with ``step`` returning the logits.

    Raises:
        ValueError: batch is not a positive int.
    """

    def __init__(self, w: Weights, cache: KVCache, kernels: KernelSet | str, *, batch: int = 1,
                 experts: ExpertProvider | None = None):
        super().__init__(w, cache, kernels, batch=batch, experts=experts)

    def step(self, tokens: torch.Tensor, positions: Sequence[int], slots: Sequence[int]) -> torch.Tensor:
        """One decode step: tokens [B] int64 (device) at host ``positions`` of cache ``slots`` -> logits [B, V]
        fp32.

        Raises:
            ValueError: wrong lengths, or a position or slot outside the cache's.
        """
        return self.run(tokens, positions, slots).logits
