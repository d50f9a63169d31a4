"""The KV-cache store: one launch (kernels/triton_cache.py) puts every row's bytes where indexing would, and the
cache falls back to indexing wherever the store does not serve.

Byte claims compare integer views. The GPU and interpreter tests compare the Triton store with indexing assignment
on caches of every element size the cache uses (bf16, fp32, packed fp8 uint8), several slots and rows in any order,
and each has a planted fault (rows stored one position off) that the same comparison must catch.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from exactness.cache import KVCache
from exactness.kernels import cache_store
from exactness import paths
from exactness.model import forward, forward_span
from interpreted import HAS_TRITON, NEEDS_TRITON, interpreted_rows

GPU = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA device and Triton")
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _case(dtype: torch.dtype, device: str, seed: int = 0):
    """Caches [3, 40, 2, 6] of ``dtype`` holding random bytes, rows [25, 2, 6] for distinct (slot, position)s."""
    g = torch.Generator().manual_seed(seed)
    it = _INTS[torch.empty(0, dtype=dtype).element_size()]
    shape = (3, 40, 2, 6)
    lo, hi = (0, 256) if it == torch.uint8 else (-2 ** 14, 2 ** 14)
    kc, vc = (torch.randint(lo, hi, shape, generator=g, dtype=it).view(dtype).to(device) for _ in range(2))
    k, v = (torch.randint(lo, hi, (25, 2, 6), generator=g, dtype=it).view(dtype).to(device) for _ in range(2))
    where = torch.randperm(3 * 40, generator=g)[:25]
    return kc, vc, (where // 40).to(device), (where % 40).to(device), k, v


def store_mismatches(store, dtype: torch.dtype, device: str, shift: int = 0) -> int:
    """Elements of the two caches where ``store`` (rows at positions + shift) and indexing assignment differ."""
    kc, vc, slots, pos, k, v = _case(dtype, device)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k[slots, pos], ref_v[slots, pos] = k, v
    store(kc, vc, slots, (pos + shift) % kc.shape[1], k, v)
    it = _INTS[kc.element_size()]
    return int((kc.view(it) != ref_k.view(it)).sum() + (vc.view(it) != ref_v.view(it)).sum())


def test_write_uses_the_store_and_falls_back_to_indexing(tiny_weights):
    cfg = tiny_weights.cfg
    slots, pos = torch.tensor([1, 0, 1]), torch.tensor([5, 2, 0])
    k = torch.randn(3, cfg.n_kv_heads, cfg.head_dim).to(torch.bfloat16)
    v = torch.randn(3, cfg.n_kv_heads, cfg.head_dim).to(torch.bfloat16)
    ref = KVCache(cfg, 8, 2, torch.bfloat16)
    ref.write(0, slots, pos, k, v)
    calls = []

    def declining(*args):
        calls.append(args)
        return False

    fallback = KVCache(cfg, 8, 2, torch.bfloat16)
    fallback.write(0, slots, pos, k, v, store=declining)
    assert len(calls) == 1 and calls[0][0] is fallback.k[0] and calls[0][1] is fallback.v[0]
    assert torch.equal(fallback.k[0].view(torch.int16), ref.k[0].view(torch.int16))
    assert torch.equal(fallback.v[0].view(torch.int16), ref.v[0].view(torch.int16))
    taken = KVCache(cfg, 8, 2, torch.bfloat16)
    taken.write(0, slots, pos, k, v, store=lambda *a: True)       # the store said it stored them: no indexing
    assert not taken.k[0].any() and not taken.v[0].any()
    fp8 = KVCache(cfg, 8, 2, torch.bfloat16, kv_dtype="fp8_e4m3_block")
    fp8.write(0, slots, pos, k, v, store=declining)
    assert calls[-1][4].dtype == torch.uint8 and calls[-1][4].shape[-1] == fp8.k[0].shape[-1]   # quantized rows


def test_store_declines_cpu_caches():
    assert not cache_store.store(*_case(torch.bfloat16, "cpu"))


def test_forward_refuses_a_slot_outside_the_cache(tiny_weights):
    cfg = tiny_weights.cfg
    cache = KVCache(cfg, 8, 2, tiny_weights.dtype)
    for bad in (2, -1):
        with pytest.raises(ValueError, match=rf"slots {bad}..{bad} outside the cache's slots 0..1"):
            forward(tiny_weights, torch.tensor([1]), torch.tensor([0]), cache, "invariant",
                    slots=torch.tensor([bad]))
    assert all(not t.any() for t in cache.k + cache.v) and cache.lengths == [0, 0]




def test_forward_span_gives_forwards_bytes_and_lengths(tiny_weights):
    """Rows at positions 5..12 of slot 1 after rows 0..4: logits, hidden rows, every KV byte and the lengths of
    forward_span equal forward's with those positions and slots. Control: the rows one position later differ."""
    ids = torch.randint(0, tiny_weights.cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    caches = [KVCache(tiny_weights.cfg, 16, 2, tiny_weights.dtype) for _ in range(2)]
    for c in caches:
        forward_span(tiny_weights, ids[:5], 0, c, "invariant", slot=1)
    pos = torch.arange(5, 13)
    a = forward(tiny_weights, ids[5:], pos, caches[0], "invariant", slots=torch.full_like(pos, 1))
    b = forward_span(tiny_weights, ids[5:], 5, caches[1], "invariant", slot=1)
    assert torch.equal(a.logits.view(torch.int32), b.logits.view(torch.int32))
    assert torch.equal(a.hidden.view(torch.int16), b.hidden.view(torch.int16))
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16))
               for x, y in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))
    assert caches[0].lengths == caches[1].lengths == [0, 13]
    late = forward_span(tiny_weights, ids[5:], 6, caches[1], "invariant", slot=1)
    assert not torch.equal(a.logits.view(torch.int32), late.logits.view(torch.int32))


