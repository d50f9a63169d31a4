"""The one forward used by every path: (tokens, positions, slots, cache, kernel set, plan) -> logits.

A *plan* says how the rows of this call are computed: ``decode`` rows (one per stream and step) use the set's
decode kernels; ``batched`` and ``deep`` prompt rows use its prompt kernels. The deep plan additionally runs the dense
projections on fixed ``tile_rows``-row tiles and each expert over its member rows in ``expert_tile``-member tiles
(the deep prefill), one kernel call per tile; with an invariant kernel set none of this changes a byte. A set whose
options name ``tiles_in_kernels`` (True, or a predicate of the call's rows: its dense and expert kernels fix their
row tiles themselves, so a row's bytes do not depend on how many rows a call holds, or the set makes no such claim
and runs as an engine would) gets each call's rows whole instead: its kernels' own tiles replace the host loop.
While kernel calls are tapped, every set gets the host tiles (the taps record the deep plan's calls as tiles).

The routed experts' weights come from an *expert provider* (ExpertProvider): ResidentExperts by default, or
offload.ExpertStore, which keeps them in host memory and stages them through device buffers.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .cache import KVCache
from .kernels import KERNEL_CLASSES, KernelSet, get_set
from .kernels.cache_store import store as cache_store
from .expert_providers import ExpertProvider, ResidentExperts
from .weights import LayerWeights, Weights


@dataclass(frozen=True)
class Plan:
    """How one forward call computes its rows.

    Attributes:
        kind: ``"decode"``, ``"batched"`` or ``"deep"``.
        tile_rows: rows per dense tile on the deep plan (64).
        expert_tile: members per expert tile on the deep plan (64).
    """

    kind: str = "batched"
    tile_rows: int = 64
    expert_tile: int = 64

    @property
    def role(self) -> str:
        return "decode" if self.kind == "decode" else "prompt"


DECODE = Plan("decode")
BATCHED = Plan("batched")
DEEP = Plan("deep")


@dataclass
class ForwardOut:
    """logits [M, V] fp32 and the final hidden rows [M, H] (before the final RMSNorm; the MTP head reads them)."""

    logits: torch.Tensor
    hidden: torch.Tensor


_TAPS: list = []  # active tap recorders; empty (the default) means kernels are called unwrapped, at no cost


@contextmanager
def tapping(recorder):
    """Within the block, every kernel call of every forward is reported to ``recorder.record(**call)``.

    ``call`` holds: cls (kernel class), role, plan (decode/batched/deep), kernels (set name), layer (-1 = head),
    positions ([M] int64 of the forward's rows), args (the kernel's inputs as passed) and out (its output). The
    recorder decides what to keep (analysis/fp64/section.py keeps sampled rows only). A recorder with a method
    ``wants(positions)`` may decline a forward up front: a CUDA-graphed forward it declines replays untapped
    (graphs.GraphForward). Restores the previous state on exit.
    """
    _TAPS.append(recorder)
    try:
        yield recorder
    finally:
        _TAPS.remove(recorder)


def taps_want(positions) -> bool:
    """Whether an active recorder asks to see a forward of the rows at host ``positions`` (ints): its
    ``wants(positions)``, and every forward for a recorder without that method."""
    return any(getattr(r, "wants", None) is None or r.wants(positions) for r in _TAPS)


@contextmanager
def untapped():
    """Within the block no recorder sees a kernel call (graphs.GraphForward replays the forwards that no active
    recorder asked for); the recorders are back on exit."""
    saved = list(_TAPS)
    _TAPS.clear()
    try:
        yield
    finally:
        _TAPS[:] = saved


# The set options that run several classes' kernels in fewer calls (kernels.KernelOptions), in Ops' order.
FUSED_OPTIONS = ("qk_norm_rope", "dense_group", "residual_norm", "combine_residual_norm", "dense_residual_norm")


class Ops:
    """The kernel callables of one (set, plan), with the deep plan's tiling applied where it belongs.

    Every class of the set is an attribute named after it (``ops.router(...)``); a class that Ops wraps in a method
    of its name (``dense``: deep-plan tiling) keeps its kernel under ``_<class>`` for that method to call.
    """

    def __init__(self, kernels: KernelSet, plan: Plan):
        self.k, self.plan, role = kernels, plan, plan.role
        self.layer, self.positions = -1, None
        for cls in KERNEL_CLASSES:
            if cls in kernels.decode:   # a set registered before a class was added has no kernel of it
                attr = "_" + cls if callable(getattr(Ops, cls, None)) else cls
                setattr(self, attr, self._tap(cls, kernels.fn(cls, role)))
        self._qk, self._group, self._res, self._comb, self._dres = (
            _own_option(kernels, n, role) for n in FUSED_OPTIONS)

    def _tap(self, cls: str, fn):
        if not _TAPS:
            return fn

        def tapped(*args, **kw):   # kw: expert_id, for expert-id-aware sets (experts.by_expert)
            out = fn(*args, **kw)
            for rec in list(_TAPS):
                rec.record(cls=cls, role=self.plan.role, plan=self.plan.kind, kernels=self.k.name,
                           layer=self.layer, positions=self.positions, args=args, out=out)
            return out
        return tapped

    def dense(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w[N, K]^T; on the deep plan in tiles of ``tile_rows`` rows."""
        return self._tiled(self._dense, self.plan.tile_rows, x, w)

    def expert(self, x: torch.Tensor, wg, wu, wd, expert_id: int = -1) -> torch.Tensor:
        """One expert's SwiGLU on its member rows x [n, H] -> [n, H]; deep plan: ``expert_tile``-member tiles."""
        kw = {"expert_id": expert_id} if self.k.options.expert_id_aware else {}   # -1: the shared expert
        f = lambda t, *w: self.expert_down(self.expert_gate_up(t, w[0], w[1], **kw), w[2], **kw)  # noqa: E731
        return self._tiled(f, self.plan.expert_tile, x, wg, wu, wd)

    def dense_group(self, x: torch.Tensor, ws: tuple) -> tuple[torch.Tensor, ...]:
        """(self.dense(x, w) for w in ws): the set's dense_group option where it serves the call whole and no taps
        are on (same bytes, fewer launches), else one dense call per weight."""
        out = None
        if self._group is not None and not _TAPS and self._whole(x, self.plan.tile_rows):
            out = self._group(x, ws)
        return tuple(self.dense(x, w) for w in ws) if out is None else out

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, wq, wk, eps: float, positions: torch.Tensor,
                     theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rope(rmsnorm(q, wq)), rope(rmsnorm(k, wk))): the set's qk_norm_rope option where it serves and no taps
        are on (same bytes, fewer launches), else four kernel calls."""
        out = None if self._qk is None or _TAPS else self._qk(q, k, wq, wk, eps, positions, theta)
        if out is None:
            out = (self.rope(self.rmsnorm(q, wq, eps), positions, theta),
                   self.rope(self.rmsnorm(k, wk, eps), positions, theta))
        return out

    def qk_norm_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq, wk, eps: float,
                           positions: torch.Tensor, theta: float, cache: KVCache, layer: int,
                           slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qk_norm_rope's (q, k), with k and v written to the layer's cache at (slots, positions): in the option's
        launch where it takes a store (``stores_kv``; an unquantized cache, no taps), else by cache.write."""
        if self._qk is not None and getattr(self._qk, "stores_kv", False) and not _TAPS and not cache.format.quantized:
            out = self._qk(q, k, wq, wk, eps, positions, theta, store=(cache.k[layer], cache.v[layer], slots, v))
            if out is not None:
                return out
        q, k = self.qk_norm_rope(q, k, wq, wk, eps, positions, theta)
        cache.write(layer, slots, positions, k, v, store=cache_store)                # one launch on CUDA
        return q, k

    def residual_norm(self, a: torch.Tensor, b: torch.Tensor, w, eps: float) -> tuple[torch.Tensor, object]:
        """(a + b, rmsnorm(a + b, w, eps)) by the set's residual_norm option where it serves and no taps are on
        (same bytes, one launch); else (self.residual(a, b), None): the caller runs the norm where it belongs."""
        out = None if self._res is None or _TAPS else self._res(a, b, w, eps)
        return (self.residual(a, b), None) if out is None else out

    def dense_residual_norm(self, x: torch.Tensor, w, a: torch.Tensor, wn, eps: float
                            ) -> tuple[torch.Tensor, object]:
        """(a + dense(x, w), its rmsnorm by wn or None) by the set's dense_residual_norm option where it serves the
        call whole and no taps are on (same bytes, one launch); else dense, then residual_norm."""
        out = None
        if self._dres is not None and not _TAPS and self._whole(x, self.plan.tile_rows):
            out = self._dres(x, w, a, wn, eps)
        return self.residual_norm(a, self.dense(x, w), wn, eps) if out is None else out

    def combine_residual_norm(self, y: torch.Tensor, weights: torch.Tensor, shared, a: torch.Tensor, w,
                              eps: float) -> tuple[torch.Tensor, object]:
        """(a + moe_combine(y, weights, shared), its rmsnorm by w or None) by the set's combine_residual_norm option
        where it serves and no taps are on (same bytes, one launch); else moe_combine, then residual_norm."""
        out = None if self._comb is None or _TAPS else self._comb(y, weights, shared, a, w, eps)
        return self.residual_norm(a, self.moe_combine(y, weights, shared), w, eps) if out is None else out

    def _whole(self, x: torch.Tensor, tile: int) -> bool:
        """Whether a tiled class gets x's rows in one call (not the deep plan's host tiles)."""
        whole = self.k.options.tiles_in_kernels       # a bool, or a predicate of the call's rows x
        if callable(whole):
            whole = whole(x)
        return self.plan.kind != "deep" or x.shape[0] <= tile or bool(whole and not _TAPS)

    def _tiled(self, fn, tile: int, x: torch.Tensor, *w) -> torch.Tensor:
        if self._whole(x, tile):
            return fn(x, *w)
        return torch.cat([fn(x[i:i + tile], *w) for i in range(0, x.shape[0], tile)], dim=0)


