"""Model weights: the tensor layout, seeded synthetic weights, and moving/casting them.

Layout (Hugging Face Qwen3-MoE names in brackets; every matrix is ``[out_features, in_features]`` like nn.Linear):

    embed      [V, H]                 (model.embed_tokens.weight)
    layers[i]:
      attn_norm  [H]                  (input_layernorm.weight)
      wq [Hq*D, H], wk [Hkv*D, H], wv [Hkv*D, H], wo [H, Hq*D]   (self_attn.{q,k,v,o}_proj.weight)
      q_norm [D], k_norm [D]          (self_attn.{q,k}_norm.weight)
      mlp_norm   [H]                  (post_attention_layernorm.weight)
      router     [E, H]               (mlp.gate.weight)
      w_gate [E, I, H], w_up [E, I, H], w_down [E, H, I]   (mlp.experts.{e}.{gate,up,down}_proj.weight, stacked)
      shared_gate [Is, H], shared_up [Is, H], shared_down [H, Is]   (optional shared expert; None when Is == 0)
    final_norm [H]                    (model.norm.weight)
    lm_head    [V, H]                 (lm_head.weight)

Quantized weights (the ``weights`` setting, WEIGHT_FORMATS: ``"bf16"`` = none, ``"int4_g128"``, ``"nvfp4"``):
:func:`quantize_weights` replaces the expert and dense projection matrices (wq, wk, wv, wo, w_gate, w_up, w_down,
shared_*) by kernels.quant.QuantWeight objects (codes + scales, same [..., out, in] layout); the embedding, norms,
router and lm_head stay in the storage dtype. kernels/quant.py defines the formats and their fp32 dequantization.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace

import torch

from .config import ModelConfig
from .kernels.quant import WEIGHT_FORMATS, QuantWeight, quantize

QUANTIZED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down")


@dataclass
class LayerWeights:
    """One decoder layer's tensors (shapes in the module docstring)."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    mlp_norm: torch.Tensor
    router: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    shared_gate: torch.Tensor | None = None
    shared_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None

    def map(self, fn) -> "LayerWeights":
        """Apply ``fn`` to every tensor (None stays None)."""
        return replace(self, **{f.name: (None if getattr(self, f.name) is None else fn(getattr(self, f.name)))
                                for f in fields(self)})


@dataclass
class Weights:
    """All model tensors plus the config they belong to."""

    cfg: ModelConfig
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    extra: dict = field(default_factory=dict)  # tensors beside the decoder (a checkpoint's MTP head): name -> tensor

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> "Weights":
        """Return a copy on ``device`` with floating tensors cast to ``dtype`` (round-to-nearest-even)."""
        return self.map_tensors(lambda t: moved(t, device, dtype))

    def map_tensors(self, fn) -> "Weights":
        """A Weights whose every tensor is ``fn(tensor)`` (e.g. torch.clone)."""
        return Weights(cfg=self.cfg, embed=fn(self.embed), layers=[lw.map(fn) for lw in self.layers],
                       final_norm=fn(self.final_norm), lm_head=fn(self.lm_head),
                       extra={k: fn(v) for k, v in self.extra.items()})

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def nbytes(self) -> int:
        """Total bytes of all tensors."""
        total = self.embed.nbytes + self.final_norm.nbytes + self.lm_head.nbytes  # QuantWeight has nbytes too
        for lw in self.layers:
            total += sum(getattr(lw, f.name).nbytes for f in fields(lw) if getattr(lw, f.name) is not None)
        return total


