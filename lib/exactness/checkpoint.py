"""Loader for a local Hugging Face Qwen3-MoE checkpoint (config.json + safetensors); nothing is ever downloaded.

What is read:
    config.json                    -> ModelConfig (``config_from_hf``); keys whose values we do not model are refused
    model.safetensors              (one file), or
    model.safetensors.index.json   + the shards its ``weight_map`` names (``save_pretrained`` with a shard size)
    tokenizer files, when present  -> tokenizer.HFTokenizer (the checkpoint's own tokenizer)

Tensor names map onto weights.py's layout (its docstring lists them). Two expert layouts are accepted:
    per-expert  ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``  [I, H], [I, H], [H, I]
                (what transformers 4.x and 5.x ``save_pretrained`` write: v5 converts back on save)
    fused       ``model.layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first, then up rows) and
                ``model.layers.{i}.mlp.experts.down_proj`` [E, H, I]
                (transformers 5.x in-memory ``Qwen3MoeExperts``, as ``save_file(model.state_dict())`` writes it;
                gate/up order from transformers 5.24 ``Qwen3MoeExperts.forward``: ``gate, up = linear(x,
                gate_up_proj[e]).chunk(2, dim=-1)``, and conversion_mapping.py's ``Concatenate(dim=1)`` of [gate, up]).
A layer may use either layout, not both. Multi-token-prediction tensors (names with an ``mtp.`` component) are not
part of the decoder: they are loaded into ``weights.extra`` (name -> tensor) and otherwise ignored.

``load_model`` is the one entry every section and engine loads a model through: a preset's synthetic weights or a
checkpoint folder, on a device and dtype named as the profiles name them (``resolve_device``, ``resolve_dtype``).
"""
from __future__ import annotations

import json
import os
import re

import torch

from .config import BYTE_VOCAB, ModelConfig, get_preset
from .tokenizer import ByteTokenizer, HFTokenizer
from .weights import LayerWeights, Weights, quantize_weights, synthetic_weights

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_MTP = re.compile(r"(^|\.)mtp\.")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}   # the dtypes a profile names


class CheckpointError(ValueError):
    """A checkpoint folder we cannot load faithfully: missing/extra/mis-shaped tensor or an unmodelled config."""


def _refuse(key: str, value, allowed: str) -> CheckpointError:
    return CheckpointError(f"config.json: {key}={value!r} is not supported (allowed: {allowed})")


def _check_supported(d: dict) -> None:
    """Raise CheckpointError for the first config value that our forward does not model."""
    checks = [
        ("model_type", d.get("model_type", "qwen3_moe"), lambda v: v == "qwen3_moe", "'qwen3_moe'"),
        ("hidden_act", d.get("hidden_act", "silu"), lambda v: v == "silu", "'silu'"),
        ("decoder_sparse_step", d.get("decoder_sparse_step", 1), lambda v: v == 1, "1 (every layer MoE)"),
        ("mlp_only_layers", d.get("mlp_only_layers"), lambda v: not v, "[] or null (no dense-MLP layers)"),
        ("attention_bias", d.get("attention_bias", False), lambda v: v is False, "false"),
        ("use_sliding_window", d.get("use_sliding_window", False), lambda v: v is False, "false"),
        ("rope_scaling", d.get("rope_scaling"),
         lambda v: v is None or (isinstance(v, dict) and v.get("rope_type", v.get("type")) == "default"),
         "null (plain RoPE)"),
        ("rope_parameters.rope_type", (d.get("rope_parameters") or {}).get("rope_type", "default"),
         lambda v: v == "default", "'default' (plain RoPE)"),
        ("quantization_config", d.get("quantization_config"), lambda v: v is None, "absent (unquantised weights)"),
    ]
    for key, value, ok, allowed in checks:
        if not ok(value):
            raise _refuse(key, value, allowed)


def _first_id(v, default: int) -> int:
    """A special-token id from config.json: int, first of a list, or ``default`` when null."""
    if isinstance(v, list):
        v = v[0] if v else None
    return default if v is None else int(v)