def _own_option(ks: KernelSet, name: str, role: str):
    """The set's option ``name`` if it computes with the set's own kernels: every (class, kernel) of its
    ``stands_for`` is the set's kernel of that class for ``role`` (an option without one is taken as is)."""
    fn = getattr(ks.options, name)
    if fn is None or any(c not in ks.decode or ks.fn(c, role) is not f for c, f in getattr(fn, "stands_for", ())):
        return None
    return fn


def attention_block(ops: Ops, lw: LayerWeights, cfg, x, positions, slots, cache: KVCache, layer: int, h=None):
    """Pre-norm GQA block with per-head q/k RMSNorm and RoPE; writes this call's keys/values to the cache.

    ``h``: rmsnorm(x, attn_norm) where the previous block computed it with its residual (Ops.residual_norm), else
    None. Returns (x + attention, its rmsnorm by mlp_norm or None: see Ops.residual_norm)."""
    M = x.shape[0]
    h = ops.rmsnorm(x, lw.attn_norm, cfg.rms_eps) if h is None else h               # [M, H]
    q, k, v = ops.dense_group(h, (lw.wq, lw.wk, lw.wv))
    q = q.view(M, cfg.n_heads, cfg.head_dim)                                         # [M, Hq, D]
    k = k.view(M, cfg.n_kv_heads, cfg.head_dim)                                      # [M, Hkv, D]
    v = v.view(M, cfg.n_kv_heads, cfg.head_dim)
    q, k = ops.qk_norm_rope_store(q, k, v, lw.q_norm, lw.k_norm, cfg.rms_eps, positions, cfg.rope_theta, cache,
                                  layer, slots)
    o = ops.attention(q, cache.k[layer], cache.v[layer], slots, positions)          # [M, Hq, D]
    return ops.dense_residual_norm(o.reshape(M, -1), lw.wo, x, lw.mlp_norm, cfg.rms_eps)


