"""Expert offload (lib/exactness/offload.py): offloaded experts change no byte, the ring hands out the right expert
whatever the slot count and announcement pattern, the fallback is recorded, and the benchmark script runs on CPU."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactness import model
from exactness.offload import ExpertRing, ExpertStore, StagedWeights, moe_block_calls_prepare, prepare_hook
from exactness.paths import generate
from exactness.prompts import build_prompt

ROOT = Path(__file__).resolve().parents[1]
STEP, THRESHOLD, GEN = 24, 16, 4  # 40-token prompt: segments of 24 (deep) and 16 (deep, at the threshold)


@pytest.fixture(scope="module")
def prompt():
    return build_prompt("code", max_tokens=40)


def _run(w, ids, ks, path, experts=None):
    with prepare_hook():
        return generate(w, ids, GEN, ks, path, STEP, THRESHOLD, keep_cache=True, experts=experts)


def _differences(a, b) -> dict:
    """Counts of differing prompt-logit rows (int32 bytes), generated ids and KV elements (int16 bytes)."""
    rows = (a.prompt_logits.view(torch.int32) != b.prompt_logits.view(torch.int32)).any(dim=1)
    kv = sum(int((x.view(torch.int16) != y.view(torch.int16)).sum())
             for x, y in zip(a.cache.k + a.cache.v, b.cache.k + b.cache.v))
    return {"prompt_rows": int(rows.sum()), "gen_ids": int((a.gen_ids != b.gen_ids).sum()), "kv": kv}


NONE = {"prompt_rows": 0, "gen_ids": 0, "kv": 0}


@pytest.mark.parametrize("ks", ["fast", "invariant"])
@pytest.mark.parametrize("path", ["batched", "deep"])
def test_offload_changes_no_byte(tiny_weights, prompt, ks, path):
    """Offloaded experts (ring on the deep plan, synchronous fetches otherwise) give the resident engine's prompt
    logits, tokens and KV bytes."""
    ref = _run(tiny_weights, prompt.ids, ks, path)                           # resident experts, no provider
    offload = ExpertStore(tiny_weights, "offload", ring_slots=2)
    assert _differences(_run(offload.weights, prompt.ids, ks, path, offload), ref) == NONE
    s = offload.stats
    if path == "deep":
        assert ref.served["deep"]["rows"] == prompt.n_tokens
        assert s["ring_fetches"] > 0 and s["unannounced_calls"] == 0, s  # the ring served the deep segments
    else:
        assert s["ring_fetches"] == 0 and s["copies"] == 0, s
    assert s["sync_fetches"] > 0  # decode steps (and the batched pass) fetch synchronously


def test_resident_store_serves_the_weights_themselves(tiny_weights, prompt):
    store = ExpertStore(tiny_weights, "resident")
    lw = tiny_weights.layers[1]
    for got, want in zip(store(1, 5), (lw.w_gate[5], lw.w_up[5], lw.w_down[5])):
        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape   # a view, no copy
    assert store.deep_ready and store.ring_bytes == 0 and store.device_bytes_saved == 0
    ref = _run(tiny_weights, prompt.ids, "invariant", "deep")
    assert _differences(_run(store.weights, prompt.ids, "invariant", "deep", store), ref) == NONE


def test_perturbed_host_expert_is_caught(tiny_weights, prompt):
    """Negative control: one ulp added to layer 0's host gate weights must show in logits."""
    ref = _run(tiny_weights, prompt.ids, "invariant", "deep")
    store = ExpertStore(tiny_weights, "offload")
    store.host[0][0].view(torch.int16).add_(1)                              # w_gate of every layer-0 expert
    diff = _differences(_run(store.weights, prompt.ids, "invariant", "deep", store), ref)
    assert diff["prompt_rows"] > 0 and diff["kv"] > 0, diff


def test_offload_keeps_experts_off_the_device(tiny_weights):
    store = ExpertStore(tiny_weights, "offload", ring_slots=3)
    cfg = tiny_weights.cfg
    per_expert = 3 * cfg.expert_inter * cfg.hidden * 2                     # bf16
    assert store.expert_bytes == per_expert
    assert store.ring_bytes == 3 * per_expert
    assert store.device_bytes_saved == cfg.n_layers * cfg.n_experts * per_expert
    for lw in store.weights.layers:
        assert lw.w_gate.numel() == lw.w_up.numel() == lw.w_down.numel() == 0
        assert lw.wq.device.type == "cpu" and lw.wq.numel() > 0
    with pytest.raises(IndexError):  # the placeholders cannot be computed with: no provider, no forward
        generate(store.weights, torch.tensor([256, 65]), 1, "fast", "batched")


def test_fallback_when_the_ring_does_not_fit(tiny_weights, prompt):
    store = ExpertStore(tiny_weights, "offload", ring_slots=4, max_ring_bytes=1000)
    assert not store.deep_ready and store.ring_bytes == 0
    assert "max_ring_bytes=1000" in store.fallback_reason and str(4 * store.expert_bytes) in store.fallback_reason
    ref = _run(tiny_weights, prompt.ids, "invariant", "deep")
    assert _differences(_run(store.weights, prompt.ids, "invariant", "deep", store), ref) == NONE
    assert store.stats["ring_fetches"] == 0 and store.stats["sync_fetches"] > 0
    assert store.info()["fallback_reason"] == store.fallback_reason


def test_fallback_on_device_out_of_memory(tiny_weights, monkeypatch):
    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
    monkeypatch.setattr(ExpertRing, "__init__", oom)
    store = ExpertStore(tiny_weights, "offload")
    assert not store.deep_ready and "out of memory" in store.fallback_reason