def moved(t: torch.Tensor, device: str | torch.device | None, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` on ``device`` (None: where it is), a floating tensor cast to ``dtype`` (None: kept), rounded to nearest
    even. A CPU tensor bound for a CUDA device crosses first and is cast there: a blocking ``Tensor.to`` that
    changes both would cast on the CPU (PyTorch's CUDA copy converts on the CPU for blocking transfers), a pass
    over the small preset's 2.4 G values on the receipts' one CPU thread; the rounding, and so the bytes, are the
    same for every value but NaN payloads (tests/test_cuda_kernels.py checks them on a GPU)."""
    dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    if device is not None and t.device.type == "cpu" and torch.device(device).type == "cuda" and dt != t.dtype:
        return t.to(device=device).to(dt)
    return t.to(device=device, dtype=dt)


def _linear(g: torch.Generator, out_f: int, in_f: int, *lead: int) -> torch.Tensor:
    # Kaiming-style N(0, 1/in_features): keeps activations O(1) through the layer, like nn.Linear's default scale.
    # In place: the same quotients as ``/``, without a second buffer of the draw's size (the small preset's expert
    # weights are 1.2 GB per projection in fp32).
    return torch.randn(*lead, out_f, in_f, generator=g).div_(math.sqrt(in_f))


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    # Around 1 with a spread, so the norm weights are not all equal (equal weights would hide per-channel bugs).
    return 1.0 + 0.1 * torch.randn(n, generator=g)


def synthetic_weights(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu", weights: str = "bf16") -> Weights:
    """Seeded synthetic weights for ``cfg``, identical on every machine for a given torch CPU generator.

    Initialisation (all drawn in fp32 on the CPU from ``torch.Generator().manual_seed(cfg.seed)`` in the order
    below, then rounded to ``dtype``): embedding N(0, 1); every linear weight N(0, 1/in_features); norm weights
    1 + 0.1·N(0, 1); router N(0, 1/H) scaled by 4 so that routing is decisive rather than near-uniform.

    ``weights`` other than ``"bf16"`` quantizes the projections afterwards (quantize_weights), from the
    ``dtype`` values.

    Returns:
        Weights on ``device`` in ``dtype`` (bf16 or fp32), projections quantized as ``weights`` says.
    Raises:
        ValueError: ``weights`` is not one of WEIGHT_FORMATS.
    """
    if weights != "bf16":
        return quantize_weights(synthetic_weights(cfg, dtype, device), weights)
    return shared_draw(cfg, lambda: _draw(cfg), device, dtype)


def shared_draw(key, draw, device: str | torch.device, dtype: torch.dtype):
    """``draw()`` (an fp32 CPU draw with ``.to(device=, dtype=)`` and ``.map_tensors(fn)``, e.g. Weights) on
    ``device`` in ``dtype``; inside sharing_synthetic_weights() drawn once per ``key`` and derived from then on."""
    if _SHARED is None:
        return draw().to(device=device, dtype=dtype)
    master = _SHARED.get(key)
    if master is None:
        master = _SHARED[key] = draw()
    if torch.device(device).type == "cpu" and dtype in (None, torch.float32):
        return master.map_tensors(torch.clone)  # never hand out the shared fp32 draw itself (callers may mutate)
    return master.to(device=device, dtype=dtype)


_SHARED: dict | None = None  # shared_draw's key -> fp32 CPU draw, while sharing_synthetic_weights() is active


@contextmanager
def sharing_synthetic_weights():
    """Within the block, synthetic_weights (and mtp.synthetic_mtp_weights, through shared_draw) draw each
    config's fp32 values once and derive every later (dtype, device) from that draw (same bytes as a fresh draw,
    minus the seconds to minutes of CPU time: the ``small`` preset is about 2.4 G values). For one process that
    runs several analysis sections (``python -m exactness sections``) or one section that builds several formats.
    Holds the fp32 draw (4 bytes per value) until the outermost block ends, and an fp32 CPU request gets a copy
    beside it (a second 4 bytes per value); a nested block shares the outer block's draws.
    """
    global _SHARED
    old = _SHARED
    _SHARED = {} if old is None else old   # nested: the outer block's draws serve
    try:
        yield
    finally:
        _SHARED = old


def _draw(cfg: ModelConfig) -> Weights:
    """The fp32 CPU draw of synthetic_weights (see there)."""
    g = torch.Generator().manual_seed(cfg.seed)
    H, D, E, I, Is = cfg.hidden, cfg.head_dim, cfg.n_experts, cfg.expert_inter, cfg.shared_expert_inter
    embed = torch.randn(cfg.vocab_size, H, generator=g)
    layers = []
    for _ in range(cfg.n_layers):
        layers.append(LayerWeights(
            attn_norm=_norm(g, H),
            wq=_linear(g, cfg.n_heads * D, H), wk=_linear(g, cfg.n_kv_heads * D, H),
            wv=_linear(g, cfg.n_kv_heads * D, H), wo=_linear(g, H, cfg.n_heads * D),
            q_norm=_norm(g, D), k_norm=_norm(g, D), mlp_norm=_norm(g, H),
            router=4.0 * _linear(g, E, H),
            w_gate=_linear(g, I, H, E), w_up=_linear(g, I, H, E), w_down=_linear(g, H, I, E),
            shared_gate=_linear(g, Is, H) if Is else None, shared_up=_linear(g, Is, H) if Is else None,
            shared_down=_linear(g, H, Is) if Is else None,
        ))
    return Weights(cfg=cfg, embed=embed, layers=layers, final_norm=_norm(g, H), lm_head=_linear(g, cfg.vocab_size, H))


def quantize_weights(w: Weights, fmt: str) -> Weights:
    """``w`` with every QUANTIZED matrix replaced by ``quant.quantize(matrix, fmt)`` (deterministic: a function of
    the matrix's values only); ``"bf16"`` returns ``w`` itself. Stacked experts [E, ...] get one nvfp4 per-tensor
    scale per expert.

    Raises:
        ValueError: ``fmt`` is not one of WEIGHT_FORMATS, or ``w`` is quantized already.
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weights setting {fmt!r}; allowed: {', '.join(WEIGHT_FORMATS)}")
    if fmt == "bf16":
        return w
    if any(isinstance(getattr(lw, n), QuantWeight) for lw in w.layers for n in QUANTIZED):
        raise ValueError(f"weights are quantized already; cannot quantize them again to {fmt!r}")

    def layer(lw: LayerWeights) -> LayerWeights:
        return replace(lw, **{n: quantize(getattr(lw, n), fmt) for n in QUANTIZED if getattr(lw, n) is not None})
    return Weights(cfg=w.cfg, embed=w.embed, layers=[layer(lw) for lw in w.layers], final_norm=w.final_norm,
                   lm_head=w.lm_head, extra=dict(w.extra))


def weights_format(w: Weights) -> str:
    """The weights setting ``w`` was built with: ``"bf16"`` (plain tensors, whatever the storage dtype) or the
    QuantWeight format of its projections."""
    q = w.layers[0].wq if w.layers else None
    return q.fmt if isinstance(q, QuantWeight) else "bf16"


def device_random_weights(cfg, dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0):
    """Weights with synthetic_weights' distributions drawn directly on ``device`` (different values).

    For GPU benchmarks and tests: synthetic_weights draws every value on the CPU (about 2.5 G values for the
    ``small`` preset, minutes of CPU time); this draws them with a device generator in seconds. Distributions:
    embedding N(0, 1), linear weights N(0, 1/in_features), norm weights 1 + 0.1 N(0, 1), router 4 N(0, 1/H).

    Returns:
        Weights on ``device`` in ``dtype``.
    """
    g = torch.Generator(device=device).manual_seed(seed)

    def lin(out_f: int, in_f: int, *lead: int, scale: float = 1.0):
        return (torch.randn(*lead, out_f, in_f, generator=g, device=device) * (scale / math.sqrt(in_f))).to(dtype)

    def nrm(n: int):
        return (1.0 + 0.1 * torch.randn(n, generator=g, device=device)).to(dtype)

    H, D, E, I, Is = cfg.hidden, cfg.head_dim, cfg.n_experts, cfg.expert_inter, cfg.shared_expert_inter
    layers = [LayerWeights(attn_norm=nrm(H), wq=lin(cfg.n_heads * D, H), wk=lin(cfg.n_kv_heads * D, H),
                           wv=lin(cfg.n_kv_heads * D, H), wo=lin(H, cfg.n_heads * D), q_norm=nrm(D), k_norm=nrm(D),
                           mlp_norm=nrm(H), router=lin(E, H, scale=4.0), w_gate=lin(I, H, E), w_up=lin(I, H, E),
                           w_down=lin(H, I, E), shared_gate=lin(Is, H) if Is else None,
                           shared_up=lin(Is, H) if Is else None, shared_down=lin(H, Is) if Is else None)
              for _ in range(cfg.n_layers)]
    embed = torch.randn(cfg.vocab_size, H, generator=g, device=device).to(dtype)
    return Weights(cfg=cfg, embed=embed, layers=layers, final_norm=nrm(H), lm_head=lin(cfg.vocab_size, H))
