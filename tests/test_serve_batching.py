"""Continuous batching in ``exactness serve``: with the invariant set every request of a batch that grows, shrinks
and reuses slots equals paths.generate alone (tokens, top logprobs, prompt logprobs, as bytes); a planted
batch-dependent fault is caught; the fast set still answers; 32 concurrent streams complete."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import exactness.loop as loop
from exactness.exact import bytes_equal
from exactness.kernels import get_set
from exactness.paths import Schedule, generate
from exactness.engines.serve import Served, create_app
from exactness.engines.serve_batch import END, Job, Scheduler
from exactness.tokenizer import ByteTokenizer
from faults import row0_perturbed
from http_servers import ThreadServer

SCHED = Schedule("batched", 16)
N_TOP, N_PROMPT_TOP = 3, 2
# (prompt cut, tokens): 8 requests of different lengths for 3 slots, so slots are reused and requests end apart
LOAD = [(40, 16), (9, 4), (25, 8), (33, 5), (12, 10), (48, 4), (17, 6), (60, 3)]


def stream(url: str, body: dict, on_chunk=None) -> list[dict]:
    """The JSON chunks of one streamed completion (asserts status 200 and a final [DONE])."""
    chunks, done = [], False
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
                assert "error" not in chunks[-1], chunks[-1]
                if on_chunk:
                    on_chunk(len(chunks))
    assert done
    return chunks


def wait_for(url: str, pred, what: str) -> dict:
    """Poll /exactness/stats until ``pred(stats)`` holds (a deadline only guards against a hang)."""
    deadline = time.monotonic() + 60
    while not pred(s := httpx.get(url + "/exactness/stats").json()):
        assert time.monotonic() < deadline, f"scheduler never reached {what}: {s}"
        time.sleep(0.01)
    return s


def staggered_run(w, kernels, prompt, monkeypatch, max_batch=3) -> tuple[list[list[dict]], list[int]]:
    """LOAD against a server of ``max_batch`` slots and 256 positions: request 0 starts decoding alone, the others
    arrive while its first decode step is held, then join between its steps (the batch grows), wait for free
    slots, and leave at different steps (it shrinks). Returns each request's chunks and the decode batch sizes."""
    gate, real = threading.Event(), loop.decode_step

    def held(*a, **k):   # the decode step runs unchanged once the gate is open
        assert gate.wait(60), "the decode gate was never opened"
        return real(*a, **k)
    monkeypatch.setattr(loop, "decode_step", held)
    m = Served("tiny", w, ByteTokenizer(), kernels, SCHED, max_batch=max_batch, max_model_len=256)
    bodies = [{"prompt": prompt[:p].tolist(), "max_tokens": g, "ignore_eos": True, "logprobs": N_TOP,
               "prompt_logprobs": N_PROMPT_TOP, "return_tokens_as_token_ids": True} for p, g in LOAD]
    first = threading.Event()
    with ThreadServer(create_app(m)) as s, ThreadPoolExecutor(len(LOAD)) as pool:
        futs = [pool.submit(stream, s.url, bodies[0], lambda n: n == 1 and first.set())]
        assert first.wait(60), "request 0 never streamed its first token"
        futs += [pool.submit(stream, s.url, b) for b in bodies[1:]]
        wait_for(s.url, lambda st: st["waiting"] == len(LOAD) - 1, "all requests queued")
        gate.set()
        out = [f.result() for f in futs]
    return out, list(m.scheduler.batch_sizes)


@pytest.fixture(scope="module")
def prompt(code_prompt):
    return code_prompt.ids[:60]


@pytest.fixture(scope="module")
def alone(tiny_weights, prompt):
    """paths.generate alone per LOAD request (invariant set): the oracle of every served one."""
    return [generate(tiny_weights, prompt[:p], g, "invariant", SCHED) for p, g in LOAD]


