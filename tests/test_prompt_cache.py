"""Prompt cache: resumed == fresh on and off the step grid with the invariant set (tokens, logits bytes of the tail
and generated rows, KV bytes); negative controls (the fast set off the grid, a batch-composition-dependent kernel);
LRU-by-bytes eviction; exact prefix matching; bad input.

Tiny preset, bf16, CPU; the `code` prompt cut to 70 tokens, prefilled in chunks of STEP = 16 rows."""

import pytest
import torch

from exactness.analysis.streams import resume_points
from exactness.cache import KVCache
from exactness.exact import first_differing_row, kv_first_difference

from exactness.paths import Schedule, generate
from exactness.prompt_cache import GIB, PromptCache, generate_cached, prefix_key
import brute
from faults import row0_rmsnorm_perturbed
from exactness.prompts import build_prompt

GEN, STEP = 6, 16


@pytest.fixture(scope="module")
def ids():
    return build_prompt("code", max_tokens=70).ids





def resume(w, ids, ks, mode, step=STEP):
    """(fresh run, resumed run, resume point): an earlier request leaves the state, the full prompt resumes."""
    split = resume_points(ids.numel(), step)[mode]
    pc = PromptCache(1.0, mode, step)
    generate_cached(w, pc, ids[:ids.numel() - 1 if mode == "grid" else split], 1, ks, Schedule("batched", step))
    run = generate_cached(w, pc, ids, GEN, ks, Schedule("batched", step), keep_cache=True)
    fresh = generate(w, ids, GEN, ks, Schedule("batched", step), keep_cache=True)
    return fresh, run, split


def diffs(fresh, run):
    """(first differing token, tail row, generated-logits row, KV position); all None when resumed == fresh."""
    tail = first_differing_row(run.prompt_logits, fresh.prompt_logits[run.prompt_start:])
    return (first_differing_row(run.gen_ids, fresh.gen_ids), tail,
            first_differing_row(run.gen_logits, fresh.gen_logits), kv_first_difference(run.cache, fresh.cache))


@pytest.mark.parametrize("mode", ["grid", "any"])
def test_resumed_equals_fresh_invariant(tiny_weights, ids, mode):
    fresh, run, split = resume(tiny_weights, ids, "invariant", mode)
    assert run.prompt_start == split and (split % STEP == 0) == (mode == "grid")
    assert run.prompt_logits.shape[0] == ids.numel() - split  # only the tail was prefilled
    assert diffs(fresh, run) == (None, None, None, None)


def test_fast_set_equal_on_grid_and_measured_off_grid(tiny_weights, ids):
    """The fast set (no exactness claim): on the grid the tail chunks start where a fresh run's do, so even the fast
    set resumes exactly, on any CPU. Off the grid its chunk-shape-dependent kernels may change the tail, and whether
    they do depends on the CPU's instruction set: measured first by plain loops (tests/brute.py), the comparisons
    must agree with the measurement (the same first differing tail row and KV position, or none). That they can fail
    is shown by the planted fault of the next test, on every machine."""
    fresh, run, _ = resume(tiny_weights, ids, "fast", "grid", step=24)
    assert diffs(fresh, run) == (None, None, None, None)
    fresh, run, split = resume(tiny_weights, ids, "fast", "any", step=24)
    _, tail_row, _, kv_pos = diffs(fresh, run)
    assert split == 35
    assert tail_row == brute.first_row(run.prompt_logits, fresh.prompt_logits[split:])
    assert kv_pos == brute.first_kv_position(run.cache, fresh.cache)
    if kv_pos is not None:
        assert kv_pos >= split, "positions before the resume point come from the shared prefix"


def test_batch_dependent_kernel_caught_off_grid(tiny_weights, ids):
    """Negative control: a kernel whose row 0 differs resumes exactly on the grid and is caught off it, at the
    resume point itself (the tail's first row is row 0 of its chunk; in a fresh run it is not)."""
    ks = row0_rmsnorm_perturbed()
    fresh, run, _ = resume(tiny_weights, ids, ks, "grid")
    assert diffs(fresh, run) == (None, None, None, None)
    fresh, run, split = resume(tiny_weights, ids, ks, "any")
    _, tail_row, _, kv_pos = diffs(fresh, run)
    assert (tail_row, kv_pos) == (0, split)


def _filled_cache(cfg, n=64):
    c = KVCache(cfg, n, 1)
    g = torch.Generator().manual_seed(1)
    for t in c.k + c.v:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    c.lengths[0] = n
    return c


def test_lru_by_bytes_eviction(tiny_weights):
    cfg, ids = tiny_weights.cfg, torch.arange(64)
    cache = _filled_cache(cfg)
    one = cache.snapshot(0, 16).nbytes()
    pc = PromptCache(2.5 * one / GIB, "any")  # room for two 16-token states
    a, b = pc.store(ids[:16], cache), pc.store(ids[1:17], cache)
    assert pc.lookup(torch.cat([ids[:16], ids[:1]])).key == a[0]  # hit: a becomes the most recently used
    c = pc.store(ids[2:18], cache)
    assert pc.keys() == [a[0], c[0]] and pc.stats["evicted"] == 1 and pc.nbytes <= pc.budget_bytes
    assert b[0] not in pc.keys()
    big = PromptCache(0.5 * one / GIB, "any")
    assert big.store(ids[:16], cache) == [] and big.stats["rejected"] == 1


def test_grid_mode_keeps_step_multiples_only(tiny_weights):
    cache, ids = _filled_cache(tiny_weights.cfg), torch.arange(64)
    pc = PromptCache(1.0, "grid", 16)
    pc.store(ids[:40], cache)
    assert pc.keys() == [prefix_key(ids[:16]), prefix_key(ids[:32])]
    assert pc.lookup(ids[:33]).length == 32 and pc.lookup(ids[:32]).length == 16  # a resume keeps >= 1 tail row


def test_budget_zero_disables(tiny_weights):
    cache, ids = _filled_cache(tiny_weights.cfg), torch.arange(64)
    pc = PromptCache(0, "any")
    assert not pc.enabled and pc.store(ids[:16], cache) == [] and pc.lookup(ids[:20]) is None


@pytest.mark.parametrize("budget", [-1, -0.5, float("nan"), float("inf"), "1", True])
def test_bad_budget_is_refused(budget):
    with pytest.raises(ValueError, match="budget"):
        PromptCache(budget, "any")


def test_bad_mode_or_grid_without_step_is_refused():
    with pytest.raises(ValueError, match="unknown prompt cache mode 'exact'"):
        PromptCache(1.0, "exact")
    with pytest.raises(ValueError, match="grid mode needs the step"):
        PromptCache(1.0, "grid", None)


def test_mismatched_prefix_is_never_reused(tiny_weights, ids):
    cache = _filled_cache(tiny_weights.cfg)
    pc = PromptCache(1.0, "any")
    key = pc.store(ids[:20], cache)[0]
    other = ids.clone()
    other[5] = (int(other[5]) + 1) % 256
    assert pc.lookup(other) is None  # same length, different token 5: a miss, not a reuse
    with pytest.raises(ValueError, match="token 5 is"):
        pc.get(key, other)
    with pytest.raises(ValueError, match="does not match the prompt"):
        generate_cached(tiny_weights, pc, other, 2, "invariant", Schedule("batched", STEP), resume_key=key)
    with pytest.raises(ValueError, match="no cached prompt state"):
        pc.get("20:0000", ids)
