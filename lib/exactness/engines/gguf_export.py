"""A Qwen3-MoE Hugging Face folder converted to a GGUF file, so that llama.cpp runs the weights our engine runs.

The folder is read by checkpoint.load_checkpoint (the same checks as our engine: an unsupported config value or a
missing / mis-shaped tensor is refused with a CheckpointError, a ValueError) and written with the ``gguf``
package's GGUFWriter under llama.cpp's ``qwen3moe`` architecture:

    token_embd [V, H]  output_norm [H]  output [V, H]
    blk.{i}.attn_norm [H]  attn_q [Hq*D, H]  attn_k / attn_v [Hkv*D, H]  attn_output [H, Hq*D]
    blk.{i}.attn_q_norm / attn_k_norm [D]  ffn_norm [H]  ffn_gate_inp [E, H]
    blk.{i}.ffn_gate_exps / ffn_up_exps [E, I, H]  ffn_down_exps [E, H, I]

(numpy shapes, row-major like torch; GGUF stores the dimensions reversed). Matrices are written in ``dtype``; norms
and the router stay fp32 as llama.cpp's own converter writes them (exact: the values are the checkpoint's).

The vocabulary is the byte tokenizer's (tokenizer.ByteTokenizer): ids 0..255 are the bytes (as a byte-level BPE
vocabulary without merges), 256 BOS, 257 EOS, then unused tokens up to the model's vocabulary size. llama.cpp
tokenizes UTF-8 text to exactly ByteTokenizer's ids (BOS first), so a server given text sees the suite's ids.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

GGUF_DTYPES = ("bf16", "f32")
ARCH = "qwen3moe"


def _gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("the GGUF export needs the gguf package: pip install gguf") from e
    return gguf


def _check_exportable(cfg) -> None:
    """Raise ValueError for a model llama.cpp's qwen3moe graph would compute differently."""
    if cfg.shared_expert_inter:
        raise ValueError(f"shared_expert_intermediate_size={cfg.shared_expert_inter}: llama.cpp's {ARCH} has no "
                         "shared expert (allowed: 0)")
    if not cfg.norm_topk_prob:
        raise ValueError(f"norm_topk_prob=False: llama.cpp's {ARCH} always renormalises the top-k router weights "
                         "(allowed: true)")
    if cfg.vocab_size < 258 or (cfg.bos_id, cfg.eos_id) != (256, 257):
        raise ValueError(f"vocab_size={cfg.vocab_size}, bos/eos ids {cfg.bos_id}/{cfg.eos_id}: the exported vocabulary "
                         "is the byte tokenizer's (allowed: at least 258 ids, BOS 256, EOS 257)")


def _array(t: torch.Tensor, dtype: str, gguf) -> tuple[np.ndarray, object]:
    """(numpy array, raw GGML type or None) of ``t`` in ``dtype``; bf16 bits are passed as raw bytes."""
    t = t.detach().to("cpu").contiguous()
    if dtype == "f32":
        return t.to(torch.float32).numpy(), None
    bits = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)  # round-to-nearest-even, then the bits
    return bits, gguf.GGMLQuantizationType.BF16


def _tensors(w) -> dict[str, tuple[torch.Tensor, bool]]:
    """GGUF name -> (tensor, is a matrix written in the export dtype) for every tensor of Weights ``w``."""
    out = {"token_embd.weight": (w.embed, True), "output_norm.weight": (w.final_norm, False),
           "output.weight": (w.lm_head, True)}
    for i, lw in enumerate(w.layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (lw.attn_norm, False), p + "attn_q.weight": (lw.wq, True),
                    p + "attn_k.weight": (lw.wk, True), p + "attn_v.weight": (lw.wv, True),
                    p + "attn_output.weight": (lw.wo, True), p + "attn_q_norm.weight": (lw.q_norm, False),
                    p + "attn_k_norm.weight": (lw.k_norm, False), p + "ffn_norm.weight": (lw.mlp_norm, False),
                    p + "ffn_gate_inp.weight": (lw.router, False), p + "ffn_gate_exps.weight": (lw.w_gate, True),
                    p + "ffn_up_exps.weight": (lw.w_up, True), p + "ffn_down_exps.weight": (lw.w_down, True)})
    return out


