"""Packed multi-prompt prefill (batch.prefill_packed / run_packed) on the tiny preset: three prompts of different
lengths (72 rows in all, so the deep plan's 64-row tiles span two prompts) in one forward. With the invariant set each
packed prompt's prompt logits, generated tokens and logits, and KV bytes (bf16 and fp8 caches) equal its prefill
alone and the serial decode oracle. Negative control on every machine: a packed attention that lets each sequence
see one key of the sequence packed before it is caught by the same comparisons, from row 0 and position 0 of the
second and third prompts, while the first prompt stays equal. The fast set's differences are measured by plain loops
(tests/brute.py) and the comparisons must locate them.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from exactness.batch import prefill_packed, run_packed
from exactness.cache import KVCache
from exactness.exact import bytes_equal, first_differing_row, kv_first_difference
from exactness.kernels import KernelSet, get_set
from exactness.paths import Schedule, generate
from exactness.prompts import build_prompt

import brute

GEN = 3
LENGTHS = (("code", 40), ("short", 9), ("docs", 23))


@pytest.fixture(scope="module")
def prompts():
    return [build_prompt(name, max_tokens=n).ids for name, n in LENGTHS]


def _alone(w, prompts, kernels, schedule, kv_dtype):
    return [generate(w, p, GEN, kernels, schedule, keep_cache=True, kv_dtype=kv_dtype) for p in prompts]


def _same(a, b) -> bool:
    """Prompt logits, generated tokens and logits, and the KV cache's bytes all equal."""
    return (bytes_equal(a.prompt_logits, b.prompt_logits) and bytes_equal(a.gen_logits, b.gen_logits)
            and torch.equal(a.gen_ids, b.gen_ids) and kv_first_difference(a.cache, b.cache) is None)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3_block"])
@pytest.mark.parametrize("plan", ["batched", "deep"])
def test_invariant_packed_equals_alone_and_oracle(tiny_weights, prompts, kv_dtype, plan):
    packed = run_packed(tiny_weights, prompts, GEN, "invariant", plan, keep_cache=True, kv_dtype=kv_dtype)
    alone = _alone(tiny_weights, prompts, "invariant", Schedule(plan, deep_threshold=1), kv_dtype)
    oracle = _alone(tiny_weights, prompts, "invariant", Schedule("decode"), kv_dtype)
    for p, r, a, o in zip(prompts, packed, alone, oracle):
        assert r.path == "packed" and r.served[plan]["rows"] == p.numel() and r.served["packed"]["rows"] == 72
        assert r.kv_dtype == kv_dtype and r.cache.lengths[0] == p.numel() + GEN - 1
        assert _same(r, a) and _same(r, o)


def test_packed_slots_any_order(tiny_weights, prompts):
    """Prompts placed in slots 2, 0, 1 of one cache give the bytes of the default placement."""
    outs = []
    for slots in (None, [2, 0, 1]):
        cache = KVCache(tiny_weights.cfg, 40, 3, tiny_weights.dtype)
        outs.append(prefill_packed(tiny_weights, cache, prompts, "invariant", slots=slots))
    assert all(bytes_equal(a.logits, b.logits) for a, b in zip(*outs))


def _leaky(fn):
    """Attention where every sequence after the first in a call also sees the last key (and value) of the sequence
    before it, as a varlen kernel with a sequence boundary one row off would."""
    def attention(q, k_cache, v_cache, slots, positions):
        out = fn(q, k_cache, v_cache, slots, positions)
        seq = torch.unique_consecutive(slots).tolist()
        for prev, s in zip(seq, seq[1:]):
            last = int(positions[slots == prev].max())
            rows = (slots == s).nonzero().flatten()
            k = torch.cat([k_cache[prev, last:last + 1], k_cache[s]])[None]         # [1, T + 1, Hkv, X]
            v = torch.cat([v_cache[prev, last:last + 1], v_cache[s]])[None]
            out[rows] = fn(q[rows], k, v, torch.zeros_like(rows), positions[rows] + 1)
        return out
    return attention


def leaky_set() -> KernelSet:
    """The invariant set with the leaking prompt attention (not registered)."""
    ks = get_set("invariant")
    prompt = dict(ks.prompt, attention=replace(ks.prompt["attention"], fn=_leaky(ks.prompt["attention"].fn)))
    return KernelSet("invariant+leaky-packed-attention", ks.decode, prompt, False, "test-only fault")


def test_planted_packed_leak_is_caught(tiny_weights, prompts):
    ks = leaky_set()
    packed = run_packed(tiny_weights, prompts, GEN, ks, keep_cache=True)
    alone = _alone(tiny_weights, prompts, ks, Schedule("batched"), "bf16")      # one sequence per call: no leak
    assert _same(packed[0], alone[0])
    for r, a in zip(packed[1:], alone[1:]):
        assert first_differing_row(r.prompt_logits, a.prompt_logits) == 0
        assert brute.first_row(r.prompt_logits, a.prompt_logits) == 0
        assert kv_first_difference(r.cache, a.cache) == 0 == brute.first_kv_position(r.cache, a.cache)


def test_fast_packed_differences_located(tiny_weights, prompts):
    packed = run_packed(tiny_weights, prompts, GEN, "fast", keep_cache=True)
    alone = _alone(tiny_weights, prompts, "fast", Schedule("batched"), "bf16")
    for r, a in zip(packed, alone):
        assert first_differing_row(r.prompt_logits, a.prompt_logits) == brute.first_row(r.prompt_logits,
                                                                                        a.prompt_logits)
        assert kv_first_difference(r.cache, a.cache) == brute.first_kv_position(r.cache, a.cache)


def test_bad_packed_input(tiny_weights, prompts):
    w = tiny_weights
    cache = KVCache(w.cfg, 40, 3, w.dtype)
    with pytest.raises(ValueError, match="at least one prompt"):
        prefill_packed(w, cache, [], "invariant")
    with pytest.raises(ValueError, match="unknown packed plan 'decode'"):
        prefill_packed(w, cache, prompts, "invariant", "decode")
    with pytest.raises(ValueError, match="distinct slots"):
        prefill_packed(w, cache, prompts, "invariant", slots=[0, 0, 1])
    with pytest.raises(ValueError, match="empty"):
        prefill_packed(w, cache, [prompts[0], prompts[0][:0]], "invariant")
    prefill_packed(w, cache, prompts[:1], "invariant")
    with pytest.raises(ValueError, match=r"slots \[0\] already hold"):
        prefill_packed(w, cache, prompts[:1], "invariant")
    with pytest.raises(ValueError, match="batch limit"):
        run_packed(w, prompts * 2, 1, "invariant")