def mismatches(out: list[list[dict]], alone) -> list[str]:
    """What differs, as bytes, between each served request and its run alone: tokens, the chosen tokens'
    logprobs, the top-N logprob values, the prompt tokens' logprobs."""
    bad = []
    for j, (chunks, run) in enumerate(zip(out, alone)):
        chs = [c["choices"][0] for c in chunks if c["choices"]]
        ids = torch.tensor([t for c in chs for t in c["token_ids"]], dtype=torch.int64)
        if not bytes_equal(ids, run.gen_ids):
            bad.append(f"request {j}: tokens")
            continue
        lp = torch.log_softmax(run.gen_logits, dim=-1)                                        # [G, V] fp32
        got = torch.tensor([v for c in chs for v in c["logprobs"]["token_logprobs"]], dtype=torch.float32)
        if not bytes_equal(got, lp[torch.arange(len(ids)), ids]):
            bad.append(f"request {j}: token logprobs")
        tops = torch.tensor([sorted(t.values(), reverse=True) for c in chs for t in c["logprobs"]["top_logprobs"]])
        if not bytes_equal(tops.float(), torch.topk(lp, N_TOP, dim=1).values):
            bad.append(f"request {j}: top logprobs")
        plp = torch.log_softmax(run.prompt_logits, dim=-1)[:-1]                               # [P-1, V]
        p_ids = run.prompt_ids[1:].tolist()
        served = torch.tensor([d[str(t)]["logprob"] for d, t in zip(chs[0]["prompt_logprobs"][1:], p_ids)])
        if not bytes_equal(served.float(), plp[torch.arange(len(p_ids)), run.prompt_ids[1:]]):
            bad.append(f"request {j}: prompt logprobs")
    return bad


def test_invariant_batched_requests_equal_alone(tiny_weights, prompt, alone, monkeypatch):
    out, sizes = staggered_run(tiny_weights, get_set("invariant"), prompt, monkeypatch)
    print(f"decode batch sizes: {sizes}")
    assert max(sizes) == 3 and sizes[0] == 1                      # request 0 decoded alone, then others joined
    grew = any(a < b for a, b in zip(sizes, sizes[1:]))
    shrank = any(a > b for a, b in zip(sizes, sizes[1:]))
    assert grew and shrank
    assert mismatches(out, alone) == []


def test_planted_batch_fault_is_caught(tiny_weights, prompt, alone, monkeypatch):
    """Negative control: decode RMSNorm changed on row 0 of every call of more than one row (alone: never)."""
    faulty = row0_perturbed("rmsnorm", lambda t: t * (1 + 2 ** -7), roles=("decode",))
    out, sizes = staggered_run(tiny_weights, faulty, prompt, monkeypatch)
    bad = mismatches(out, alone)
    print(f"planted fault: {bad}")
    assert max(sizes) > 1 and bad


def test_fast_set_batched_still_answers(prompt, tiny_weights, monkeypatch):
    """The control: the fast set's rows may depend on the batch; every request is answered in full."""
    out, sizes = staggered_run(tiny_weights, get_set("fast"), prompt, monkeypatch)
    fast_alone = [generate(tiny_weights, prompt[:p], g, "fast", SCHED) for p, g in LOAD]
    bad = mismatches(out, fast_alone)
    print(f"fast set, batch sizes up to {max(sizes)}: differs from alone in {bad or 'nothing'}")
    for chunks, (_, g) in zip(out, LOAD):
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) == g


