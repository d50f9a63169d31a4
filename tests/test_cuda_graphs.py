"""CUDA-graph decode (graphs.py): with graphs the tokens, generated logits and KV bytes equal the eager run's, and
on the decode path (every prompt row one decode step, replayed too) the prompt logits as well.

GPU tests (skipped without CUDA and Triton) run the ``small`` preset's layer shapes at two layers, for both kernel
sets (and the invariant set over an fp8 cache, whose attention runs eagerly between graph pieces). The negative
controls replay with a stale device position (the host still records the right one), or move one replayed prompt
row's logit by one ULP, and must be caught by the same comparison, where planted. Where a graph cannot serve (CPU
weights, kernel taps, another expert provider) the run records why and its bytes are the eager run's. A tap
recorder that declines a forward (``wants``) sees the eager run's samples while the other forwards replay.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from exactness import graphs, stream_forwards
from exactness.exact import bytes_equal, first_differing_row, kv_first_difference, ulp_distance
from exactness.expert_providers import ResidentExperts
from exactness.kernels import get_set
from exactness.model import BATCHED, DECODE, tapping
from exactness.paths import Schedule, generate

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA device and Triton")
GEN = 6


def same_run(a, b) -> bool:
    """Generated tokens, generated logits and the KV cache of two runs equal as bytes."""
    return (bytes_equal(a.gen_ids, b.gen_ids) and bytes_equal(a.gen_logits, b.gen_logits)
            and kv_first_difference(a.cache, b.cache) is None)


def same_decode_run(a, b) -> bool:
    """same_run, and every prompt row's logits equal as bytes (the decode path runs the prompt as decode steps)."""
    return same_run(a, b) and bytes_equal(a.prompt_logits, b.prompt_logits)


def stale_positions(monkeypatch) -> None:
    """Negative control: replays read the previous position on the device; the host keeps the right one."""
    load = graphs.GraphForward._load

    def stale(self, tokens, positions, slots, hidden):
        load(self, tokens, positions, slots, hidden)
        if self.pieces is not None:
            self.positions.sub_(1)
    monkeypatch.setattr(graphs.GraphForward, "_load", stale)


def same_drafted(a, b) -> bool:
    """Two drafted runs: tokens, generated logits, the main KV cache and the MTP head's KV cache equal as bytes."""
    return same_run(a, b) and (a.mtp_cache is None) == (b.mtp_cache is None) and (
        a.mtp_cache is None or kv_first_difference(a.mtp_cache, b.mtp_cache) is None)


# ------------------------------------------------------------------------------------------------ CPU

def test_cpu_falls_back_with_reason(tiny_weights):
    ids = torch.arange(5, 17)
    eager = generate(tiny_weights, ids, 4, "invariant", keep_cache=True)     # the decode path: 12 prompt rows
    run = generate(tiny_weights, ids, 4, "invariant", keep_cache=True, graphs=True)
    assert run.graphs["served"] is False and run.graphs["replays"] == 0
    assert run.graphs["eager_steps"] == 12 + 3                               # the prompt rows and the reply's steps
    assert "CUDA device" in run.graphs["reason"] and "cpu" in run.graphs["reason"]
    assert run.graphs["prompt"] == "eager: " + run.graphs["reason"]         # the prompt rows: eager decode rows
    assert eager.graphs == {} and run.served == eager.served
    assert same_decode_run(eager, run)
    other = generate(tiny_weights, torch.cat([ids[:-1], ids[-1:] + 1]), 4, "invariant", keep_cache=True)
    assert not same_decode_run(eager, other)   # negative control: one prompt token changed
    batched = generate(tiny_weights, ids, 4, "invariant", Schedule("batched"), keep_cache=True, graphs=True)
    assert batched.graphs["eager_steps"] == 3   # another path's prompt runs its own plan: the reply's steps only


def test_batch_must_be_positive(tiny_weights):
    with pytest.raises(ValueError, match="batch must be a positive int"):
        graphs.why_not(tiny_weights, "fast", 0)
    with pytest.raises(ValueError, match="rows must be a positive int, got 0"):
        graphs.why_not(tiny_weights, "fast", rows=0)


