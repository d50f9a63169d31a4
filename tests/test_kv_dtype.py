"""The fp8 KV cache (cache.py: kv_dtype fp8_e4m3 with per-tensor scales, fp8_e4m3_block with one scale per
(position, kv head) row) on the tiny preset: the codec writes a row's bytes independently of its call mates and stays
within the e4m3 rounding bound; with the invariant set, batched and deep prefill (one chunk, 7-row chunks, a prompt
spanning two 256-key attention blocks) reproduce the decode oracle's prompt logits, tokens and stored codes+scales
byte for byte. Negative controls on every machine: a prompt-path write with one scale rounded one ULP up, or one code
one step off, is caught by the same KV comparison at the planted position. The fast set's differences are measured
by plain loops (tests/brute.py) and the comparisons must locate them.
"""
from __future__ import annotations

import pytest
import torch

import exactness.cache as kvc
from exactness.cache import FP8_MAX, KVCache, KVFormat, calibrate, codes_and_scales, dequantize, quantize
from exactness.exact import bytes_equal, first_differing_row, kv_first_difference
from exactness.paths import Schedule, generate
from exactness.prompt_cache import PromptCache
from exactness.prompts import build_prompt

import brute

GEN = 3
SCHEDULES = {"batched": Schedule("batched"), "batched7": Schedule("batched", 7),
             "deep": Schedule("deep", deep_threshold=4)}


@pytest.fixture(scope="module")
def ids():
    return build_prompt("code", max_tokens=40).ids


@pytest.fixture(scope="module")
def formats(tiny_weights, ids):
    """name -> KVFormat: per-tensor (scales 1.0), per-tensor calibrated on a bf16 run, per-row block scales."""
    bf16 = generate(tiny_weights, ids, GEN, "invariant", Schedule("decode"), keep_cache=True)
    return {"fp8_e4m3": KVFormat("fp8_e4m3"), "fp8_e4m3_cal": calibrate(bf16.cache),
            "fp8_e4m3_block": KVFormat("fp8_e4m3_block")}


@pytest.fixture(scope="module")
def oracles(tiny_weights, ids, formats):
    """format name -> the invariant set's decode-path run with that KV format (cache kept)."""
    return {n: generate(tiny_weights, ids, GEN, "invariant", Schedule("decode"), keep_cache=True, kv_dtype=f)
            for n, f in formats.items()}


def test_codec_rows_alone_and_error_bound():
    """A row's codes and scale do not depend on the other rows of the call; dequantized rows stay within the e4m3
    bound |x - q(x)| <= 2^-4 |x| + 2^-10 s (3 mantissa bits, subnormal step 2^-9 s) plus fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 2, 16, generator=g) * torch.logspace(-3, 2, 9)[:, None, None]).bfloat16()
    x[4] = 0                                                                        # an all-zero row: scale 1.0
    for scale in (None, 0.5):
        packed = quantize(x, scale)                                                 # [9, 2, 20] uint8
        assert packed.dtype == torch.uint8 and packed.shape == (9, 2, 20)
        assert all(bytes_equal(quantize(x[i:i + 1], scale), packed[i:i + 1]) for i in range(9))
        codes, s = codes_and_scales(packed)
        err = (dequantize(packed) - x.float()).abs()
        bound = x.float().abs() * (2 ** -4 + 2 ** -22) + s[..., None] * 2 ** -10
        excess = err - bound
        assert (excess <= 0).all(), (f"scale {scale}: max excess {float(excess.max())} at "
                                     f"{tuple(int(i) for i in torch.unravel_index(excess.argmax(), err.shape))}, "
                                     f"{int((excess > 0).sum())} elements over the bound")
    codes, s = codes_and_scales(quantize(x))
    nz = x.float().abs().amax(-1) > 0
    assert bool((codes.float().abs().amax(-1)[nz] == FP8_MAX).all())              # amax maps to 448 exactly
    assert bool((s[~nz] == 1.0).all())


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_cal", "fp8_e4m3_block"])
@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_invariant_fp8_prefill_equals_the_decode_oracle(tiny_weights, ids, formats, oracles, fmt, sched):
    oracle = oracles[fmt]
    run = generate(tiny_weights, ids, GEN, "invariant", SCHEDULES[sched], keep_cache=True, kv_dtype=formats[fmt])
    assert run.kv_dtype == formats[fmt].dtype and run.cache.k[0].dtype == torch.uint8
    assert bytes_equal(run.prompt_logits, oracle.prompt_logits)
    assert bytes_equal(run.gen_logits, oracle.gen_logits) and torch.equal(run.gen_ids, oracle.gen_ids)
    assert run.cache.lengths[0] == ids.numel() + GEN - 1 and kv_first_difference(run.cache, oracle.cache) is None
    _, scales = codes_and_scales(run.cache.k[1][0, :run.cache.lengths[0]])         # [n, Hkv] fp32
    if formats[fmt].dtype == "fp8_e4m3":                                            # one scale for the tensor
        assert bool((scales == formats[fmt].tensor_scale("k", 1)).all())


def test_invariant_fp8_two_attention_blocks(tiny_weights):
    """A prompt past 256 positions: the decode rows and the prompt rows read the fp8 cache in the same two blocks."""
    ids = build_prompt("docs", max_tokens=300).ids
    assert ids.numel() > 256
    oracle = generate(tiny_weights, ids, 1, "invariant", Schedule("decode"), keep_cache=True, kv_dtype="fp8_e4m3_block")
    run = generate(tiny_weights, ids, 1, "invariant", Schedule("batched", 100), keep_cache=True,
                   kv_dtype="fp8_e4m3_block")
    assert bytes_equal(run.prompt_logits, oracle.prompt_logits)
    assert kv_first_difference(run.cache, oracle.cache) is None


def test_fp8_changes_the_run(tiny_weights, ids, oracles):
    """The setting takes effect: fp8 logits are not the bf16 cache's (quantization error, any CPU)."""
    bf16 = generate(tiny_weights, ids, GEN, "invariant", Schedule("decode"))
    for run in oracles.values():
        assert first_differing_row(run.prompt_logits, bf16.prompt_logits) is not None