def _experts_one_by_one(ops: Ops, cfg, h, idx, experts: ExpertProvider, layer: int) -> torch.Tensor:
    """y [M, k, H]: each expert with members, in ascending id, over its member rows (ops.expert)."""
    M, k = idx.shape
    y = h.new_zeros(M, k, cfg.hidden)                                                # [M, k, H]
    flat = idx.flatten()                                                             # [M*k], member = row*k + slot
    order = torch.sort(flat, stable=True).indices                                    # members grouped by expert
    rows = order // k                                                                # [M*k] each member's row
    counts = torch.bincount(flat.cpu(), minlength=cfg.n_experts).tolist()   # one device read per call
    experts.prepare(layer, [e for e, n in enumerate(counts) if n], ops.plan.kind)
    start, out = 0, y.view(M * k, -1)
    for e, n in enumerate(counts):
        if n == 0:
            continue
        members = slice(start, start + n)
        start += n
        wg, wu, wd = experts.fetch(layer, e)                                         # [I, H], [I, H], [H, I]
        out.index_copy_(0, order[members], ops.expert(h.index_select(0, rows[members]), wg, wu, wd, e))
    return y


def moe_block(ops: Ops, lw: LayerWeights, cfg, x, experts: ExpertProvider, layer: int, h=None, next_norm=None):
    """Router -> top-k -> experts grouped by expert (expert-parallel) -> combine in slot order -> residual.

    ``h``: rmsnorm(x, mlp_norm) if computed already (attention_block's), else None. Returns x + MoE(x) and, given
    ``next_norm`` (the next layer's attn_norm, or the final norm), its rmsnorm or None (Ops.residual_norm).

    The experts with members are announced to ``experts.prepare`` first (an offloaded provider stages them ahead of
    use), then each one's weights come from ``experts.fetch``, in ascending expert id. A set whose options name
    ``grouped_experts`` (same bytes as its expert kernels) computes all experts at once instead, on the stacked
    weights the provider's ``stacked`` hands over (resident, or an offloaded layer staged whole), unless kernel
    calls are being tapped.
    """
    k = cfg.top_k
    h = ops.rmsnorm(x, lw.mlp_norm, cfg.rms_eps) if h is None else h                 # [M, H]
    groups = () if cfg.router_groups is None else (cfg.router_groups,)               # group-limited routing
    weights, idx, _ = ops.router(h, lw.router, k, cfg.norm_topk_prob, *groups)      # [M, k], [M, k]
    y = None
    grouped = ops.k.options.grouped_experts     # the set's per-expert kernels' bytes, all experts at once
    stacked = getattr(experts, "stacked", None) if grouped is not None and not _TAPS else None
    serves = getattr(grouped, "serves", None)          # asked before a provider stages a layer for it
    accept = None if serves is None else (lambda *ws: serves(h, *ws))
    weights_all = stacked(layer, ops.plan.kind, idx, accept) if stacked is not None else None  # [E,I,H]x2, [E,H,I]
    if weights_all is not None:
        y = grouped(h, idx, *weights_all)                                            # [M, k, H] or None
    if y is None:
        y = _experts_one_by_one(ops, cfg, h, idx, experts, layer)
    shared = None
    if lw.shared_gate is not None:
        shared = ops.expert(h, lw.shared_gate, lw.shared_up, lw.shared_down)  # shared expert: expert kernels
    if next_norm is not None:
        return ops.combine_residual_norm(y, weights, shared, x, next_norm, cfg.rms_eps)
    return ops.residual(x, ops.moe_combine(y, weights, shared)), None