def _collect(sch: Scheduler, job: Job) -> list:
    """The items a Scheduler emits for ``job``, END excluded."""
    items, done = [], threading.Event()
    sch.submit(job, lambda x: items.append(x) or (x is END and done.set()))
    assert done.wait(60)
    return items[:-1]


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3_block"])
def test_stale_slot_and_large_capacity_change_no_byte(tiny_weights, prompt, code_prompt, kv_dtype):
    """The scheduler alone (no HTTP), max_batch 1: a cache of 512 positions whose slot holds an earlier, longer
    request's rows (bf16: random rows at every position before that) gives the bytes of paths.generate's P + G
    cache, for tokens, their logprobs and the prompt logprobs."""
    sch = Scheduler(tiny_weights, get_set("invariant"), SCHED, kv_dtype, 1, 512)
    if kv_dtype == "bf16":
        for t in sch.cache.k + sch.cache.v:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(t.dtype))
    _collect(sch, Job(ids=code_prompt.ids[:90], max_tokens=30, ignore_eos=True))   # past every later P + G
    for p, g in LOAD[:3]:
        run = generate(tiny_weights, prompt[:p], g, "invariant", SCHED, kv_dtype=kv_dtype)
        rows, *steps = _collect(sch, Job(ids=prompt[:p], max_tokens=g, logprobs=N_TOP, ignore_eos=True,
                                         prompt_top=1))
        assert bytes_equal(torch.tensor([s.token for s in steps]), run.gen_ids)
        lp = torch.log_softmax(run.gen_logits, dim=-1)
        assert bytes_equal(torch.tensor([s.logprobs[0] for s in steps], dtype=torch.float32),
                           lp[torch.arange(g), run.gen_ids])
        plp = torch.log_softmax(run.prompt_logits, dim=-1)[:-1]
        assert bytes_equal(torch.tensor(rows.logprob, dtype=torch.float32),
                           plp[torch.arange(p - 1), run.prompt_ids[1:]])
    assert sch.cache.capacity == 512 and sch.max_rows == 1


def test_32_concurrent_streams_complete(tiny_weights, prompt):
    """32 streamed requests at once to a server of 8 slots: all complete with their tokens (invariant: equal to
    alone); the largest decode batch is reported."""
    m = Served("tiny", tiny_weights, ByteTokenizer(), get_set("invariant"), SCHED, max_model_len=128)
    lengths = (9, 20, 33, 47)
    cuts = [lengths[j % 4] for j in range(32)]
    with ThreadServer(create_app(m)) as s, ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda p: stream(s.url, {"prompt": prompt[:p].tolist(), "max_tokens": 4,
                                                      "ignore_eos": True}), cuts))
        stats = httpx.get(s.url + "/exactness/stats").json()
    print(f"32 streams, max_batch 8: {stats}")
    refs = {p: generate(tiny_weights, prompt[:p], 4, "invariant", SCHED).gen_ids.tolist() for p in lengths}
    for chunks, p in zip(outs, cuts):
        assert [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]] == refs[p]
    assert 1 <= stats["max_rows"] <= 8 and stats["active"] == 0 and stats["waiting"] == 0


def test_max_batch_1_serves_one_at_a_time(tiny_weights, prompt):
    m = Served("tiny", tiny_weights, ByteTokenizer(), get_set("fast"), SCHED, max_batch=1, max_model_len=128)
    with ThreadServer(create_app(m)) as s, ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: stream(s.url, {"prompt": prompt[:p].tolist(), "max_tokens": 5}), (9, 20, 31, 40)))
        models = httpx.get(s.url + "/v1/models").json()["data"][0]
        fp = httpx.post(s.url + "/v1/completions", json={"prompt": [256], "max_tokens": 1}).json()
    assert set(m.scheduler.batch_sizes) == {1} and ":max_batch=1:" in fp["system_fingerprint"]
    assert (models["max_batch"], models["max_model_len"]) == (1, 128)


def test_bad_batch_options_refused(tiny_weights):
    with pytest.raises(ValueError, match="max_batch must be an int >= 1.*got 0"):
        Served("tiny", tiny_weights, None, get_set("fast"), SCHED, max_batch=0)
    with pytest.raises(ValueError, match=r"max_model_len must be in 1\.\.\d+.*got 0"):
        Served("tiny", tiny_weights, None, get_set("fast"), SCHED, max_model_len=0)
