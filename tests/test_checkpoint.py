"""Fidelity with Hugging Face transformers' Qwen3-MoE, and the checkpoint loader's refusals.

A tiny ``Qwen3MoeForCausalLM`` is built from a ``Qwen3MoeConfig`` (random, seeded; nothing downloaded), saved with
``save_pretrained`` (sharded, per-expert tensor names) and loaded with ``load_checkpoint(dtype=torch.float32)``.
Over the ``code`` prompt cut to 300 tokens, our fast-kernel ``batched`` and ``decode`` paths must give HF's fp32
logits for every prompt row and every generated row within ``tolerance`` and HF's greedy tokens exactly.

Tolerance (``tolerance`` below):  tol = lambda * sqrt(n) * (L + 1) * u * max|logit_HF|,  u = 2^-24, lambda = 4,
n = the longest reduction in the forward (max of H, Hq*D, I, E and the number of attended keys), L = layers.
Both implementations compute the same formulas in fp32 but with different reduction orders (eager matmul vs
scaled_dot_product_attention, index_add over experts vs einsum over slots, ...), so they differ by rounding only.
The probabilistic rounding-error bound for an inner product of length n (Higham & Mary, SIAM J. Sci. Comput. 41(5),
2019, Thm 3.1: |error| <= lambda*sqrt(n)*u*sum|a_i b_i| with probability >= 1 - 2n exp(-lambda^2 (1-u)^2 / 2),
so lambda = 4 fails with probability < 1e-3 per reduction of n = 300) is taken per stage and added over the L
layers plus the head, relative to the logit scale max|logit|. This is a calibrated heuristic, not a certified
bound: a worst-case bound through softmax, SiLU and the normalisations would be vacuous. It is checked from both
sides here: the measured difference sits ~20x below it, and the negative control (one weight changed by one bf16
ulp, 2^-8 relative) lands above it.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Qwen3MoeForCausalLM  # noqa: E402

from exactness import paths  # noqa: E402
from exactness.engines.tiny import build_tiny_qwen3_moe  # noqa: E402
from exactness.checkpoint import CheckpointError, config_from_hf, load_checkpoint  # noqa: E402
from exactness.exact import bytes_equal, first_differing_row  # noqa: E402
from exactness.prompts import build_prompt  # noqa: E402
from exactness.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402

U = 2.0 ** -24  # fp32 unit round-off
LAMBDA = 4.0
PROMPT_TOKENS, GEN_TOKENS = 300, 32
# The tiny model of engines/tiny.py, with eager attention and experts: the reference implementations.
EAGER = dict(attn_implementation="eager", experts_implementation="eager")


def build_hf(seed: int = 0, **overrides) -> Qwen3MoeForCausalLM:
    """The seeded random tiny Qwen3MoeForCausalLM (engines/tiny.py) in fp32, eager implementations."""
    return build_tiny_qwen3_moe(seed, **EAGER, **overrides)


def tolerance(ref_logits: torch.Tensor, cfg, n_keys: int) -> float:
    """lambda * sqrt(n) * (L + 1) * u * max|ref| (module docstring); ref_logits [R, V] fp32, n_keys attended keys."""
    n = max(cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.expert_inter, cfg.n_experts, n_keys)
    return LAMBDA * math.sqrt(n) * (cfg.n_layers + 1) * U * float(ref_logits.abs().max())


def logit_check(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> tuple[bool, str]:
    """(all |ours - ref| <= tol, message with max, argmax (row, id), count over tol); both [R, V] fp32."""
    d = (ours.float() - ref.float()).abs()
    row, col = divmod(int(d.argmax()), d.shape[1])
    over = int((d > tol).sum())
    msg = (f"max|diff|={float(d.max()):.3e} at (row {row}, id {col}), tol={tol:.3e} "
           f"(ratio {float(d.max()) / tol:.3f}), {over} of {d.numel()} over tol")
    return over == 0, msg


def _shard_of(ck: Path, name: str) -> Path:
    index = ck / "model.safetensors.index.json"
    if not index.exists():
        return ck / "model.safetensors"
    first = sorted(ck.glob("model-*.safetensors"))[0].name  # where added tensors go
    return ck / json.loads(index.read_text())["weight_map"].get(name, first)


def edit_tensor(ck: Path, name: str, value: torch.Tensor | None) -> None:
    """Rewrite the safetensors shard holding ``name`` with it replaced (value), removed (None) or added."""
    f = _shard_of(ck, name)
    tensors = load_file(f)
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value.contiguous()
    save_file(tensors, f, metadata={"format": "pt"})


def edit_config(ck: Path, **changes) -> None:
    d = json.loads((ck / "config.json").read_text())
    d.update(changes)
    (ck / "config.json").write_text(json.dumps(d))


@pytest.fixture(scope="module")
def hf_model():
    return build_hf(seed=0)


@pytest.fixture(scope="module")
def ckpt(hf_model, tmp_path_factory) -> Path:
    """The model saved by save_pretrained, sharded (index + several files), per-expert tensor names."""
    d = tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe"
    hf_model.save_pretrained(d, max_shard_size="100KB")
    return d


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load_checkpoint(str(ckpt), dtype=torch.float32)


@pytest.fixture(scope="module")
def prompt_ids() -> torch.Tensor:
    return build_prompt("code", PROMPT_TOKENS).ids                                  # [300] int64


@pytest.fixture(scope="module")
def hf_ref(hf_model, prompt_ids):
    """HF prompt logits [P, V], greedy ids [N] and the logits each was chosen from [N, V] (EOS not a stop)."""
    with torch.no_grad():
        prompt_logits = hf_model(prompt_ids[None]).logits[0].float()
        out = hf_model.generate(prompt_ids[None], max_new_tokens=GEN_TOKENS, do_sample=False, eos_token_id=None,
                                return_dict_in_generate=True, output_logits=True)
    gen_ids = out.sequences[0, prompt_ids.numel():]
    assert gen_ids.numel() == GEN_TOKENS, f"HF generated {gen_ids.numel()} tokens, expected {GEN_TOKENS}"
    return {"prompt": prompt_logits, "gen_ids": gen_ids, "gen": torch.cat(out.logits).float()}


@pytest.fixture(scope="module")
def ours(loaded, prompt_ids):
    w, _ = loaded
    return {p: paths.generate(w, prompt_ids, GEN_TOKENS, "fast", paths.Schedule(p)) for p in ("batched", "decode")}


# ---------------------------------------------------------------- the mapping
def test_config_and_tokenizer_mapping(ckpt, loaded):
    w, tok = loaded
    c = w.cfg
    got = (c.vocab_size, c.hidden, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.n_experts, c.top_k,
           c.expert_inter, c.shared_expert_inter, c.norm_topk_prob, c.max_positions, c.rope_theta, c.rms_eps,
           c.bos_id, c.eos_id)
    assert got == (258, 64, 2, 4, 2, 16, 8, 2, 32, 0, True, 4096, 1e6, 1e-6, 256, 257)
    assert "num_local_experts" in json.loads((ckpt / "config.json").read_text())  # what transformers 5 writes
    assert len(list(ckpt.glob("model-*.safetensors"))) > 1, "the fixture should exercise the sharded layout"
    assert isinstance(tok, ByteTokenizer)  # no tokenizer files and vocab 258
    assert w.dtype == torch.float32 and w.extra == {}


def test_bf16_load_rounds_the_file_tensors(ckpt, loaded):
    """dtype=bf16 gives the fp32 file tensors rounded to nearest even (torch's cast), byte for byte."""
    wb, _ = load_checkpoint(str(ckpt), dtype=torch.bfloat16)
    w, _ = loaded
    for name, a, b in [("embed", w.embed, wb.embed), ("layer 1 w_down", w.layers[1].w_down, wb.layers[1].w_down)]:
        assert bytes_equal(a.to(torch.bfloat16), b), name


def test_fused_expert_layout_loads_same_bytes(hf_model, ckpt, loaded, tmp_path):
    """transformers 5's in-memory layout (gate_up_proj [E, 2I, H], down_proj [E, H, I]) gives the same weights."""
    sd = hf_model.state_dict()
    assert tuple(sd["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 64, 64)
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    wf, _ = load_checkpoint(str(tmp_path), dtype=torch.float32)
    w, _ = loaded
    for i, (a, b) in enumerate(zip(w.layers, wf.layers)):
        for f in ("w_gate", "w_up", "w_down", "wq", "router"):
            ta, tb = getattr(a, f), getattr(b, f)
            assert bytes_equal(ta, tb), f"layer {i} {f} differs between layouts"


# ---------------------------------------------------------------- (a) logits
@pytest.mark.parametrize("path", ["batched", "decode"])
def test_prompt_logits_match_hf(ours, hf_ref, loaded, path):
    tol = tolerance(hf_ref["prompt"], loaded[0].cfg, PROMPT_TOKENS)
    ok, msg = logit_check(ours[path].prompt_logits, hf_ref["prompt"], tol)
    print(f"prompt logits, {path}: {msg}")
    assert ok, f"{path} prompt logits vs HF: {msg}"


@pytest.mark.parametrize("path", ["batched", "decode"])
def test_generated_logits_match_hf(ours, hf_ref, loaded, path):
    assert torch.equal(ours[path].gen_ids, hf_ref["gen_ids"]), "token mismatch: see the greedy-token test"
    tol = tolerance(hf_ref["gen"], loaded[0].cfg, PROMPT_TOKENS + GEN_TOKENS)
    ok, msg = logit_check(ours[path].gen_logits, hf_ref["gen"], tol)
    print(f"generated-row logits, {path}: {msg}")
    assert ok, f"{path} generated-row logits vs HF: {msg}"


def test_negative_control_one_bf16_ulp_is_caught(ckpt, hf_ref, prompt_ids):
    """One layer-0 value-projection weight moved by one bf16 ulp (2^-8 relative) must fail the logit check."""
    w, _ = load_checkpoint(str(ckpt), dtype=torch.float32)
    wv = w.layers[0].wv
    wv[0, 0] += abs(float(wv[0, 0])) * 2.0 ** -8
    run = paths.generate(w, prompt_ids, 1, "fast", paths.Schedule("batched"))
    ok, msg = logit_check(run.prompt_logits, hf_ref["prompt"], tolerance(hf_ref["prompt"], w.cfg, PROMPT_TOKENS))
    print(f"negative control: {msg}")
    assert not ok, f"a one-bf16-ulp weight change went unnoticed: {msg}"


# ---------------------------------------------------------------- (b) greedy tokens
@pytest.mark.parametrize("path", ["batched", "decode"])
def test_greedy_tokens_match_hf(ours, hf_ref, loaded, path):
    ref, got = hf_ref["gen_ids"], ours[path].gen_ids
    top2 = hf_ref["gen"].topk(2, dim=-1).values                                     # [N, 2]
    margins = top2[:, 0] - top2[:, 1]
    tol = tolerance(hf_ref["gen"], loaded[0].cfg, PROMPT_TOKENS + GEN_TOKENS)
    i = first_differing_row(got, ref)
    if i is not None:
        why = "explained (margin below tol)" if float(margins[i]) <= tol else "NOT explained by rounding"
        pytest.fail(f"{path}: first divergence at generated index {i}: ours {int(got[i])}, HF {int(ref[i])}, "
                    f"HF top-1/top-2 margin {float(margins[i]):.3e} vs tol {tol:.3e}: {why}")
    assert float(margins.min()) > tol, f"seed gives a margin {float(margins.min()):.3e} below tol {tol:.3e}"


def test_tied_embeddings_reuse_embed(tmp_path):
    """tie_word_embeddings=true: lm_head is the embedding tensor, and the logits still match HF's."""
    model = build_hf(seed=3, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    w, _ = load_checkpoint(str(tmp_path), dtype=torch.float32)
    assert w.lm_head is w.embed
    ids = build_prompt("short").ids
    with torch.no_grad():
        ref = model(ids[None]).logits[0].float()
    ok, msg = logit_check(paths.generate(w, ids, 1, "fast", paths.Schedule("batched")).prompt_logits, ref,
                          tolerance(ref, w.cfg, ids.numel()))
    assert ok, f"tied model: {msg}"


# ---------------------------------------------------------------- (c), (d): damaged checkpoints
@pytest.fixture
def copy_ckpt(ckpt, tmp_path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(ckpt, dst)
    return dst


def test_missing_tensor_is_named(copy_ckpt):
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    edit_tensor(copy_ckpt, name, None)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(copy_ckpt), dtype=torch.float32)
    assert name in str(e.value) and "missing" in str(e.value) and "[32, 64]" in str(e.value)


def test_wrong_shape_is_named(copy_ckpt):
    name = "model.layers.0.self_attn.k_norm.weight"
    edit_tensor(copy_ckpt, name, torch.ones(15))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(copy_ckpt), dtype=torch.float32)
    msg = str(e.value)
    assert name in msg and "[15]" in msg and "expected [16]" in msg, msg


def test_unexpected_tensor_is_refused_and_mtp_kept(copy_ckpt):
    edit_tensor(copy_ckpt, "mtp.fc.weight", torch.ones(64, 128))
    w, _ = load_checkpoint(str(copy_ckpt), dtype=torch.float32)
    assert list(w.extra) == ["mtp.fc.weight"] and tuple(w.extra["mtp.fc.weight"].shape) == (64, 128)
    name = "model.layers.0.mlp.shared_expert_gate.weight"  # Qwen2-MoE's sigmoid gate: not modelled
    edit_tensor(copy_ckpt, name, torch.ones(1, 64))
    with pytest.raises(CheckpointError, match="unexpected tensors") as e:
        load_checkpoint(str(copy_ckpt), dtype=torch.float32)
    assert name in str(e.value)


def test_tokenizer_choice(copy_ckpt):
    """Tokenizer files -> HFTokenizer; none and vocab != 258 -> None."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "def": 3, "x": 4}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>") \
        .save_pretrained(copy_ckpt)
    _, tok = load_checkpoint(str(copy_ckpt), dtype=torch.float32)
    assert isinstance(tok, HFTokenizer) and tok.encode("def x").tolist() == [3, 4]
    for f in copy_ckpt.glob("tokenizer*"):
        f.unlink()
    edit_config(copy_ckpt, vocab_size=300)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        edit_tensor(copy_ckpt, name, torch.zeros(300, 64))
    w, tok = load_checkpoint(str(copy_ckpt), dtype=torch.bfloat16)
    assert tok is None and w.cfg.vocab_size == 300 and w.dtype == torch.bfloat16


# ---------------------------------------------------------------- (e) unsupported config values
UNSUPPORTED = [
    ("decoder_sparse_step", 2),
    ("mlp_only_layers", [1]),
    ("attention_bias", True),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
    ("hidden_act", "gelu"),
    ("use_sliding_window", True),
    ("model_type", "qwen2_moe"),
    ("quantization_config", {"quant_method": "fp8"}),
]


@pytest.mark.parametrize("key,value", UNSUPPORTED, ids=[k for k, _ in UNSUPPORTED])
def test_unsupported_config_value_is_named(ckpt, key, value):
    d = {**json.loads((ckpt / "config.json").read_text()), key: value}
    with pytest.raises(CheckpointError) as e:
        config_from_hf(d)
    assert f"{key}={value!r}" in str(e.value), str(e.value)


def test_unsupported_rope_type_refused_on_load(copy_ckpt):
    edit_config(copy_ckpt, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    with pytest.raises(CheckpointError, match=r"rope_parameters.rope_type='yarn'"):
        load_checkpoint(str(copy_ckpt))
