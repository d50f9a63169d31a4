"""Several batch-invariant GEMMs of one input in one launch (CUDA): ``linear_group(x, ws)`` gives each weight the
bytes of ``triton_gemm.linear(x, w)``.

Where every weight's launch for the call's row count runs split-K in parallel programs (triton_split.takes_split)
with one config (SHARED: tile rows, BLOCK_K, tile order, TMA, warps, stages) except the tile columns and split_k
(OWN), of which at most one weight has its own (it goes first), one launch runs the programs of _gemm_split_kernel
for every weight side by side, with each weight's own arithmetic: each tile's last split adds its partials (a
second launch does, where triton_split.split_counts does not serve). A decode step's queries, keys and values then
take one launch instead of three. Anything else (other launches, large calls) is not served: the caller runs
linear() per weight.
"""
from __future__ import annotations

import torch

from . import triton_gemm as tg
from . import triton_split as ts
from .triton_rows import INTERPRET, cdiv, intern_key, launch
from .triton_tiles import _gemm_split_group_kernel, _split_reduce_group_kernel

MAX_WEIGHTS = 3
SHARED = ("block_m", "block_k", "group_m", "tma", "num_warps", "num_stages")   # GemmConfig fields one for a group
OWN = ("block_n", "split_k")  # the fields a weight of a group may have its own of (_order)
MIXED = True                # one weight of a group may have its own (False: one (tile columns, split_k) per group)
_KEYS: dict[tuple, tuple[int, int]] = {}


def _launch_of(x: torch.Tensor, w: torch.Tensor):
    """(plan, launch for x's rows, group key) of one weight; the key (its config's SHARED fields and whether it
    loads through TMA) is None where it cannot join a group."""
    if not torch.is_tensor(w) or w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype != x.dtype or \
            w.device != x.device:
        return None, None, None
    p = tg.plan_for(x, (w,), "linear", None)
    M = x.shape[0]
    lp = next(lp for rows, lp in p.launches if M <= rows)
    if M == 0 or p.N == 0 or p.K == 0 or not ts.takes_split(lp, M, p.N):
        return p, lp, None
    return p, lp, (tuple(getattr(lp.cfg, f) for f in SHARED), lp.use_tma)


def _own(lp) -> tuple:
    """A launch's (tile columns, split_k), which a weight of a group may have its own of."""
    return tuple(getattr(lp.cfg, f) for f in OWN)


def _order(lps: list) -> list[int] | None:
    """The members' launch order for one grouped launch: all of one (tile columns, split_k), or (MIXED) every
    weight but one of one, that one first; None where neither holds."""
    own = [_own(lp) for lp in lps]
    lone = [i for i, o in enumerate(own) if own.count(o) == 1]
    if len(set(own)) == 1:
        return list(range(len(lps)))
    if MIXED and len(set(own)) == 2 and lone:
        return lone[:1] + [i for i in range(len(lps)) if i != lone[0]]
    return None


def _parts(found: list) -> list[tuple[list[int], list[int]]]:
    """(weights, launch order) of each grouped launch linear_many makes from _launch_of's results: the weights of
    one key, up to MAX_WEIGHTS at a time, in one launch where _order serves them, else those of one (tile columns,
    split_k) in one launch each."""
    groups: dict = {}
    for i, (_, _, key) in enumerate(found):
        if key is not None:
            groups.setdefault(key, []).append(i)
    parts = []
    for members in groups.values():
        for part in (members[j:j + MAX_WEIGHTS] for j in range(0, len(members), MAX_WEIGHTS)):
            order = _order([found[i][1] for i in part])
            if order is None:
                same: dict = {}
                for i in part:
                    same.setdefault(_own(found[i][1]), []).append(i)
                parts += [(m, list(range(len(m)))) for m in same.values() if len(m) > 1]
            elif len(part) > 1:
                parts.append((part, order))
    return parts


def _launches(x: torch.Tensor, ws: tuple[torch.Tensor, ...]):
    """(per-weight plans, per-weight launches for x's rows, launch order) if one grouped launch serves them, else
    None."""
    if not 2 <= len(ws) <= MAX_WEIGHTS or x.dim() != 2 or not (x.is_cuda or INTERPRET):
        return None
    found = [_launch_of(x, w) for w in ws]
    if found[0][2] is None or any(f[2] != found[0][2] for f in found):
        return None
    order = _order([f[1] for f in found])
    return None if order is None else ([f[0] for f in found], [f[1] for f in found], order)


