"""A tiny random Qwen3-MoE checkpoint, built from a config and saved locally (nothing downloaded).

The same folder loads in our engine (checkpoint.load_checkpoint), in transformers (``from_pretrained``) and, once
converted (engines/gguf_export.py), in llama.cpp: the engines under test run the same weights. It has no tokenizer
files; its vocabulary is the byte tokenizer's (258 ids: bytes, BOS 256, EOS 257).

The model is built in fp32 from a seed and saved in the dtype asked for. It is saved and reloaded rather than cast
in memory: ``model.to(torch.bfloat16)`` also casts RoPE's ``inv_freq`` buffer to bf16, a different model from the
one ``from_pretrained`` loads (where ``inv_freq`` is recomputed in fp32).
"""
from __future__ import annotations

from pathlib import Path

import torch

# Shapes of the tiny model: 2 layers, GQA 4 query / 2 KV heads of 16, 8 experts top-2. initializer_range 0.125 =
# N(0, 1/H) gives decisive routing and non-trivial attention (0.02 is near-uniform).
TINY_QWEN3_MOE = dict(
    vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    max_position_embeddings=4096, norm_topk_prob=True, bos_token_id=256, eos_token_id=257,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, rms_norm_eps=1e-6, initializer_range=0.125)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_tiny_qwen3_moe(seed: int = 0, **overrides):
    """A seeded random ``Qwen3MoeForCausalLM`` in fp32, eval mode; norm weights 1 + 0.1 N(0, 1) so that a
    misplaced norm (all ones by default) would show. ``overrides`` replace TINY_QWEN3_MOE fields.

    Raises:
        ImportError: transformers is not installed.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    return model


def save_tiny_qwen3_moe(folder: str | Path, seed: int = 0, dtype: str = "bfloat16", **overrides) -> Path:
    """Build the tiny model (build_tiny_qwen3_moe) and ``save_pretrained`` it to ``folder`` (safetensors, weights
    rounded to ``dtype`` once). Returns the folder.

    Raises:
        ValueError: unknown dtype (names the allowed ones); FileExistsError: ``folder`` exists and is not empty.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty; the tiny model is written to a new folder")
    model = build_tiny_qwen3_moe(seed, **overrides).to(DTYPES[dtype])
    model.save_pretrained(folder)
    return folder