def test_cpu_drafted_falls_back_with_reason(tiny_weights):
    """A drafted run with graphs on CPU: every forward shape after the prefill records why no graph served, and
    the run's bytes are the eager run's (the head's catch-up over the prompt stays eager: not a recorded shape)."""
    from exactness.mtp import generate_drafted
    ids, sched, gen = torch.arange(5, 37) % 251, Schedule("batched", 16), 12   # a verify of 3 rows in several rounds
    eager = generate_drafted(tiny_weights, ids, gen, "invariant", sched, k=2, keep_cache=True)
    run = generate_drafted(tiny_weights, ids, gen, "invariant", sched, k=2, keep_cache=True, graphs=True)
    assert eager.graphs == {} and eager.graphs_record() is None
    assert "main 3 batched" in run.graphs and "head 1 decode" in run.graphs, run.graphs
    assert all(1 <= int(k.split()[1]) <= 3 for k in run.graphs)          # no shape above k + 1 rows
    assert all(not g["served"] and ("CUDA device" in g["reason"] or g["reason"] == stream_forwards.ONCE)
               for g in run.graphs.values()), run.graphs
    assert "CUDA device" in run.graphs["main 3 batched"]["reason"]      # met every round: a graph was tried
    rec = run.graphs_record()
    assert rec["served"] is False and rec["replays"] == 0
    assert rec["eager_steps"] == sum(g["eager_steps"] for g in run.graphs.values()) > 0
    assert same_drafted(eager, run)


def test_stream_forwards_capture_from_the_second_call(tiny_weights):
    """StreamForwards makes a shape's GraphForward on its second call (a shape met once runs eagerly and is
    reported as such); forwards above max_rows are never recorded."""
    from exactness.cache import KVCache
    w = tiny_weights
    cache = KVCache(w.cfg, 16, 1, w.dtype, w.device)
    fwd = stream_forwards.StreamForwards(w, cache, "invariant", None, None, True, max_rows=3)
    fwd.main(torch.tensor([1, 2, 3, 4]), 0, BATCHED)                      # 4 rows > max_rows: eager, unrecorded
    fwd.main(torch.tensor([5]), 4, DECODE)
    assert fwd.info() == {"main 1 decode": {"served": False, "replays": 0, "eager_steps": 1, "pieces": 0,
                                            "reason": stream_forwards.ONCE}}
    fwd.main(torch.tensor([6]), 5, DECODE)
    info = fwd.info()["main 1 decode"]
    assert set(fwd.captured) == {"main 1 decode"} and info["eager_steps"] == 2 and "CUDA device" in info["reason"]
    assert cache.lengths[0] == 6
    assert stream_forwards.StreamForwards(w, cache, "invariant", None, None, False, max_rows=3).info() == {}


def test_graph_forward_refuses_bad_input(tiny_weights):
    from exactness.cache import KVCache
    cache = KVCache(tiny_weights.cfg, 8, 1, tiny_weights.dtype, tiny_weights.device)
    g = graphs.GraphForward(tiny_weights, cache, "invariant", rows=2)
    with pytest.raises(ValueError, match=r"a forward of 2 rows needs tokens \[2\]"):
        g.run(torch.tensor([1]), [0], [0])
    with pytest.raises(ValueError, match="hidden rows"):
        g.run(torch.tensor([1, 2]), [0, 1], [0, 0], hidden=torch.zeros(2, tiny_weights.cfg.hidden))
    with pytest.raises(ValueError, match="outside the cache capacity 0..7"):
        g.run(torch.tensor([1, 2]), [7, 8], [0, 0])
    from exactness.mtp import MTPHead, resolve_mtp
    head = MTPHead(tiny_weights, resolve_mtp(tiny_weights), 8)
    with pytest.raises(ValueError, match="the head's own cache"):
        graphs.GraphForward(tiny_weights, cache, "invariant", rows=2, head=head)
    with pytest.raises(ValueError, match="batch=2"):
        graphs.GraphForward(tiny_weights, head.cache, "invariant", batch=2, head=head)


# ------------------------------------------------------------------------------------------------ GPU

@pytest.fixture(scope="module")
def gpu_weights():
    from exactness.config import get_preset
    from exactness.weights import device_random_weights
    return device_random_weights(get_preset("small").replace(n_layers=2), torch.bfloat16, "cuda", seed=1)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 258, (40,), generator=torch.Generator().manual_seed(3))


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kernels,kv_dtype", [("fast", "bf16"), ("invariant", "bf16"),
                                              ("invariant", "fp8_e4m3_block")])