def serves(x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> bool:
    """Whether linear_group computes these weights in one grouped launch (see the module docstring)."""
    return _launches(x, ws) is not None


def linear_many(x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """(triton_gemm.linear(x, w) for w in ws): weights whose launches can share one in grouped launches (_parts),
    the others one by one; in the order of ws.

    Raises:
        ValueError: as triton_gemm.linear, for a weight it refuses.
    """
    found = [_launch_of(x, w) for w in ws] if x.dim() == 2 and (x.is_cuda or INTERPRET) else []
    out: list = [None] * len(ws)
    for part, order in _parts(found):
        ys = _grouped(x, [found[i][0] for i in part], [found[i][1] for i in part], order)
        for i, y in zip(part, ys):
            out[i] = y
    return tuple(y if y is not None else tg.linear(x, w) for y, w in zip(out, ws))


def linear_group(x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
    """(x @ w^T for w in ws), each the bytes of triton_gemm.linear(x, w), in one launch; None where not served.

    Args:
        x: [M, K] bf16/fp16/fp32 on CUDA (the CPU under the interpreter); ws: 2 or 3 weights [N_i, K] of x's dtype.
    Returns:
        one [M, N_i] tensor per weight, or None (serves() is False: the caller runs linear() per weight).
    """
    found = _launches(x, ws)
    return None if found is None else _grouped(x, *found)


def _grouped(x: torch.Tensor, plans: list, lps: list, order: list[int]) -> tuple[torch.Tensor, ...]:
    """The grouped launch for weights whose launches for x's rows share one (_launch_of's key), launched in
    ``order`` (_order); their outputs in the order of plans."""
    plans, lps = [plans[i] for i in order], [lps[i] for i in order]
    lp0, lp, M, K, Ns = lps[0], lps[-1], x.shape[0], plans[0].K, [p.N for p in plans]
    nb = len(plans)
    a, aligned = tg.a_operand(x.contiguous(), lp0)
    kk = (tuple(p.split_key for p in lps), aligned, x.dtype)
    keys = _KEYS.get(kk)
    if keys is None:
        keys = _KEYS[kk] = (intern_key((_gemm_split_group_kernel,) + kk),
                            intern_key((_split_reduce_group_kernel, nb, lp0.cfg.split_k, lp.cfg.split_k, tuple(Ns),
                                        x.dtype, x.device)))
    part = torch.empty(sum(q.cfg.split_k * M * n for q, n in zip(lps, Ns)), dtype=torch.float32, device=x.device)
    outs = tuple(torch.empty(M, n, dtype=x.dtype, device=x.device) for n in Ns)
    bs = [q.b for q in lps] + [lps[-1].b] * (MAX_WEIGHTS - nb)
    c3 = list(outs) + [outs[-1]] * (MAX_WEIGHTS - nb)
    N3 = Ns + [0] * (MAX_WEIGHTS - nb)
    tiles = [cdiv(M, q.cfg.block_m) * cdiv(n, q.cfg.block_n) for q, n in zip(lps, Ns)]
    counts = ts.split_counts(x.device, sum(tiles))
    own = dict(BN0=lp0.cfg.block_n, SPLIT0=lp0.cfg.split_k)
    launch(_gemm_split_group_kernel, (sum(t * q.cfg.split_k for t, q in zip(tiles, lps)),),
           (a, *bs, part, *c3, part if counts is None else counts, M, *N3, K),
           dict(lp.split_consts, **own, NB=nb, SUM=counts is not None), key=(keys[0], counts is not None), **lp.opts)
    if counts is None:
        red = ts.REDUCE
        launch(_split_reduce_group_kernel, (cdiv(M, red["BM"]), cdiv(max(Ns), red["BN"]), nb),
               (part, *c3, M, *N3), dict(**red, SPLIT0=own["SPLIT0"], SPLIT=lp.cfg.split_k, EMULATE=INTERPRET,
                                         NB=nb), key=keys[1], num_warps=4)
    back = [0] * nb
    for j, i in enumerate(order):
        back[i] = outs[j]
    return tuple(back)