def forward(w: Weights, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
            kernels: KernelSet | str, plan: Plan = BATCHED, *, slots: torch.Tensor | None = None,
            experts: ExpertProvider | None = None) -> ForwardOut:
    """Run rows through the model and return their logits.

    Args:
        w: weights (storage dtype bf16 or fp32; device = compute device).
        tokens: [M] int64 token ids; positions: [M] int64 absolute positions (< cfg.max_positions).
        cache: KV cache; rows' keys/values are written at (slots, positions) before attention reads them.
        kernels: kernel set (or its name); plan: decode / batched / deep.
        slots: [M] int64 cache slots (default all 0).
        experts: where the routed experts' weights come from (default: ResidentExperts over ``w.layers``).
    Returns:
        ForwardOut(logits [M, V] fp32, hidden [M, H] storage dtype).
    Raises:
        ValueError: a position outside 0..min(cache capacity, max_positions)-1, or a slot outside the cache's.
    """
    slots = torch.zeros_like(positions) if slots is None else slots
    if positions.numel():
        lo, hi = torch.stack((positions, slots)).aminmax(dim=1)                      # one host read for both
        check_rows(cache, *torch.cat((lo, hi)).tolist())
    out = _run(w, tokens, positions, slots, cache, kernels, plan, experts)
    cache.advance(slots, positions)
    return out