def test_gpu_graph_bytes_equal_eager(gpu_weights, prompt, kernels, kv_dtype, monkeypatch):
    sched = Schedule("batched")
    eager = generate(gpu_weights, prompt, GEN, kernels, sched, keep_cache=True, kv_dtype=kv_dtype)
    run = generate(gpu_weights, prompt, GEN, kernels, sched, keep_cache=True, kv_dtype=kv_dtype, graphs=True)
    info = run.graphs
    assert info["reason"] is None, info
    assert info["served"] and info["replays"] == GEN - 2 and info["eager_steps"] == 1
    one_piece = kv_dtype == "bf16"     # attention captured (both sets' kernels over a bf16 cache): one graph a step
    assert (info["pieces"] == 1) == one_piece
    assert same_run(eager, run)

    stale_positions(monkeypatch)
    bad = generate(gpu_weights, prompt, GEN, kernels, sched, keep_cache=True, kv_dtype=kv_dtype, graphs=True)
    assert bad.graphs["served"]
    assert not same_run(eager, bad)
    P = prompt.numel()                       # replays start at position P + 1 and write P, P + 1, ... instead
    assert P <= kv_first_difference(eager.cache, bad.cache) <= P + GEN - 2
    assert bytes_equal(eager.gen_logits[:2], bad.gen_logits[:2])          # before the first replay: untouched
    assert not bytes_equal(eager.gen_logits[2:3], bad.gen_logits[2:3])    # the first replay's logits


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kernels,kv_dtype", [("fast", "bf16"), ("invariant", "bf16"),
                                              ("invariant", "fp8_e4m3_block")])
