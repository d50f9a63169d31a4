"""Expert offload (lib/exactness/offload.py): offloaded experts change no byte, the forward announces and fetches its
experts through the provider it is given, deep segments stage them through the ring (counted), the ring hands out
the right expert whatever the slot count and announcement pattern, the fallback is recorded, and the benchmark
script runs on CPU."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactness.exact import as_int, bytes_equal, differing_rows
from exactness.expert_providers import ResidentExperts
from exactness.kernels import get_set
from exactness.offload import ExpertStore
from exactness.ring import ExpertRing, StagedWeights
from exactness.paths import Schedule, generate
from exactness.prompts import build_prompt

ROOT = Path(__file__).resolve().parents[1]
STEP, THRESHOLD, GEN = 24, 16, 4  # 40-token prompt: segments of 24 (deep) and 16 (deep, at the threshold)


@pytest.fixture(scope="module")
def prompt():
    return build_prompt("code", max_tokens=40)


def _run(w, ids, ks, path, experts=None):
    return generate(w, ids, GEN, ks, Schedule(path, STEP, THRESHOLD), keep_cache=True, experts=experts)


def _differences(a, b) -> dict:
    """Counts of differing prompt-logit rows, generated ids and KV elements (in bytes)."""
    rows = differing_rows(a.prompt_logits, b.prompt_logits)
    kv = sum(int((as_int(x) != as_int(y)).sum()) for x, y in zip(a.cache.k + a.cache.v, b.cache.k + b.cache.v))
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
    for got, want in zip(store.fetch(1, 5), (lw.w_gate[5], lw.w_up[5], lw.w_down[5])):
        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape   # a view, no copy
    assert store.deep_ready and store.ring_bytes == 0 and store.device_bytes_saved == 0
    ref = _run(tiny_weights, prompt.ids, "invariant", "deep")
    assert _differences(_run(store.weights, prompt.ids, "invariant", "deep", store), ref) == NONE


def test_perturbed_host_expert_is_caught(tiny_weights, prompt):
    """Negative control: one ulp added to layer 0's host gate weights must show in logits."""
    ref = _run(tiny_weights, prompt.ids, "invariant", "deep")
    store = ExpertStore(tiny_weights, "offload")
    as_int(store.host[0][0]).add_(1)                                        # w_gate of every layer-0 expert
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
        generate(store.weights, torch.tensor([256, 65]), 1, "fast", Schedule("batched"))


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
        ExpertStore(tiny_weights, "offload").fetch(0, 8)


