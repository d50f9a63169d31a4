"""The contract's random-input builders, one per kernel class, named by the class records (kernels/registry.py).

A builder takes a :class:`RandomInputs` and returns ``(rows, fixed)``: ``rows`` the class's per-row arguments
(``KernelClass.row_args`` order), each a tensor [n, ...] with n = ``inp.n`` pool rows; ``fixed`` the other
arguments (weights, eps, ...). contract_cases.make_pool turns them into a Pool. Activations are seeded N(0, 1)
draws from ``inp.gen``; weights are the preset's layer-0 weights (Kaiming-scaled, weights.py). The draw order
within each builder fixes the pool's values: keep it.

*Call sites.* A class the forward calls with several operand shapes (dense: the q, k, v and o projections; RMSNorm:
hidden rows, query-head rows, kv-head rows and the final norm; ...) declares its sites with :func:`sites`; the
builder then reads ``inp.site`` and returns that site's weight and row shape, so every shape the forward feeds the
kernel is checked. :data:`SITE_WEIGHTS` names the weight of each site (captured pools pick the tapped calls that
pass it); a site without a weight (RoPE) is picked by its order among the class's calls in a layer.

*Weights formats.* With ``inp.weight_format`` other than ``"bf16"`` the builders of :data:`QUANT_CLASSES` (the
classes whose weights weights.quantize_weights replaces) feed the site's weight quantized (kernels/quant.py:
``quantize`` of the weight rounded to the pool dtype), as a QuantWeight. *Grouped routing.* With ``inp.cfg``
routing in groups (ModelConfig.router_groups) the router has two sites: ``topk`` (plain top-k) and ``grouped``
(the groups passed as the kernel's fifth argument). *KV formats.* Attention's sites are the cache formats
(:data:`KV_SITES`): ``bf16`` (the storage dtype) and ``fp8`` (codes and scales, cache.KVFormat).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.quant import quantize
# attention's call sites: the KV cache formats (cache.KV_DTYPES) fed, plain rows or fp8 codes and scales
KV_SITES = {"bf16": ("bf16",), "fp8": ("fp8_e4m3", "fp8_e4m3_block")}

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
    site: str = ""
    weight_format: str = "bf16"

    @property
    def layer0(self):
        return self.weights.layers[0]

    def randn(self, *shape) -> torch.Tensor:
        """N(0, 1) fp32 CPU tensor of ``shape`` from the class's generator."""
        return torch.randn(*shape, generator=self.gen)

    def cast(self, *ts) -> tuple:
        """``ts`` on the device, float tensors in the pool dtype (a QuantWeight is moved, never cast)."""
        return tuple(t.to(device=self.device, dtype=self.dtype) if t.is_floating_point() else t.to(self.device)
                     for t in ts)

    def weight(self, *ws) -> tuple:
        """Projection weights ``ws`` [N, K] (fp32) for the pool: cast to the pool dtype, then quantized to
        ``weight_format`` unless it is ``"bf16"`` (plain tensors)."""
        ws = self.cast(*ws)
        return ws if self.weight_format == "bf16" else tuple(quantize(w, self.weight_format) for w in ws)


def sites(names):
    """Decorator: the builder's call sites, a tuple of names or ``cfg -> tuple`` (sites that depend on the preset,
    such as a shared expert that only some presets have)."""
    def mark(builder):
        builder.sites = names
        return builder
    return mark


def sites_of(builder, cfg) -> tuple[str, ...]:
    """The call sites of a builder for preset ``cfg``: ``("",)`` (one unnamed site) when it declares none."""
    names = getattr(builder, "sites", None)
    if names is None:
        return ("",)
    return tuple(names(cfg) if callable(names) else names)


def _shared(cfg) -> tuple[str, ...]:
    return ("routed", "shared") if cfg.shared_expert_inter else ("routed",)


# (class, site) -> the site's weight in a Weights (layer 0, or the model's own for the final norm and the head)
SITE_WEIGHTS = {
    ("dense", "q"): lambda w: w.layers[0].wq, ("dense", "k"): lambda w: w.layers[0].wk,
    ("dense", "v"): lambda w: w.layers[0].wv, ("dense", "o"): lambda w: w.layers[0].wo,
    ("expert_gate_up", "routed"): lambda w: w.layers[0].w_gate,
    ("expert_gate_up", "shared"): lambda w: w.layers[0].shared_gate,
    ("expert_down", "routed"): lambda w: w.layers[0].w_down,
    ("expert_down", "shared"): lambda w: w.layers[0].shared_down,
    ("rmsnorm", "attn_norm"): lambda w: w.layers[0].attn_norm, ("rmsnorm", "q_norm"): lambda w: w.layers[0].q_norm,
    ("rmsnorm", "k_norm"): lambda w: w.layers[0].k_norm, ("rmsnorm", "mlp_norm"): lambda w: w.layers[0].mlp_norm,
    ("rmsnorm", "final_norm"): lambda w: w.final_norm,
}


