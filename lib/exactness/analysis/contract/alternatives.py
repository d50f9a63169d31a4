"""The calls of a site that differ in an operand the pool's rows do not carry: which routed expert (its weights,
and ``expert_id`` for an expert-id-aware set) and, for offloaded experts, which expert a ring slot holds.

:func:`alternatives` lists a site's pools (cases.make_pool for the rows, then each expert's weights, or each of
attention's KV formats at site ``fp8``); the checker hands a case of M rows and KV length T the alternative
(M + floor(T / 2)) mod their count, so every expert and format is fed at many M while the number of cases stays
that of one pool (and the cases of one M share their rows' decode references). :func:`offloaded` moves a
site's expert pools behind one ring slot (ring.StagedWeights), which then holds another expert from one call to
the next, as offload's ring slots do.
"""
from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager

import torch

from ...config import get_preset
from .cases import KV_SITES, OFFLOAD_CLASSES, Pool, RandomInputs, _captured, _weights32, make_pool


_STAGED: dict | None = None   # within sharing_host_copies: the ids of a site's pools -> (the pools, their copies)


@contextmanager
def sharing_host_copies():
    """Within the block, :func:`offloaded` makes the host copies of the same pools (alternatives' cached ones) once
    and every set checked shares them; outside it, each call makes its own. Holds the pinned copies until the
    outermost block ends; a nested block shares the outer block's."""
    global _STAGED
    old = _STAGED
    _STAGED = {} if old is None else old
    try:
        yield
    finally:
        _STAGED = old


def offloaded(pools: list[Pool]) -> list[Pool]:
    """``pools`` (one site's alternatives: the routed experts) with their fixed weights in host memory, fetched for
    each call as offload fetches experts: through one ring slot (behind a decoy), so the slot holds a different
    expert from one case to the next, for prompt calls; synchronously for decode references (ring.StagedWeights;
    shared within :func:`sharing_host_copies`).

    Raises:
        ValueError: a pool not of an OFFLOAD_CLASSES class.
    """
    bad = [p.cls for p in pools if p.cls not in OFFLOAD_CLASSES]
    if bad:
        raise ValueError(f"offload moves the weights of {', '.join(OFFLOAD_CLASSES)} only, not {bad[0]!r}")
    from ...ring import StagedWeights
    shared = {} if _STAGED is None else _STAGED
    key = tuple(map(id, pools))
    if key not in shared:   # the pools are kept beside their copies, so their ids stay theirs
        shared[key] = (pools, StagedWeights(pools[0].fixed, tuple(p.fixed for p in pools[1:])))
    staged = shared[key][1]
    return [dataclasses.replace(p, stage=functools.partial(staged.fetch, unit=i)) for i, p in enumerate(pools)]


def _expert_weights(cls: str, source: str, dtype, device, preset: str, expert: int, weights: str,
                    groups=None) -> tuple:
    """Routed expert ``expert``'s weights of layer 0 as the class's pool holds them: (w_gate, w_up) [I, H] or
    (w_down [H, I],), from the captured forward's weights or cast (and quantized) as the random builders do."""
    names = ("w_gate", "w_up") if cls == "expert_gate_up" else ("w_down",)
    if source == "captured":
        lw = _captured(dtype, device, preset, weights, groups)[1].layers[0]
        return tuple(getattr(lw, n)[expert] for n in names)
    inp = RandomInputs(get_preset(preset), _weights32(preset), torch.Generator(), 0, 0, 0, dtype, device, "routed",
                       weights)
    return inp.weight(*(getattr(inp.layer0, n)[expert] for n in names))


def alternatives(cls: str, source: str, dtype, device: str, preset: str, site: str, weights: str = "bf16",
                 groups=None, experts: bool = False) -> list[Pool]:
    """The pools the checker rotates over at one site (module docstring): attention's KV formats of the site
    (KV_SITES), with ``experts`` every routed expert of the preset (expert classes, site ``routed``), else the
    site's one pool."""
    kw = dict(preset=preset, site=site, weights=weights, groups=groups)
    if cls == "attention":
        return [make_pool(cls, source, dtype, device, kv_dtype=k, **kw) for k in KV_SITES[site or "bf16"]]
    if cls in OFFLOAD_CLASSES:
        n = get_preset(preset).n_experts if experts and site == "routed" else 1
        return [expert_pool(cls, source, dtype, device, expert=e, **kw) for e in range(n)]
    return [make_pool(cls, source, dtype, device, **kw)]


@functools.lru_cache(maxsize=512)
def expert_pool(cls: str, source: str, dtype, device: str, preset: str, site: str, weights: str = "bf16",
                groups=None, expert: int = 0) -> Pool:
    """make_pool's pool of an expert class at ``site`` with routed expert ``expert``'s weights (expert 0's rows);
    ``note`` names the ``expert_id`` the forward passes (-1 at site ``shared``).

    Raises:
        ValueError: what make_pool raises, an expert outside the preset's or other than 0 at site ``shared``.
    """
    n = get_preset(preset).n_experts
    if not (isinstance(expert, int) and 0 <= expert < n) or (expert and site != "routed"):
        raise ValueError(f"expert {expert!r} is not allowed at site {site!r} of preset {preset!r}; allowed: "
                         + (f"0..{n - 1}" if site == "routed" else "0 (the shared expert)"))
    if expert:   # expert 0's rows, expert ``expert``'s weights
        base = make_pool(cls, source, dtype, device, preset, site, weights, groups)
        fixed = _expert_weights(cls, source, dtype, device, preset, expert, weights, groups)
        return dataclasses.replace(base, fixed=fixed, note={"expert_id": expert})
    return dataclasses.replace(make_pool(cls, source, dtype, device, preset, site, weights, groups),
                               note={"expert_id": 0 if site == "routed" else -1})
