"""The contract's random-input builders, one per kernel class, named by the class records (kernels/registry.py).

A builder takes a :class:`RandomInputs` and returns ``(rows, fixed)``: ``rows`` the class's per-row arguments
(``KernelClass.row_args`` order), each a tensor [n, ...] with n = ``inp.n`` pool rows; ``fixed`` the other
arguments (weights, eps, ...). contract_cases.make_pool turns them into a Pool. Activations are seeded N(0, 1)
draws from ``inp.gen``; weights are the preset's layer-0 weights (Kaiming-scaled, weights.py). The draw order
within each builder fixes the pool's values: keep it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RandomInputs:
    """What a builder draws from.

    Attributes:
        cfg: the preset's ModelConfig; weights: its fp32 synthetic Weights (``layer0`` = weights.layers[0]).
        gen: the class's seeded torch.Generator (CPU); n: pool rows (tested rows plus lead and tail mates).
        n_real, n_mates: tested rows and mates per side (attention places them in two cache slots).
        dtype, device: what :meth:`cast` moves float tensors to (integer tensors keep their dtype).
    """

    cfg: object
    weights: object
    gen: torch.Generator
    n: int
    n_real: int
    n_mates: int
    dtype: torch.dtype
    device: str

    @property
    def layer0(self):
        return self.weights.layers[0]

    def randn(self, *shape) -> torch.Tensor:
        """N(0, 1) fp32 CPU tensor of ``shape`` from the class's generator."""
        return torch.randn(*shape, generator=self.gen)

    def cast(self, *ts) -> tuple:
        """``ts`` on the device, float tensors in the pool dtype."""
        return tuple(t.to(device=self.device, dtype=self.dtype) if t.is_floating_point() else t.to(self.device)
                     for t in ts)


def dense(inp: RandomInputs):
    return inp.cast(inp.randn(inp.n, inp.cfg.hidden)), inp.cast(inp.layer0.wq)


def router(inp: RandomInputs):
    wr = inp.layer0.router.clone()
    wr[1] = wr[0]  # experts 0 and 1 tie in every row: exercises the top-k tie-break
    return inp.cast(inp.randn(inp.n, inp.cfg.hidden)), (*inp.cast(wr), inp.cfg.top_k, inp.cfg.norm_topk_prob)


def expert_gate_up(inp: RandomInputs):
    lw = inp.layer0
    return inp.cast(inp.randn(inp.n, inp.cfg.hidden)), inp.cast(lw.w_gate[0], lw.w_up[0])


def expert_down(inp: RandomInputs):
    return inp.cast(0.5 * inp.randn(inp.n, inp.cfg.expert_inter)), inp.cast(inp.layer0.w_down[0])


def moe_combine(inp: RandomInputs):
    n, k, H = inp.n, inp.cfg.top_k, inp.cfg.hidden
    wts = torch.softmax(inp.randn(n, k), dim=-1)
    return inp.cast(inp.randn(n, k, H), wts, inp.randn(n, H)), ()


def attention(inp: RandomInputs):
    """q rows [n, Hq, D], slot and position per row; fixed two-slot caches (contract_cases module docstring)."""
    cfg, n, g = inp.cfg, inp.n, inp.gen
    kc, vc = inp.randn(2, n, cfg.n_kv_heads, cfg.head_dim), inp.randn(2, n, cfg.n_kv_heads, cfg.head_dim)
    pos = torch.cat([torch.arange(inp.n_real), torch.randint(0, n, (2 * inp.n_mates,), generator=g)])
    slots = torch.cat([torch.zeros(inp.n_real + inp.n_mates, dtype=torch.int64),
                       torch.ones(inp.n_mates, dtype=torch.int64)])
    return inp.cast(inp.randn(n, cfg.n_heads, cfg.head_dim), slots, pos), inp.cast(kc, vc)


def rmsnorm(inp: RandomInputs):
    """Per-head q-norm shape [n, Hq, D]: rows are flattened to M*Hq inside the kernels."""
    cfg = inp.cfg
    return inp.cast(inp.randn(inp.n, cfg.n_heads, cfg.head_dim)), (*inp.cast(inp.layer0.q_norm), cfg.rms_eps)


def rope(inp: RandomInputs):
    cfg = inp.cfg
    pos = torch.randint(0, cfg.max_positions, (inp.n,), generator=inp.gen)
    return inp.cast(inp.randn(inp.n, cfg.n_heads, cfg.head_dim), pos), (cfg.rope_theta,)


def residual(inp: RandomInputs):
    return inp.cast(inp.randn(inp.n, inp.cfg.hidden), inp.randn(inp.n, inp.cfg.hidden)), ()


def lm_head(inp: RandomInputs):
    return inp.cast(inp.randn(inp.n, inp.cfg.hidden)), inp.cast(inp.weights.lm_head)


def argmax(inp: RandomInputs):
    """Half the rows small integers (many exact ties: the first maximum wins), half N(0, 1)."""
    n, V = inp.n, inp.cfg.vocab_size
    ties = torch.randint(-4, 5, (n, V), generator=inp.gen).float()
    logits = torch.where(torch.arange(n)[:, None] % 2 == 0, ties, inp.randn(n, V))
    return inp.cast(logits), ()