def config_from_hf(d: dict, name: str = "checkpoint") -> tuple[ModelConfig, bool]:
    """Map a Qwen3-MoE config.json dict onto ModelConfig.

    Keys read: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim (default
    hidden_size // num_attention_heads), num_experts (transformers 5 writes num_local_experts), num_experts_per_tok,
    moe_intermediate_size, shared_expert_intermediate_size (default 0), norm_topk_prob, max_position_embeddings,
    rope_theta (top level in 4.x, ``rope_parameters.rope_theta`` in 5.x), rms_norm_eps, vocab_size, bos/eos_token_id
    (a list of eos ids keeps the first; null -> 256/257, the byte tokenizer's, unused by the engine's paths).

    Returns:
        (config, tie_word_embeddings).
    Raises:
        CheckpointError: a required key is missing, or a key has a value we do not model (message names both).
    """
    _check_supported(d)
    try:
        H, nh = d["hidden_size"], d["num_attention_heads"]
        E = d["num_experts"] if "num_experts" in d else d["num_local_experts"]
        theta = d["rope_theta"] if "rope_theta" in d else (d.get("rope_parameters") or {})["rope_theta"]
        cfg = ModelConfig(
            name=name, vocab_size=d["vocab_size"], hidden=H, n_layers=d["num_hidden_layers"], n_heads=nh,
            n_kv_heads=d.get("num_key_value_heads") or nh, head_dim=d.get("head_dim") or H // nh, n_experts=E,
            top_k=d["num_experts_per_tok"], expert_inter=d["moe_intermediate_size"],
            shared_expert_inter=int(d.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)), max_positions=d["max_position_embeddings"],
            rope_theta=float(theta), rms_eps=float(d.get("rms_norm_eps", 1e-6)),
            bos_id=_first_id(d.get("bos_token_id"), 256), eos_id=_first_id(d.get("eos_token_id"), 257))
    except KeyError as e:
        raise CheckpointError(f"config.json lacks the required key {e.args[0]!r}") from None
    except ValueError as e:
        raise CheckpointError(f"config.json describes an invalid model: {e}") from None
    return cfg, bool(d.get("tie_word_embeddings", False))


def _tensor_index(path: str) -> dict[str, tuple[str, list[int], str]]:
    """name -> (file, shape, safetensors dtype string) over the checkpoint's safetensors files."""
    from safetensors import safe_open
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files (and no {INDEX_FILE}) in {path!r}")
    out = {}
    for f in files:
        fp = os.path.join(path, f)
        if not os.path.exists(fp):
            raise CheckpointError(f"{INDEX_FILE} names the shard {f!r}, which is not in {path!r}")
        with safe_open(fp, framework="pt") as st:
            for name in st.keys():
                if name in out:
                    raise CheckpointError(f"tensor {name!r} is stored twice: in {out[name][0]!r} and {fp!r}")
                sl = st.get_slice(name)
                out[name] = (fp, list(sl.get_shape()), sl.get_dtype())
    return out