def test_gpu_decode_path_prompt_replays_bytes_equal_eager(gpu_weights, prompt, kernels, kv_dtype, monkeypatch):
    """The serial oracle with graphs: every prompt row and every reply step after the first is a replay, whether
    the replay is one graph (the invariant set over a model-dtype cache) or graph pieces around eager attention
    calls; the prompt logits, tokens, generated logits and KV cache equal the eager decode path's as bytes."""
    sched, P = Schedule("decode"), prompt.numel()
    eager = generate(gpu_weights, prompt, GEN, kernels, sched, keep_cache=True, kv_dtype=kv_dtype)
    run = generate(gpu_weights, prompt, GEN, kernels, sched, keep_cache=True, kv_dtype=kv_dtype, graphs=True)
    info = run.graphs
    assert info["reason"] is None, info
    assert info["served"] and info["eager_steps"] == 1                  # row 0 (or the first reply step) captures
    assert info["replays"] == P + GEN - 2 and info["prompt"] == "replayed", info
    whole = kv_dtype == "bf16"           # attention captured (both sets over a bf16 cache): one graph per step
    assert info["pieces"] == (1 if whole else 2 * gpu_weights.cfg.n_layers + 1), info
    assert run.served == eager.served and run.served["decode"] == {"segments": P, "rows": P}
    assert same_decode_run(eager, run)

    row, step = (P // 2, P + 2), graphs.GraphDecoder.step   # a replayed prompt row, a replayed reply step

    def planted(self, tokens, positions, slots):   # one logit of those steps moved up by one ULP
        out = step(self, tokens, positions, slots)
        if list(positions) in ([row[0]], [row[1]]):
            out = out.clone()
            out[0, 0] = torch.nextafter(out[0, 0], torch.tensor(float("inf"), device=out.device))
        return out
    monkeypatch.setattr(graphs.GraphDecoder, "step", planted)
    bad = generate(gpu_weights, prompt, GEN, kernels, sched, keep_cache=True, kv_dtype=kv_dtype, graphs=True)
    assert bad.graphs["replays"] == info["replays"]
    assert not same_decode_run(eager, bad)
    assert first_differing_row(bad.prompt_logits, eager.prompt_logits) == row[0]
    assert int(ulp_distance(bad.prompt_logits, eager.prompt_logits).max()) == 1
    assert first_differing_row(bad.gen_logits, eager.gen_logits) == 3   # the step at P + 2 gives token 3's logits


@GPU
@pytest.mark.gpu
def test_gpu_hash_matrix_rows_record_graphs_and_keep_their_values(gpu_weights, monkeypatch):
    """run_prompt with graphs (hash_graphs on a CUDA device): every row records that a graph served, the oracle's
    prompt rows replayed, and the rows' hashes and byte verdicts are those of the eager runs."""
    from exactness.analysis import hashes
    from exactness.prompts import build_prompt

    def same_rows(a, b) -> bool:   # timings and the graphs record aside
        def strip(r):
            return {k: v for k, v in r.items() if k not in ("ttft_s", "decode_s", "seconds", "graphs")}
        return len(a) == len(b) and all(strip(x) == strip(y) for x, y in zip(a, b))
    args = (gpu_weights, build_prompt("short"), ["invariant"], [16], GEN, 16)
    eager, rows = hashes.run_prompt(*args), hashes.run_prompt(*args, graphs=True)
    P = rows[0]["prompt_tokens"]
    assert all(r["graphs"] is None for r in eager)
    assert all(r["graphs"]["served"] and r["graphs"]["reason"] is None for r in rows), [r["graphs"] for r in rows]
    assert [r["graphs"]["replays"] for r in rows if r["path"] == "decode"] == [P + GEN - 2]
    assert same_rows(rows, eager)
    step = graphs.GraphDecoder.step

    def planted(self, tokens, positions, slots):   # every replayed step's logits negated: other tokens picked
        out = step(self, tokens, positions, slots)
        return -out if self.replays else out
    monkeypatch.setattr(graphs.GraphDecoder, "step", planted)
    assert not same_rows(hashes.run_prompt(*args, graphs=True), eager)


class _Staged(ResidentExperts):
    """An expert provider other than the resident weights (the same experts), fetched expert by expert."""

    stacked = None   # no whole-layer route: moe_block announces and fetches each expert


class _Recorder:
    def __init__(self):
        self.calls = 0

    def record(self, **call):
        self.calls += 1


@GPU
@pytest.mark.gpu
def test_gpu_falls_back_with_reason(gpu_weights, prompt):
    eager = generate(gpu_weights, prompt, 4, "invariant", keep_cache=True)
    run = generate(gpu_weights, prompt, 4, "invariant", keep_cache=True, graphs=True,
                   experts=_Staged(gpu_weights.layers))
    assert not run.graphs["served"] and "_Staged" in run.graphs["reason"]
    assert same_run(eager, run)
    rec = _Recorder()
    with tapping(rec):
        tapped = generate(gpu_weights, prompt, 4, "invariant", keep_cache=True, graphs=True)
    assert not tapped.graphs["served"] and "taps" in tapped.graphs["reason"] and rec.calls > 0
    assert same_run(eager, tapped)
    assert graphs.why_not(gpu_weights, "fast", batch=2) is None                   # grouped experts (_grouped_mm)
    loop = dataclasses.replace(get_set("fast"), options={})                        # experts one by one
    assert "streams" in graphs.why_not(gpu_weights, loop, batch=2)
    assert graphs.why_not(gpu_weights, "invariant", batch=2) is None


def test_taps_decide_per_forward(tiny_weights):
    from exactness.analysis.taps import TapRecorder
    from exactness.model import _TAPS, taps_want, untapped
    rec = TapRecorder([3, 9], tiny_weights)
    assert rec.wants([9]) and rec.wants([0, 3]) and not rec.wants([4]) and not rec.wants([])
    with tapping(rec):
        assert taps_want([3]) and not taps_want([4])
        with untapped():
            assert not _TAPS and not taps_want([3])
        assert _TAPS == [rec]
        with tapping(_Recorder()):                      # a recorder without ``wants`` asks for every forward
            assert taps_want([4])
    assert not _TAPS and not taps_want([3])


def _sampled_bytes(rec) -> dict:
    """(set, path, class, layer, tag, pos, name) -> the sample's tensor as int16/uint8 bytes (CPU)."""
    out = {}
    for (ks, path, cls), samples in rec.samples.items():
        for s in samples:
            for name, t in s.data.items():
                out[(ks, path, cls, *s.key, name)] = t.contiguous().view(torch.uint8).clone()
    return out


def same_samples(a: dict, b: dict) -> bool:
    """The same sampled (set, path, class, layer, tag, position, name) keys, each with the same bytes."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["fast", "invariant"])
def test_gpu_taps_replay_the_forwards_they_decline(gpu_weights, prompt, kernels, monkeypatch):
    from exactness.analysis.taps import TapRecorder

    def tapped(graphs_on: bool):
        rec = TapRecorder([0, 17, 39], gpu_weights)
        with rec.run("decode"), tapping(rec):
            run = generate(gpu_weights, prompt, 1, kernels, keep_cache=True, graphs=graphs_on)
        return run, _sampled_bytes(rec)

    eager, want = tapped(False)
    run, got = tapped(True)
    assert run.graphs["served"] and run.graphs["tapped_steps"] == 3            # positions 0, 17 and 39
    assert run.graphs["replays"] == len(prompt) - 3 - 1                          # row 1 captures the graph
    assert want and same_samples(got, want)
    assert same_decode_run(eager, run)
    stale_positions(monkeypatch)                  # negative control: replays write keys at the wrong positions
    _, bad = tapped(True)
    assert not same_samples(bad, want)            # other bytes (and other routed experts sampled)


@GPU
@pytest.mark.gpu
def test_gpu_two_streams_bytes_equal_eager(gpu_weights, monkeypatch):
    from exactness.cache import KVCache
    from exactness.loop import decode_step
    from exactness.paths import prefill

    def run(graph: bool):
        w = gpu_weights
        cache = KVCache(w.cfg, 48, 2, w.dtype, w.device)
        for s, n in ((0, 30), (1, 37)):             # two streams at different positions
            prefill(w, cache, torch.arange(n) % 251, "invariant", Schedule("batched"), slot=s)
        dec = graphs.GraphDecoder(w, cache, "invariant", batch=2)
        tok, pos, out = torch.tensor([5, 9], device=w.device), [30, 37], []
        for _ in range(4):
            if graph:
                logits = dec.step(tok, pos, [0, 1])
            else:
                logits = decode_step(w, cache, tok, torch.tensor(pos, device=w.device),
                                     torch.tensor([0, 1], device=w.device), "invariant")
            out.append(logits)
            tok, pos = logits.argmax(-1), [p + 1 for p in pos]
        return torch.cat(out).cpu(), cache, dec.info()

    def same(a, b) -> bool:
        return bytes_equal(a[0], b[0]) and all(kv_first_difference(a[1].select(s), b[1].select(s)) is None
                                              for s in (0, 1))
    eager, graph = run(False), run(True)
    assert graph[2]["served"] and graph[2]["replays"] == 3 and graph[2]["reason"] is None, graph[2]
    assert graph[2]["pieces"] == 1, graph[2]    # attention of two slots, one row each, recorded in the graph
    assert same(eager, graph)
    stale_positions(monkeypatch)
    assert not same(eager, run(True))


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kernels,n", [("invariant", 1), ("invariant", 2), ("fast", 1), ("fast", 2)])
def test_gpu_concurrent_streams_on_graphs_equal_eager(gpu_weights, kernels, n, monkeypatch):
    """batch.run_streams with graphs: tokens, prompt and generated logits of every stream equal the eager run's
    as bytes, a graph served every B where graphs.why_not allows it (the fast set at B = 2 runs eagerly and says
    why: there the bytes check compares two eager runs, and only the reason is checked); control: a stale device
    position at replay must change a stream."""
    from exactness.batch import run_streams
    prompts = [torch.arange(30) % 251, torch.arange(5, 42) % 251][:n]

    def run(graph: bool):
        return run_streams(gpu_weights, prompts, GEN, kernels, Schedule("batched"), offset=0, graphs=graph)

    def same(a, b) -> bool:
        return all(bytes_equal(x.gen_ids, y.gen_ids) and bytes_equal(x.gen_logits, y.gen_logits)
                   and bytes_equal(x.prompt_logits, y.prompt_logits) for x, y in zip(a.streams, b.streams))
    eager, graph = run(False), run(True)
    info = graph.graphs[n]
    expect = graphs.why_not(gpu_weights, kernels, batch=n)
    assert info["reason"] == expect and info["served"] == (expect is None), info
    assert same(eager, graph)
    if expect is not None:
        return
    assert info["replays"] == GEN - 2   # GEN - 1 forwards; the first captures
    stale_positions(monkeypatch)
    assert not same(eager, run(True))


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kernels,draft", [("invariant", "mtp"), ("invariant", "self"), ("fast", "mtp")])
def test_gpu_drafted_on_graphs_bytes_equal_eager(gpu_weights, prompt, kernels, draft, monkeypatch):
    """generate_drafted with graphs: tokens, generated logits, the main and the MTP head's KV caches equal the
    eager drafted run's as bytes. Each set replays its verify (3 rows, batched plan) as one graph (the fast set's
    attention in its decode form), and its one-row forwards replay. Controls, each of which must change the run: a
    stale device position at every replay; at the verify's replays only; with the MTP head, a stale position at the
    head's replays only (the derived head reads no hidden row, so zeroing those would change nothing)."""
    from exactness.mtp import generate_drafted
    sched, gen = Schedule("batched", 16), 12

    def run(graph: bool):
        return generate_drafted(gpu_weights, prompt, gen, kernels, sched, k=2, draft=draft, keep_cache=True,
                                graphs=graph)
    eager, graph = run(False), run(True)
    info = graph.graphs
    verify = info["main 3 batched"]
    assert all(g["reason"] in (None, stream_forwards.ONCE) for g in info.values()), info
    assert verify["served"] and verify["replays"] >= 1, info
    assert verify["pieces"] == 1, info
    if kernels == "fast":
        assert info["head 1 decode"]["served"] and info["head 1 decode"]["reason"] is None, info
    one_row = "main 1 decode" if draft == "self" else "head 1 decode"
    assert info[one_row]["replays"] >= 1, info
    assert graph.graphs_record()["served"]
    assert same_drafted(eager, graph)
    load = graphs.GraphForward._load

    def planted(fault):
        def faulty(self, tokens, positions, slots, hidden):
            load(self, tokens, positions, slots, hidden)
            if self.pieces is not None:
                fault(self)
        monkeypatch.setattr(graphs.GraphForward, "_load", faulty)
        bad = run(True)
        monkeypatch.setattr(graphs.GraphForward, "_load", load)
        assert bad.graphs_record()["served"]
        return bad
    assert not same_drafted(eager, planted(lambda g: g.positions.sub_(1)))
    # the verify graph alone: its rows' KV written one position early
    assert not same_drafted(eager, planted(lambda g: g.positions.sub_(1) if g.head is None and g.n > 1 else 0))
    if draft == "mtp":                      # the head's graphs alone: its rows' KV written one position early
        assert not same_drafted(eager, planted(lambda g: g.positions.sub_(1) if g.head is not None else 0))


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("sched", ["decode", "batched"])
def test_gpu_programmatic_dependent_launch_keeps_every_byte(gpu_weights, prompt, sched, monkeypatch):
    """The invariant set's kernels launched with PDL (launch_pdl, griddepcontrol.wait first: sm_90+) and without:
    prompt logits, tokens, generated logits and KV bytes equal, eagerly and on graphs. Each arm's launches are
    checked to have taken its setting (the fast launcher's cache, emptied per arm). That the driver runs the PDL
    launches early is not asserted here: benchmarks/bench_gpu_kernels.py times it. Negative control: a stale device
    position in the PDL graph run is caught by the same comparison."""
    from exactness.kernels import triton_rows as tr
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    runs = {}
    for pdl in (False, True):
        monkeypatch.setattr(tr, "PDL", pdl)
        monkeypatch.setattr(tr, "_COMPILED", {})
        for g in (False, True):
            runs[pdl, g] = generate(gpu_weights, prompt, GEN, "invariant", Schedule(sched), keep_cache=True, graphs=g)
        assert tr._COMPILED and {key[2] for key in tr._COMPILED} == {pdl}
        assert runs[pdl, True].graphs["served"] and runs[pdl, True].graphs["reason"] is None
    ref = runs[False, False]
    assert ref.prompt_logits is not None
    for k, run in runs.items():
        assert same_decode_run(ref, run), k

    stale_positions(monkeypatch)
    bad = generate(gpu_weights, prompt, GEN, "invariant", Schedule(sched), keep_cache=True, graphs=True)
    assert bad.graphs["served"] and not same_decode_run(ref, bad)