def _metadata(wr, cfg, name: str, dtype: str, gguf) -> None:
    wr.add_name(name)
    wr.add_context_length(cfg.max_positions)
    wr.add_embedding_length(cfg.hidden)
    wr.add_block_count(cfg.n_layers)
    wr.add_feed_forward_length(cfg.expert_inter)  # no dense MLP layer; llama.cpp reads the expert length
    wr.add_expert_feed_forward_length(cfg.expert_inter)
    wr.add_head_count(cfg.n_heads)
    wr.add_head_count_kv(cfg.n_kv_heads)
    wr.add_key_length(cfg.head_dim)
    wr.add_value_length(cfg.head_dim)
    wr.add_rope_freq_base(cfg.rope_theta)
    wr.add_layer_norm_rms_eps(cfg.rms_eps)
    wr.add_expert_count(cfg.n_experts)
    wr.add_expert_used_count(cfg.top_k)
    ft = gguf.LlamaFileType
    wr.add_file_type(ft.MOSTLY_BF16 if dtype == "bf16" else ft.ALL_F32)


def _byte_units() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte 0..255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(moved)) for b in range(256)]


def _byte_vocab(wr, vocab_size: int, gguf) -> None:
    """The byte tokenizer as a byte-level BPE ("gpt2") vocabulary without merges: llama.cpp turns UTF-8 text into
    one token per byte, BOS first, the ids ByteTokenizer gives; unused tokens pad up to the model's vocabulary."""
    tt = gguf.TokenType
    tokens = _byte_units() + ["<|exactness_bos|>", "<|exactness_eos|>"]
    types = [tt.NORMAL] * 256 + [tt.CONTROL, tt.CONTROL]
    tokens += [f"<|exactness_unused_{i}|>" for i in range(vocab_size - 258)]
    types += [tt.UNUSED] * (vocab_size - 258)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    # llama.cpp requires a merges list; this one merge joins two control tokens, which never meet inside a word
    wr.add_token_merges([f"{tokens[256]} {tokens[257]}"])
    wr.add_bos_token_id(256)
    wr.add_eos_token_id(257)
    wr.add_add_bos_token(True)


def export_gguf(model_folder: str | Path, out_path: str | Path, dtype: str = "bf16") -> Path:
    """Convert the Qwen3-MoE checkpoint folder ``model_folder`` (config.json + safetensors, as
    engines/tiny.save_tiny_qwen3_moe writes it) to the GGUF file ``out_path``.

    Args:
        dtype: ``bf16`` (matrices rounded to bf16: exact for a bf16 checkpoint) or ``f32`` (exact widening).
    Returns:
        out_path.
    Raises:
        ValueError: an unknown dtype (names the allowed ones); a folder our loader refuses (checkpoint.
            CheckpointError: unsupported architecture or config value, missing / mis-shaped / unexpected tensor);
            a model llama.cpp's qwen3moe cannot compute (shared expert, norm_topk_prob false) or whose vocabulary is not
            the byte tokenizer's (fewer than 258 ids, BOS not 256 or EOS not 257).
        FileExistsError: ``out_path`` exists.
        ImportError: the gguf package is not installed.
    """
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"unknown GGUF dtype {dtype!r}; allowed: {', '.join(GGUF_DTYPES)}")
    out_path = Path(out_path)
    if out_path.exists():
        raise FileExistsError(f"{out_path} exists; the GGUF file is written to a new path")
    gguf = _gguf()
    from ..checkpoint import load_checkpoint, read_config
    cfg, _ = read_config(str(model_folder))
    _check_exportable(cfg)
    w, _ = load_checkpoint(str(model_folder), dtype=torch.float32)  # exact widening; rounded once below
    wr = gguf.GGUFWriter(str(out_path), ARCH)
    _metadata(wr, cfg, Path(model_folder).name, dtype, gguf)
    _byte_vocab(wr, cfg.vocab_size, gguf)
    for name, (t, matrix) in _tensors(w).items():
        arr, raw = _array(t, dtype if matrix else "f32", gguf)
        wr.add_tensor(name, arr, raw_dtype=raw)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return out_path