class _Recorder:
    """A planted expert provider: records every prepare and fetch call, and serves them from ``inner``."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.deep_ready, self.fallback_reason = inner.deep_ready, inner.fallback_reason

    def prepare(self, layer, expert_ids, plan):
        self.calls.append(("prepare", layer, list(expert_ids), plan))
        self.inner.prepare(layer, expert_ids, plan)

    def fetch(self, layer, expert_id):
        self.calls.append(("fetch", layer, expert_id))
        return self.inner.fetch(layer, expert_id)

    def prepared(self) -> list:
        """(layer, announced ids, plan, the (layer, id) fetches that followed) per prepare call, in call order."""
        out = []
        for call in self.calls:
            if call[0] == "prepare":
                out.append((*call[1:], []))
            else:
                out[-1][3].append(call[1:])
        return out


def test_forward_asks_the_provider_it_is_given(tiny_weights, prompt):
    """Every MoE call of every forward announces its experts with members (ascending ids, with the forward's plan)
    and then fetches exactly those, in that order, from the provider; the bytes are the default provider's."""
    rec = _Recorder(ResidentExperts(tiny_weights.layers))
    run = _run(tiny_weights, prompt.ids, "invariant", "deep", rec)
    assert _differences(run, _run(tiny_weights, prompt.ids, "invariant", "deep")) == NONE
    L, prepared = tiny_weights.cfg.n_layers, rec.prepared()
    # the 40-token prompt's two deep segments (24 and 16 rows), then one decode step per token after the first
    assert [(layer, plan) for layer, _, plan, _ in prepared] == (
        [(i, "deep") for _ in range(2) for i in range(L)] + [(i, "decode") for _ in range(GEN - 1) for i in range(L)])
    for layer, ids, _, fetches in prepared:
        assert ids and ids == sorted(set(ids))
        assert fetches == [(layer, e) for e in ids]


@pytest.mark.parametrize("path, slots", [("deep", 1), ("deep", 4), ("batched", 2)])
def test_offloaded_run_stages_the_deep_experts_through_the_ring(tiny_weights, prompt, path, slots):
    """Each expert announced by a deep forward is one ring fetch, every other fetch is synchronous, and every copy
    and byte moved is accounted for."""
    store = ExpertStore(tiny_weights, "offload", ring_slots=slots)
    rec = _Recorder(store)
    _run(store.weights, prompt.ids, "invariant", path, rec)
    prepared = rec.prepared()
    deep = sum(len(ids) for _, ids, plan, _ in prepared if plan == "deep")
    other = sum(len(ids) for _, ids, plan, _ in prepared if plan != "deep")
    s = store.stats
    assert s["prepare_calls"] == len(prepared) == tiny_weights.cfg.n_layers * (2 + GEN - 1)  # 24 + 16 rows
    assert (s["ring_fetches"], s["sync_fetches"], s["unannounced_calls"]) == (deep, other, 0)
    assert (deep > 0) == (path == "deep")
    assert s["copies"] == s["ring_fetches"] + s["dropped_copies"] + len(store.ring.slot_of)
    assert s["bytes_moved"] == (s["copies"] + s["sync_fetches"]) * store.expert_bytes


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


def _cpu_grouped(h, idx, w_gate, w_up, w_down):
    """A grouped_experts option for the CPU: y [M, k, H] from the invariant set's expert kernels on each expert's
    member rows (ascending rows, as the per-expert loop orders them), weights indexed from the stacked tensors."""
    ks = get_set("invariant")
    gate_up, down = ks.fn("expert_gate_up", "prompt"), ks.fn("expert_down", "prompt")
    y = h.new_zeros(*idx.shape, h.shape[1])                                      # [M, k, H]
    for e in torch.unique(idx).tolist():
        rows, slots = (idx == e).nonzero(as_tuple=True)
        y[rows, slots] = down(gate_up(h[rows], w_gate[e], w_up[e]), w_down[e])
    return y


GROUPED = replace(get_set("invariant"), name="invariant+cpu-grouped",
                  options={**get_set("invariant").options, "grouped_experts": _cpu_grouped})


@pytest.mark.parametrize("layer_slots", [1, 2])
def test_layer_ring_stages_whole_layers_and_changes_no_byte(tiny_weights, prompt, layer_slots):
    """With a set that computes a layer's experts in one call, the deep segments take every layer whole from the
    layer ring (no per-expert ring fetch), the bytes equal the resident run's and the per-expert run's, and every
    copy and byte moved is accounted for."""
    ref = _run(tiny_weights, prompt.ids, "invariant", "deep")                    # resident, expert by expert
    assert _differences(_run(tiny_weights, prompt.ids, GROUPED, "deep"), ref) == NONE   # resident, grouped
    store = ExpertStore(tiny_weights, "offload", ring_slots=2, layer_slots=layer_slots)
    assert _differences(_run(store.weights, prompt.ids, GROUPED, "deep", store), ref) == NONE
    info, L = store.info(), tiny_weights.cfg.n_layers
    s, ls = info["stats"], store.layer_stats
    assert (s["layer_fetches"], s["ring_fetches"], s["unannounced_calls"]) == (2 * L, 0, 0), s  # 2 deep segments
    assert s["sync_fetches"] > 0 and 0 < s["unique_experts"] <= L * tiny_weights.cfg.n_experts   # decode steps
    assert ls["copies"] == ls["ring_fetches"] + ls["dropped_copies"] + len(store.layer_ring.slot_of)
    layer_bytes = sum(t.nbytes for t in store.host[0])
    assert s["bytes_moved"] == ls["copies"] * layer_bytes + (s["copies"] + s["sync_fetches"]) * store.expert_bytes
    assert info["layer_ring_bytes"] == layer_slots * layer_bytes and info["ring_bytes"] > info["layer_ring_bytes"]


def test_layer_ring_stages_nothing_for_a_grouped_kernel_that_declines(tiny_weights, prompt):
    """A grouped kernel whose ``serves`` declines the layer's shapes is asked before anything is staged: no layer
    copy, the expert ring serves the deep segments, and the bytes are the resident run's."""
    def declining(h, idx, *w):
        raise AssertionError("called although it declined")
    declining.serves = lambda h, *w: False
    ks = replace(GROUPED, name="invariant+declining", options={**GROUPED.options, "grouped_experts": declining})
    ref = _run(tiny_weights, prompt.ids, "invariant", "deep")
    store = ExpertStore(tiny_weights, "offload", ring_slots=2, layer_slots=2)
    assert _differences(_run(store.weights, prompt.ids, ks, "deep", store), ref) == NONE
    s = store.info()["stats"]
    assert (s["layer_fetches"], s["layer_copies"]) == (0, 0) and s["ring_fetches"] > 0, s
    with pytest.raises(IndexError, match="layer 2 outside layers 0..1"):
        store.stacked(2, "deep", torch.zeros(1, 2, dtype=torch.int64))


def test_layer_ring_fault_is_caught(tiny_weights, prompt):
    """Negative control: layer 0's staged w_gate one ULP up in every element (the host copy the layer ring reads)
    changes the deep prefill's prompt logits, so the byte comparison above can fail."""
    ref = _run(tiny_weights, prompt.ids, GROUPED, "deep")
    store = ExpertStore(tiny_weights, "offload", layer_slots=2)
    good = store.host[0]
    bad = (torch.empty_like(good[0]).copy_(good[0]).view(torch.int16).add_(1).view(good[0].dtype), *good[1:])
    store.layer_ring.source = lambda layer: bad if layer == 0 else store.host[layer]
    assert _differences(_run(store.weights, prompt.ids, GROUPED, "deep", store), ref)["prompt_rows"] > 0


def test_layer_ring_reservation_and_its_reasons(tiny_weights):
    """No layer ring on the CPU by default; one where asked; none (with the reason, the expert ring kept) where
    max_ring_bytes leaves room for the expert ring only; bad layer_slots are refused up front."""
    assert ExpertStore(tiny_weights, "offload").layer_ring is None
    store = ExpertStore(tiny_weights, "offload", ring_slots=2, layer_slots=2)
    both = store.ring_bytes
    tight = ExpertStore(tiny_weights, "offload", ring_slots=2, layer_slots=2, max_ring_bytes=both - 1)
    assert tight.layer_ring is None and tight.deep_ready and "max_ring_bytes" in tight.layer_ring_reason
    assert tight.info()["layer_slots"] == 0 and tight.ring_bytes == 2 * tight.expert_bytes
    assert ExpertStore(tiny_weights, "resident", layer_slots=2).stacked(0, "deep", torch.zeros(1, 2)) is None
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match=f"layer_slots must be None or an int >= 0, got {bad}"):
            ExpertStore(tiny_weights, "offload", layer_slots=bad)