def _faulty_quantize(kind: str):
    """quantize, except on calls of more than one row (the prompt path): row 1's first-head scale is one ULP larger
    (kind "scale"), or its first code one step towards zero (kind "code")."""
    good = kvc.quantize

    def q(x, scale=None):
        packed = good(x, scale)
        if x.shape[0] > 1:
            packed = packed.clone()
            if kind == "scale":
                packed[1, 0, -4:] = (packed[1, 0, -4:].view(torch.int32) + 1).view(torch.uint8)
            else:
                c = packed[1, 0, 0]
                packed[1, 0, 0] = c - 1 if c & 0x7F else c + 1          # zero becomes the smallest subnormal
        return packed
    return q


@pytest.mark.parametrize("kind", ["scale", "code"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_block"])
def test_planted_prompt_write_fault_is_caught(tiny_weights, ids, formats, oracles, monkeypatch, kind, fmt):
    monkeypatch.setattr(kvc, "quantize", _faulty_quantize(kind))
    run = generate(tiny_weights, ids, GEN, "invariant", Schedule("batched"), keep_cache=True, kv_dtype=formats[fmt])
    assert kv_first_difference(run.cache, oracles[fmt].cache) == 1
    assert brute.first_kv_position(run.cache, oracles[fmt].cache) == 1


def test_fast_fp8_differences_located(tiny_weights, ids):
    """The fast set (its prompt attention differs from its decode attention on some CPUs): plain loops measure,
    the comparisons must locate the same first row and position."""
    oracle = generate(tiny_weights, ids, GEN, "fast", Schedule("decode"), keep_cache=True, kv_dtype="fp8_e4m3_block")
    run = generate(tiny_weights, ids, GEN, "fast", Schedule("batched", 7), keep_cache=True,
                   kv_dtype="fp8_e4m3_block")
    assert first_differing_row(run.prompt_logits, oracle.prompt_logits) == \
        brute.first_row(run.prompt_logits, oracle.prompt_logits)
    assert kv_first_difference(run.cache, oracle.cache) == brute.first_kv_position(run.cache, oracle.cache)


def test_snapshot_restore_and_prompt_cache_keep_codes_and_scales(tiny_weights, ids, oracles):
    cache = oracles["fp8_e4m3_block"].cache
    n = cache.lengths[0]
    state = cache.snapshot(0)
    assert state.k[0].dtype == torch.uint8 and state.k[0].shape[-1] == tiny_weights.cfg.head_dim + 4
    fresh = KVCache(tiny_weights.cfg, cache.capacity, 1, tiny_weights.dtype, kv_dtype="fp8_e4m3_block")
    fresh.restore(state, 0)
    assert kv_first_difference(fresh, cache) is None
    assert kv_first_difference(cache.select(0), cache) is None
    pc = PromptCache(0.01, "any")
    key, = pc.store(ids, cache, 0)                                                  # the state at the prompt's end
    kept = pc.get(key, torch.cat([ids, ids[:1]])).state
    assert all(bytes_equal(a, b[:ids.numel()]) for a, b in zip(kept.k + kept.v, state.k + state.v))
    fresh.k[1][0, n - 1, 1, -1] ^= 1                                                # one scale byte: caught
    assert kv_first_difference(fresh, cache) == n - 1
    bf16 = KVCache(tiny_weights.cfg, cache.capacity, 1, tiny_weights.dtype)
    with pytest.raises(ValueError, match="fp8_e4m3_block|bf16"):
        bf16.restore(state, 0)


def test_bad_kv_settings(tiny_weights):
    cfg = tiny_weights.cfg
    with pytest.raises(ValueError, match="unknown kv_dtype 'fp8'.*fp8_e4m3_block"):
        KVCache(cfg, 8, kv_dtype="fp8")
    with pytest.raises(ValueError, match="2 layers"):
        KVCache(cfg, 8, kv_dtype=KVFormat("fp8_e4m3", (1.0,), None))
    with pytest.raises(ValueError, match="positive finite"):
        KVFormat("fp8_e4m3", (1.0, 0.0))
    with pytest.raises(ValueError, match="per-tensor"):
        KVFormat("fp8_e4m3_block", (1.0, 1.0))
    with pytest.raises(ValueError, match="bf16 cache"):
        calibrate(KVCache(cfg, 8, kv_dtype="fp8_e4m3"))