@sites(("q", "k", "v", "o"))
def dense(inp: RandomInputs):
    """x [n, K] and the site's projection weight [N, K] (o: K = Hq*D, the attention output)."""
    w = SITE_WEIGHTS[("dense", inp.site or "q")](inp.weights)
    return inp.cast(inp.randn(inp.n, w.shape[1])), inp.weight(w)


def router_sites(cfg) -> tuple[str, ...]:
    """("",) for plain top-k; ("topk", "grouped") when ``cfg`` routes in groups (n_groups > 1)."""
    return ("",) if cfg.router_groups is None else ("topk", "grouped")


@sites(router_sites)
def router(inp: RandomInputs):
    """x [n, H]; layer 0's router weight [E, H] with experts 0 and 1 tied (the top-k tie-break), top_k, norm, and
    at site ``grouped`` the groups (n_groups, topk_groups)."""
    wr = inp.layer0.router.clone()
    wr[1] = wr[0]  # experts 0 and 1 tie in every row: exercises the top-k tie-break
    groups = (inp.cfg.router_groups,) if inp.site == "grouped" else ()
    return inp.cast(inp.randn(inp.n, inp.cfg.hidden)), (*inp.cast(wr), inp.cfg.top_k, inp.cfg.norm_topk_prob,
                                                        *groups)


@sites(_shared)
def expert_gate_up(inp: RandomInputs):
    """x [n, H]; routed expert 0's (w_gate, w_up) [I, H], or the shared expert's [Is, H]."""
    lw = inp.layer0
    w = (lw.shared_gate, lw.shared_up) if inp.site == "shared" else (lw.w_gate[0], lw.w_up[0])
    return inp.cast(inp.randn(inp.n, inp.cfg.hidden)), inp.weight(*w)


@sites(_shared)
def expert_down(inp: RandomInputs):
    """h [n, I]; routed expert 0's w_down [H, I], or the shared expert's [H, Is]."""
    w = inp.layer0.shared_down if inp.site == "shared" else inp.layer0.w_down[0]
    return inp.cast(0.5 * inp.randn(inp.n, w.shape[1])), inp.weight(w)


def moe_combine(inp: RandomInputs):
    n, k, H = inp.n, inp.cfg.top_k, inp.cfg.hidden
    wts = torch.softmax(inp.randn(n, k), dim=-1)
    return inp.cast(inp.randn(n, k, H), wts, inp.randn(n, H)), ()


@sites(tuple(KV_SITES))
def attention(inp: RandomInputs):
    """q rows [n, Hq, D], slot and position per row; fixed two-slot caches (contract_cases module docstring) in the
    storage dtype (site ``bf16``; cases.kv_pool stores them in an fp8 format for site ``fp8``)."""
    cfg, n, g = inp.cfg, inp.n, inp.gen
    kc, vc = inp.randn(2, n, cfg.n_kv_heads, cfg.head_dim), inp.randn(2, n, cfg.n_kv_heads, cfg.head_dim)
    pos = torch.cat([torch.arange(inp.n_real), torch.randint(0, n, (2 * inp.n_mates,), generator=g)])
    slots = torch.cat([torch.zeros(inp.n_real + inp.n_mates, dtype=torch.int64),
                       torch.ones(inp.n_mates, dtype=torch.int64)])
    return inp.cast(inp.randn(n, cfg.n_heads, cfg.head_dim), slots, pos), inp.cast(kc, vc)


def _head_rows(cfg, site: str) -> tuple[int, ...]:
    """Row shape of a site: [Hq, D] for query heads, [Hkv, D] for kv heads, [H] for hidden rows."""
    if site in ("q", "q_norm"):
        return (cfg.n_heads, cfg.head_dim)
    if site in ("k", "k_norm"):
        return (cfg.n_kv_heads, cfg.head_dim)
    return (cfg.hidden,)


@sites(("q_norm", "k_norm", "attn_norm", "mlp_norm", "final_norm"))
def rmsnorm(inp: RandomInputs):
    """Rows [n, Hq, D] (q_norm; per-head rows are flattened to M*Hq inside the kernels), [n, Hkv, D] (k_norm) or
    [n, H] (attn_norm, mlp_norm, final_norm), and the site's norm weight."""
    site = inp.site or "q_norm"
    w = SITE_WEIGHTS[("rmsnorm", site)](inp.weights)
    return inp.cast(inp.randn(inp.n, *_head_rows(inp.cfg, site))), (*inp.cast(w), inp.cfg.rms_eps)


@sites(("q", "k"))
def rope(inp: RandomInputs):
    """Rows [n, Hq, D] (q) or [n, Hkv, D] (k) and a random position per row."""
    cfg = inp.cfg
    pos = torch.randint(0, cfg.max_positions, (inp.n,), generator=inp.gen)
    return inp.cast(inp.randn(inp.n, *_head_rows(cfg, inp.site or "q")), pos), (cfg.rope_theta,)


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