@pytest.mark.slow
def test_bench_offload_script_runs_on_cpu(tmp_path):
    out = tmp_path / "bo.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_offload.py"), "--preset", "tiny",
                           "--device", "cpu", "--tokens", "48", "--deep-threshold", "16", "--kernels", "fast",
                           "--reps", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "deep speed-up over batched" in proc.stdout and "ratio" in proc.stdout
    res = json.loads(out.read_text())
    deep = [r for r in res["rows"] if r["path"] == "deep"][0]
    assert deep["ring_fetches"] > 0 and deep["served"]["deep"]["rows"] == 48
    assert res["flops"] > 0 and deep["bound_s"] > 0
    assert res["fast_served"] == {}                 # what served the fast set's CUDA kernels: none called on the CPU


@pytest.mark.slow
def test_fast_set_compiled_offload_changes_no_byte(tiny_weights, prompt, monkeypatch, cpu_compile, cpu_grouped):
    """The fast set as it runs on CUDA, here on CPU tensors (its graphs compiled: fast_cuda._COMPILE["cpu"]; its
    grouped experts through torch's reference _grouped_mm: _STATE["cpu_grouped"]; tests only): the deep path with
    offloaded experts, one expert at a time (expert ring) or the prompt's layers staged whole and the decode rows'
    experts one by one (layer ring), gives the resident run's bytes (all experts grouped): an expert run alone
    computes SiLU * up in the compiled code of the grouped route. Planted fault: that expert's SiLU * up run
    eagerly (rounded twice), in the resident run too (its shared expert): both offloaded runs then differ from it.
    Skipped where Inductor or the reference _grouped_mm cannot run here (conftest's cpu_compile, cpu_grouped)."""
    from exactness.kernels import experts, fast_cuda, fast_fused
    ref = _run(tiny_weights, prompt.ids, "fast", "deep")
    assert fast_cuda.STATUS["inductor"] == "ok" and fast_cuda.STATUS["grouped_mm"] == "ok", fast_cuda.STATUS

    def offloaded(layer_slots):
        store = ExpertStore(tiny_weights, "offload", ring_slots=2, layer_slots=layer_slots)
        return _run(store.weights, prompt.ids, "fast", "deep", store), store.info()["stats"]
    for layer_slots in (0, 2):
        out, s = offloaded(layer_slots)
        assert _differences(out, ref) == NONE, layer_slots
        assert (s["layer_fetches"] > 0, s["ring_fetches"] > 0) == (layer_slots > 0, layer_slots == 0), s
    run = fast_fused._run
    monkeypatch.setattr(fast_fused, "_run", lambda fn, *a, **kw: (experts.gate_up_fast(*a) if fn is experts.gate_up_fast
                                                                  else run(fn, *a, **kw)))
    ref = _run(tiny_weights, prompt.ids, "fast", "deep")          # the shared expert runs the fault too
    for layer_slots in (0, 2):                                    # prompt rows; the decode rows' KV
        assert _differences(offloaded(layer_slots)[0], ref) != NONE, layer_slots         # planted fault


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ks", ["fast", "invariant"])
@pytest.mark.parametrize("slots, layer_slots", [(1, 0), (4, 0), (4, 1), (4, None)])
def test_offload_changes_no_byte_on_cuda(tiny_weights, prompt, ks, slots, layer_slots):
    """The CUDA rings (pinned host, copy stream, events) give the resident engine's bytes on the deep path: the
    expert ring without a layer ring, the layer ring (1 slot, or the default 2) with one: both sets have a grouped
    expert kernel on CUDA (the fast set's torch._grouped_mm on bf16, the invariant set's Triton MoE kernel)."""
    ref = _run(tiny_weights.to("cuda"), prompt.ids, ks, "deep")
    store = ExpertStore(tiny_weights, "offload", ring_slots=slots, device="cuda", layer_slots=layer_slots)
    assert store.host[0][0].is_pinned() and store.ring.stream is not None
    assert (store.layer_ring is not None) == (layer_slots != 0)
    assert _differences(_run(store.weights, prompt.ids, ks, "deep", store), ref) == NONE
    s = store.info()["stats"]
    by_layer = layer_slots != 0
    assert (s["layer_fetches"] > 0, s["ring_fetches"] > 0) == (by_layer, not by_layer), s
    assert s["unannounced_calls"] == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_staged_weights_hand_out_the_weights_behind_a_decoy(device):
    """Both routes give the weights' bytes; the ring copies the decoy (every nonzero element's sign flipped) and
    then the weights into its one slot on every fetch, so a kernel that does not wait for the second copy reads
    the decoy."""
    w = (torch.randn(8, 16, dtype=torch.bfloat16, device=device), torch.randn(8, 16, dtype=torch.bfloat16,
                                                                             device=device))
    staged = StagedWeights(w)
    assert all(torch.equal(as_int(d) ^ as_int(h), torch.full_like(as_int(h), -32768))   # the sign bits alone
               for d, h in zip(staged.decoy, staged.host))
    for n in range(1, 4):
        got = staged.fetch("ring")
        assert all(bytes_equal(g, t) for g, t in zip(got, w))
        assert staged.stats["copies"] == 2 * n and len(staged.ring.bufs) == 1
    assert all(bytes_equal(g, t) for g, t in zip(staged.fetch("sync"), w))
    with pytest.raises(ValueError, match="unknown route 'rings'; allowed: ring, sync"):
        staged.fetch("rings")