def forward_span(w: Weights, tokens: torch.Tensor, start: int, cache: KVCache, kernels: KernelSet | str,
                 plan: Plan = BATCHED, *, slot: int = 0, experts: ExpertProvider | None = None) -> ForwardOut:
    """forward of rows ``tokens`` [M] int64 at positions start..start+M-1 of cache slot ``slot``, checked on the
    host: no read from the device, so a prompt's segments queue one after another without the device waiting for
    the host between them. Same bytes as forward with those positions and slots.

    Raises:
        ValueError: as forward, before anything runs.
    """
    M = tokens.numel()
    if M:
        check_rows(cache, start, slot, start + M - 1, slot)
    positions = torch.arange(start, start + M, device=tokens.device)
    out = _run(w, tokens, positions, torch.full_like(positions, slot), cache, kernels, plan, experts)
    if M:
        cache.lengths[slot] = max(cache.lengths[slot], start + M)
    return out


def check_rows(cache: KVCache, p_lo: int, s_lo: int, p_hi: int, s_hi: int) -> None:
    """Raise ValueError, naming them and what the cache holds, for rows at positions p_lo..p_hi or slots
    s_lo..s_hi that ``cache`` does not hold."""
    if p_hi >= cache.capacity or p_lo < 0:
        raise ValueError(f"positions {p_lo}..{p_hi} outside the cache capacity 0..{cache.capacity - 1} "
                         f"(model max_positions {cache.cfg.max_positions})")
    if s_hi >= len(cache.lengths) or s_lo < 0:
        raise ValueError(f"slots {s_lo}..{s_hi} outside the cache's slots 0..{len(cache.lengths) - 1}")


def _run(w: Weights, tokens, positions, slots, cache: KVCache, kernels, plan: Plan, experts) -> ForwardOut:
    """run_rows with the set's Ops for ``plan`` and the resident experts by default (forward's arguments)."""
    ops = Ops(get_set(kernels), plan)
    ops.positions = positions
    return run_rows(w, ops, tokens, positions, slots, cache, ResidentExperts(w.layers) if experts is None else experts)


def run_rows(w: Weights, ops: Ops, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             cache: KVCache, experts: ExpertProvider) -> ForwardOut:
    """forward's rows through the model with ``ops`` (forward's arguments, already checked): no host read of its
    own, and the cache's lengths left to the caller (graphs.GraphForward records the kernels it launches)."""
    cfg = w.cfg
    x, h = w.embed.index_select(0, tokens), None     # [M, H]; CUDA: a small-index gather, not advanced indexing
    for i, lw in enumerate(w.layers):
        ops.layer = i
        x, h = attention_block(ops, lw, cfg, x, positions, slots, cache, i, h)
        nxt = w.layers[i + 1].attn_norm if i + 1 < len(w.layers) else w.final_norm
        x, h = moe_block(ops, lw, cfg, x, experts, i, h, nxt)
    ops.layer = -1
    h = ops.rmsnorm(x, w.final_norm, cfg.rms_eps) if h is None else h
    return ForwardOut(ops.lm_head(h, w.lm_head), x)                                 # logits [M, V] fp32