def expected_shapes(cfg: ModelConfig, fused: list[bool], tied: bool) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape a checkpoint of ``cfg`` must hold; ``fused[i]``: layer i uses the fused expert layout."""
    H, D, E, I, Is = cfg.hidden, cfg.head_dim, cfg.n_experts, cfg.expert_inter, cfg.shared_expert_inter
    exp = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not tied:
        exp["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        exp.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (cfg.n_heads * D, H),
                    p + "self_attn.k_proj.weight": (cfg.n_kv_heads * D, H),
                    p + "self_attn.v_proj.weight": (cfg.n_kv_heads * D, H),
                    p + "self_attn.o_proj.weight": (H, cfg.n_heads * D),
                    p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                    p + "mlp.gate.weight": (E, H)})
        if fused[i]:
            exp.update({p + "mlp.experts.gate_up_proj": (E, 2 * I, H), p + "mlp.experts.down_proj": (E, H, I)})
        else:
            for e in range(E):
                q = f"{p}mlp.experts.{e}."
                exp.update({q + "gate_proj.weight": (I, H), q + "up_proj.weight": (I, H),
                            q + "down_proj.weight": (H, I)})
        if Is:
            q = p + "mlp.shared_expert."
            exp.update({q + "gate_proj.weight": (Is, H), q + "up_proj.weight": (Is, H),
                        q + "down_proj.weight": (H, Is)})
    return exp


def _check_tensors(index: dict, exp: dict, tied: bool) -> list[str]:
    """Raise CheckpointError on a missing, mis-shaped, non-float or unexpected tensor; return the MTP names."""
    for name, shape in exp.items():
        if name not in index:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint (expected shape {list(shape)})")
        found = index[name][1]
        if tuple(found) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {found}, expected {list(shape)}")
        if index[name][2] not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {index[name][2]}; allowed: {', '.join(FLOAT_DTYPES)}")
    mtp = sorted(n for n in index if n not in exp and _MTP.search(n))
    extra = sorted(n for n in index if n not in exp and n not in mtp and not (tied and n == "lm_head.weight"))
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise CheckpointError(f"unexpected tensors in the checkpoint, not part of a Qwen3-MoE decoder: "
                              f"{extra[:5]}{more}")
    return mtp


class _Reader:
    """Reads tensors by name from the checkpoint's files, cast to (dtype, device); keeps files open while used."""

    def __init__(self, index: dict, dtype: torch.dtype, device):
        from safetensors import safe_open
        self.index, self.dtype, self.device = index, dtype, device
        self.files = {fp: safe_open(fp, framework="pt") for fp in {v[0] for v in index.values()}}

    def __call__(self, name: str) -> torch.Tensor:
        t = self.files[self.index[name][0]].get_tensor(name)
        return t.to(device=self.device, dtype=self.dtype)  # round-to-nearest-even when narrowing

    def experts(self, p: str, E: int, I: int, fused: bool):
        """(w_gate [E, I, H], w_up [E, I, H], w_down [E, H, I]) of the layer with name prefix ``p``."""
        if fused:
            gu = self(p + "mlp.experts.gate_up_proj")                                # [E, 2I, H]
            return gu[:, :I].contiguous(), gu[:, I:].contiguous(), self(p + "mlp.experts.down_proj")
        stack = lambda w: torch.stack([self(f"{p}mlp.experts.{e}.{w}_proj.weight") for e in range(E)])  # noqa: E731
        return stack("gate"), stack("up"), stack("down")


def _layer(rd: _Reader, cfg: ModelConfig, i: int, fused: bool) -> LayerWeights:
    p = f"model.layers.{i}."
    wg, wu, wd = rd.experts(p, cfg.n_experts, cfg.expert_inter, fused)
    sh = (lambda w: rd(f"{p}mlp.shared_expert.{w}_proj.weight")) if cfg.shared_expert_inter else (lambda w: None)
    return LayerWeights(
        attn_norm=rd(p + "input_layernorm.weight"), wq=rd(p + "self_attn.q_proj.weight"),
        wk=rd(p + "self_attn.k_proj.weight"), wv=rd(p + "self_attn.v_proj.weight"),
        wo=rd(p + "self_attn.o_proj.weight"), q_norm=rd(p + "self_attn.q_norm.weight"),
        k_norm=rd(p + "self_attn.k_norm.weight"), mlp_norm=rd(p + "post_attention_layernorm.weight"),
        router=rd(p + "mlp.gate.weight"), w_gate=wg, w_up=wu, w_down=wd,
        shared_gate=sh("gate"), shared_up=sh("up"), shared_down=sh("down"))


def tokenizer_for(path: str, cfg: ModelConfig):
    """The tokenizer of checkpoint folder ``path``: HFTokenizer when it has tokenizer files, else ByteTokenizer when
    ``cfg.vocab_size`` is the byte vocabulary, else None (prompts then use the byte tokenizer)."""
    if any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return HFTokenizer(path)
    return ByteTokenizer() if cfg.vocab_size == BYTE_VOCAB else None