def test_forward_span_and_prefill_refuse_rows_outside_the_cache_before_anything_runs(tiny_weights):
    cache = KVCache(tiny_weights.cfg, 8, 2, tiny_weights.dtype)
    with pytest.raises(ValueError, match=r"positions 6..9 outside the cache capacity 0..7"):
        forward_span(tiny_weights, torch.tensor([1, 2, 3, 4]), 6, cache, "invariant")
    with pytest.raises(ValueError, match=r"slots 2..2 outside the cache's slots 0..1"):
        forward_span(tiny_weights, torch.tensor([1]), 0, cache, "invariant", slot=2)
    with pytest.raises(ValueError, match=r"positions 0..8 outside the cache capacity 0..7"):
        paths.prefill(tiny_weights, cache, torch.arange(9), "invariant", paths.Schedule("batched", 2))
    assert all(not t.any() for t in cache.k + cache.v) and cache.lengths == [0, 0]


@contextlib.contextmanager
def _syncs_raise():
    """CUDA's sync debug mode "error" for the block (an operation that waits for the device raises), then the mode
    before."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


@GPU
@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_gpu_prefill_reads_nothing_back_from_the_device_between_segments():
    """paths.prefill of three segments (the invariant set, the small preset's shapes at 2 layers) with CUDA's sync
    debug mode raising: no operation waits for the device. Control: model.forward, which reads its rows' bounds
    back, raises there."""
    from exactness.config import get_preset
    from exactness.weights import device_random_weights
    w = device_random_weights(get_preset("small").replace(n_layers=2), torch.bfloat16, "cuda", seed=3)
    ids = torch.randint(0, 258, (300,), generator=torch.Generator().manual_seed(5)).cuda()
    schedule = paths.Schedule("batched", 128)                                  # segments of 128, 128 and 44 rows
    paths.prefill(w, KVCache(w.cfg, 320, 1, torch.bfloat16, w.device), ids, "invariant", schedule)   # compiles
    cache, pos = KVCache(w.cfg, 320, 1, torch.bfloat16, w.device), torch.tensor([300], device="cuda")
    torch.cuda.synchronize()
    with _syncs_raise():
        out = paths.prefill(w, cache, ids, "invariant", schedule)
        with pytest.raises(RuntimeError, match="synchroniz"):
            forward(w, ids[:1], pos, cache, "invariant")
    assert cache.lengths == [300] and out.logits.shape == (300, 258)

@pytest.mark.parametrize("rows", [2, 3, 25])
def test_advance_records_each_slots_largest_position_for_few_rows_and_many(tiny_weights, rows):
    """advance against a loop over the rows, from lengths already past some rows' positions (which must stay), for
    calls of fewer rows than slots, as many and more (reduced on the device first)."""
    g = torch.Generator().manual_seed(rows)
    cache = KVCache(tiny_weights.cfg, 40, 3, tiny_weights.dtype)
    cache.lengths = [7, 0, 30]
    slots, pos = torch.randint(0, 2, (rows,), generator=g), torch.randint(0, 40, (rows,), generator=g)
    want = list(cache.lengths)
    for s, p in zip(slots.tolist(), pos.tolist()):
        want[s] = max(want[s], p + 1)
    cache.advance(slots, pos)
    assert cache.lengths == want and want != [7, 0, 30]

@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_gpu_store_puts_indexings_bytes_and_a_planted_fault_is_caught(dtype):
    assert store_mismatches(cache_store.store, dtype, "cuda") == 0
    assert store_mismatches(cache_store.store, dtype, "cuda", shift=1) > 0


_INTERP = """
import torch
from test_cache_store import store_mismatches
from exactness.kernels import triton_cache
for dt in (torch.bfloat16, torch.float32, torch.uint8):
    print(dt, store_mismatches(triton_cache.kv_store, dt, "cpu"), store_mismatches(triton_cache.kv_store, dt, "cpu", 1))
kc = torch.zeros(2, 8, 3, 4, dtype=torch.bfloat16)
rows, where = torch.zeros(1, 3, 5, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64)
try:
    triton_cache.kv_store(kc, kc.clone(), where, where, rows, rows)
except ValueError as e:
    print("refused", "k (1, 3, 5)" in str(e), bool(kc.any()))
"""


@NEEDS_TRITON
def test_interpreter_store_puts_indexings_bytes_a_planted_fault_is_caught_and_bad_rows_refused():
    *rows, refused = interpreted_rows(_INTERP)
    assert len(rows) == 3 and all(int(same) == 0 and int(fault) > 0 for _, same, fault in rows)
    assert refused == ["refused", "True", "False"]       # rows not of the cache's row shape: nothing stored