def test_paths_record_the_fallback(tiny_weights, prompt):
    store = ExpertStore(tiny_weights, "offload", max_ring_bytes=0)
    run = _run(store.weights, prompt.ids, "invariant", "deep", store)
    assert run.served["deep"]["rows"] == 0
    assert run.served["fallback"]["rows"] == prompt.n_tokens
    assert run.served["batched"]["rows"] == prompt.n_tokens


def test_bad_arguments(tiny_weights):
    with pytest.raises(ValueError, match="unknown expert store mode 'disk'"):
        ExpertStore(tiny_weights, "disk")
    with pytest.raises(ValueError, match="ring_slots must be an int >= 1, got 0"):
        ExpertStore(tiny_weights, "offload", ring_slots=0)
    with pytest.raises(ValueError, match="max_ring_bytes"):
        ExpertStore(tiny_weights, "offload", max_ring_bytes=-1)
    with pytest.raises(IndexError, match=r"expert \(0, 8\) outside"):
        ExpertStore(tiny_weights, "offload")(0, 8)


def test_prepare_hook_wraps_and_restores():
    original, built_in = model.moe_block, moe_block_calls_prepare()
    with pytest.raises(RuntimeError):
        with prepare_hook() as active:
            assert active is not built_in
            assert moe_block_calls_prepare()
            assert (model.moe_block is not original) == active
            raise RuntimeError("inside")
    assert model.moe_block is original


class _Source:
    """Host experts whose every element encodes its (layer, expert) key, so a wrong slot is visible."""

    def __init__(self, shapes):
        self.shapes = shapes

    def __call__(self, key):
        layer, e = key
        return tuple(torch.full(s, float(100 * layer + e)) for s in self.shapes)


@settings(max_examples=40, deadline=None)
@given(slots=st.integers(1, 5), speculate=st.booleans(),
       calls=st.lists(st.tuples(st.integers(0, 2), st.sets(st.integers(0, 5), min_size=1), st.booleans()),
                      min_size=1, max_size=6))
def test_ring_hands_out_the_announced_expert(slots, speculate, calls):
    """Every take returns the buffers of the key asked for, whatever the slot count, speculation and mix of
    announced ('deep') and unannounced calls; takes of unannounced keys return None."""
    shapes = ((2, 3), (2, 3), (3, 2))
    stats = {k: 0 for k in ("ring_fetches", "copies", "speculative_copies", "speculative_hits", "dropped_copies",
                            "bytes_moved")}
    succ = (lambda k: (k[0], k[1] + 1) if k[1] < 5 else ((k[0] + 1) % 3, 0)) if speculate else None
    ring = ExpertRing(shapes, torch.float32, torch.device("cpu"), slots, _Source(shapes), succ, stats)
    for layer, experts, announced in calls:
        keys = [(layer, e) for e in sorted(experts)]
        if announced:
            ring.schedule(keys)
        else:
            ring.clear()
        for key in keys:
            bufs = ring.take(key)
            if not announced:
                assert bufs is None
                continue
            assert [tuple(b.shape) for b in bufs] == list(shapes)
            assert all(bool((b == 100 * key[0] + key[1]).all()) for b in bufs), key
    assert stats["ring_fetches"] == sum(len(c[1]) for c in calls if c[2])


def test_bench_offload_script_runs_on_cpu(tmp_path):
    out = tmp_path / "bo.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_offload.py"), "--preset", "tiny",
                           "--device", "cpu", "--tokens", "48", "--deep-threshold", "16", "--kernels", "fast",
                           "--reps", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "deep speed-up over batched" in proc.stdout and "ratio" in proc.stdout
    import json
    res = json.loads(out.read_text())
    deep = [r for r in res["rows"] if r["path"] == "deep"][0]
    assert deep["ring_fetches"] > 0 and deep["served"]["deep"]["rows"] == 48
    assert res["flops"] > 0 and deep["bound_s"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ks", ["fast", "invariant"])
@pytest.mark.parametrize("slots", [1, 4])
def test_offload_changes_no_byte_on_cuda(tiny_weights, prompt, ks, slots):
    """The CUDA ring (pinned host, copy stream, events) gives the resident engine's bytes on the deep path."""
    ref = _run(tiny_weights.to("cuda"), prompt.ids, ks, "deep")
    store = ExpertStore(tiny_weights, "offload", ring_slots=slots, device="cuda")
    assert store.host[0][0].is_pinned() and store.ring.stream is not None
    assert _differences(_run(store.weights, prompt.ids, ks, "deep", store), ref) == NONE
    assert store.stats["ring_fetches"] > 0 and store.stats["unannounced_calls"] == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_staged_weights_hand_out_the_weights_behind_a_decoy(device):
    """Both routes give the weights' bytes; the ring copies the decoy (every nonzero element's sign flipped) and
    then the weights into its one slot on every fetch, so a kernel that does not wait for the second copy reads
    the decoy."""
    w = (torch.randn(8, 16, dtype=torch.bfloat16, device=device), torch.randn(8, 16, dtype=torch.bfloat16,
                                                                             device=device))
    staged = StagedWeights(w)
    assert all(torch.equal(d.view(torch.int16) ^ h.view(torch.int16), torch.full_like(h.view(torch.int16), -32768))
               for d, h in zip(staged.decoy, staged.host))
    for n in range(1, 4):
        got = staged.fetch("ring")
        assert all(torch.equal(g.view(torch.int16), t.view(torch.int16)) for g, t in zip(got, w))
        assert staged.stats["copies"] == 2 * n and len(staged.ring.bufs) == 1
    assert all(torch.equal(g.view(torch.int16), t.view(torch.int16)) for g, t in zip(staged.fetch("sync"), w))
    with pytest.raises(ValueError, match="unknown route 'rings'; allowed: ring, sync"):
        staged.fetch("rings")