def read_config(path: str) -> tuple[ModelConfig, bool]:
    """The ModelConfig of checkpoint folder ``path`` and whether its embeddings are tied, from config.json alone
    (no tensor is read: cheap enough to check a run's parameters before anything runs).

    Raises:
        CheckpointError: one line naming the folder or file and what is wrong: the folder does not exist, has no
            config.json, config.json is not valid JSON or not a JSON object, or a value is unsupported.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path!r} does not exist (expected a local Hugging Face "
                              f"Qwen3-MoE folder: config.json + safetensors)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path!r} has no config.json (expected a Hugging Face Qwen3-MoE checkpoint folder)")
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            d = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object of config keys, found {type(d).__name__}")
    try:
        return config_from_hf(d, name=os.path.basename(os.path.normpath(path)))
    except CheckpointError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: missing or malformed key ({type(e).__name__}: {e})") from None


def load_checkpoint(path: str, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu") -> tuple[Weights, object]:
    """Load a local Hugging Face Qwen3-MoE checkpoint folder into the engine's Weights.

    Args:
        path: folder with config.json and model.safetensors (or model.safetensors.index.json + shards).
        dtype: storage dtype of the returned weights (torch.bfloat16 or torch.float32); file tensors are cast with
            round-to-nearest-even (exact when widening, e.g. bf16 file -> fp32).
        device: where the tensors are placed.
    Returns:
        (weights, tokenizer): weights.cfg comes from config.json (``config_from_hf``); with tie_word_embeddings
        true, ``lm_head`` is the embedding tensor itself (a stored lm_head.weight is ignored, as transformers
        ties it). MTP tensors are in ``weights.extra`` (name -> tensor).
        tokenizer: HFTokenizer(path) when the folder has tokenizer files, else ByteTokenizer() when
        vocab_size == 258, else None.
    Raises:
        CheckpointError: no config.json / safetensors; an unsupported config value (names key and value); a
            missing tensor, one of the wrong shape or a non-float dtype (names tensor, expected and found); tensors
            that are not part of the model (names them); a shard named by the index but absent; a tensor stored
            in two files.
        ValueError: dtype other than torch.bfloat16 / torch.float32.
    """
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    cfg, tied = read_config(path)
    index = _tensor_index(path)
    fused = [f"model.layers.{i}.mlp.experts.gate_up_proj" in index for i in range(cfg.n_layers)]
    mtp = _check_tensors(index, expected_shapes(cfg, fused, tied), tied)
    rd = _Reader(index, dtype, device)
    embed = rd("model.embed_tokens.weight")                                          # [V, H]
    w = Weights(cfg=cfg, embed=embed, layers=[_layer(rd, cfg, i, fused[i]) for i in range(cfg.n_layers)],
                final_norm=rd("model.norm.weight"), lm_head=embed if tied else rd("lm_head.weight"))
    w.extra = {n: rd(n) for n in mtp}  # kept beside the decoder; Weights.to() does not carry it (see report)
    return w, tokenizer_for(path, cfg)


def resolve_device(device: str) -> torch.device:
    """``"cpu"`` or ``"cuda"``/``"cuda:N"`` -> torch.device.

    Raises:
        ValueError: unknown device string, or CUDA asked for where torch sees none.
    """
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but torch {torch.__version__} sees no CUDA device; "
                             f"allowed here: 'cpu'")
        return torch.device(device)
    raise ValueError(f"unknown device {device!r}; allowed: 'cpu', 'cuda', 'cuda:N'")


def resolve_dtype(dtype: str) -> torch.dtype:
    """``"bfloat16"`` or ``"float32"`` -> torch dtype. Raises ValueError naming the allowed ones."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}") from None


def load_model(preset: str, device: str, dtype: str, checkpoint: str = "", weights: str = "bf16"):
    """Weights and tokenizer for a preset (synthetic, seeded) or a local checkpoint folder, the projections
    quantized as ``weights`` says (weights.quantize_weights: ``"bf16"`` none, ``"int4_g128"``, ``"nvfp4"``).

    Returns:
        (Weights on ``device`` in ``dtype``, tokenizer or None for the byte tokenizer).
    Raises:
        ValueError: unknown preset, dtype, device (see resolve_device / resolve_dtype) or weights setting.
    """
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    if checkpoint:
        w, tok = load_checkpoint(checkpoint, dtype=dt, device=dev)
        return quantize_weights(w, weights), tok
    return synthetic_weights(get_preset(preset), dtype=dt, device=dev, weights=weights), None
