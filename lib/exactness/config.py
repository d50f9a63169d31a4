"""Model configuration: one frozen dataclass and its named presets.

The layout follows Qwen3-MoE (``Qwen3MoeConfig`` in Hugging Face transformers): token embedding, ``n_layers``
decoder layers (RMSNorm -> grouped-query attention with RoPE and per-head q/k RMSNorm -> residual -> RMSNorm ->
MoE with softmax router, top-k, renormalised weights, SwiGLU experts and an optional shared expert -> residual),
a final RMSNorm and an untied ``lm_head``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Byte-level vocabulary of the synthetic presets: 256 byte ids, then BOS and EOS (see tokenizer.py).
BYTE_VOCAB = 258


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of one MoE decoder.

    Attributes (all counts are plain ints; ``rope_theta`` and ``rms_eps`` are floats):
        name: preset name or the checkpoint folder it came from.
        vocab_size: rows of the embedding and of ``lm_head`` (tokens).
        hidden: model width H.
        n_layers: decoder layers L.
        n_heads, n_kv_heads, head_dim: query heads Hq, key/value heads Hkv (GQA: Hq % Hkv == 0) and head dim D.
        n_experts, top_k, expert_inter: routed experts E, experts per token k, expert width I.
        n_groups, topk_groups: group-limited routing (DeepSeek-V2/V3 style): the E experts form ``n_groups`` groups
            of E / n_groups consecutive ids and each token picks its top_k among the experts of its
            ``topk_groups`` best groups (kernels/router.py). n_groups = 1 (the default) is plain top-k.
        shared_expert_inter: width of the always-on shared expert (0 = none, as in Qwen3-MoE).
        norm_topk_prob: renormalise the k routing weights to sum to 1 (Qwen3-MoE default: True).
        max_positions: largest position + 1 the model accepts (tokens).
        rope_theta: RoPE base (Su et al., RoFormer, arXiv 2104.09864, eq. 15).
        rms_eps: RMSNorm epsilon (Zhang & Sennrich, arXiv 1910.07467).
        seed: seed of the synthetic weights (weights.py).
        bos_id, eos_id: special token ids.
    """

    name: str
    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_inter: int
    shared_expert_inter: int = 0
    n_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = True
    max_positions: int = 32768
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    seed: int = 0
    bos_id: int = 256
    eos_id: int = 257

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts", "top_k",
                  "expert_inter", "max_positions", "n_groups", "topk_groups"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads} (GQA)")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        self._check_groups()
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    def _check_groups(self) -> None:
        if self.n_experts % self.n_groups:
            raise ValueError(f"n_experts={self.n_experts} is not a multiple of n_groups={self.n_groups} (each group "
                             "holds the same number of experts)")
        if self.n_groups == 1:
            if self.topk_groups != 1:
                raise ValueError(f"topk_groups={self.topk_groups} needs n_groups > 1 (n_groups=1 routes without "
                                 "groups; allowed topk_groups: 1)")
            return
        if self.topk_groups > self.n_groups:
            raise ValueError(f"topk_groups={self.topk_groups} exceeds n_groups={self.n_groups}")
        kept = self.topk_groups * (self.n_experts // self.n_groups)
        if self.top_k > kept:
            raise ValueError(f"top_k={self.top_k} exceeds the {kept} experts of the topk_groups={self.topk_groups} "
                             f"kept groups (n_experts={self.n_experts}, n_groups={self.n_groups})")

    @property
    def router_groups(self) -> tuple[int, int] | None:
        """(n_groups, topk_groups) for the router kernel, None for plain top-k (n_groups == 1)."""
        return None if self.n_groups == 1 else (self.n_groups, self.topk_groups)

    def replace(self, **changes) -> "ModelConfig":
        """Return a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    # Fast on 2 CPU cores (CI): every class is exercised, two layers, 8 experts with top-2 and a shared expert.
    "tiny": ModelConfig(name="tiny", vocab_size=BYTE_VOCAB, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, n_experts=8, top_k=2, expert_inter=32, shared_expert_inter=32, seed=0),
    # Per-layer shapes of Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert width 768, 32 q / 4 kv heads,
    # head dim 128) at reduced depth and a byte vocabulary; for the GPU.
    "small": ModelConfig(name="small", vocab_size=BYTE_VOCAB, hidden=2048, n_layers=4, n_heads=32, n_kv_heads=4,
                         head_dim=128, n_experts=128, top_k=8, expert_inter=768, shared_expert_inter=0, seed=0),
}


PRESET_REFERENCE = "package.module:ATTR (a ModelConfig, or a function of no arguments returning one)"
_IMPORTED: dict[str, ModelConfig] = {}   # reference -> its config, imported once per process


def get_preset(name: str) -> ModelConfig:
    """Return the preset called ``name``, or the user preset a ``package.module:ATTR`` reference names
    (:func:`import_preset`).

    Raises:
        ValueError: ``name`` is not a preset (the message lists the known ones), or a reference that does not
            resolve (one line, import_preset).
    """
    if isinstance(name, str) and ":" in name:
        return import_preset(name)
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}, or "
                         f"{PRESET_REFERENCE}") from None


def import_preset(ref: str) -> ModelConfig:
    """The ModelConfig named by ``ref`` = ``package.module:ATTR`` (a user's own shapes, e.g. ``top_k`` 4 on the
    tiny preset's layers: ``PRESETS["tiny"].replace(name="tiny_top4", top_k=4)``), imported once per process and
    registered in PRESETS under its own ``name``.

    Raises:
        ValueError: one line naming ``ref`` and the reason: a malformed reference, a module that fails to import,
            a missing attribute, a function that raises, an object that is not a ModelConfig, or a name another
            preset has with other values.
    """
    if ref in _IMPORTED:
        return _IMPORTED[ref]
    module, _, attr = ref.partition(":")
    if not module or not attr or ":" in attr:
        raise ValueError(f"preset reference {ref!r} is not of the form {PRESET_REFERENCE}")
    import importlib

    try:
        obj = getattr(importlib.import_module(module), attr)
        cfg = obj() if callable(obj) and not isinstance(obj, ModelConfig) else obj
    except Exception as e:  # noqa: BLE001  (a user module's failure is one line, not a traceback)
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise ValueError(f"preset reference {ref!r} does not resolve ({why}); allowed: {PRESET_REFERENCE}") from None
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"preset reference {ref!r} gives a {type(cfg).__name__}; allowed: {PRESET_REFERENCE}")
    if PRESETS.get(cfg.name, cfg) != cfg:
        raise ValueError(f"preset reference {ref!r} is named {cfg.name!r}, as another preset with other values; "
                         f"give it a name of its own (taken: {', '.join(sorted(PRESETS))})")
    PRESETS[cfg.name] = _IMPORTED[ref] = cfg
    return cfg
