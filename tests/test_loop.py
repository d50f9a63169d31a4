"""The one greedy loop (loop.py) and the one run record (run.Run): token 0 follows one role rule in every run kind,
and every run kind's tokens and logits rows come from the same loop (byte-equal with the invariant set).

Tiny preset, bf16, CPU."""
import threading
from dataclasses import replace

import pytest
import torch

from exactness.batch import run_packed, run_streams
from exactness.engines.serve_batch import END, Job, Scheduler
from exactness.exact import as_int
from exactness.kernels import get_set
from exactness.loop import first_token
from exactness.mtp import generate_drafted
from exactness.paths import Schedule, generate
from exactness.prompt_cache import PromptCache, generate_cached
from exactness.prompts import build_prompt
from exactness.run import Run

GEN, STEP = 4, 16


@pytest.fixture(scope="module")
def ids():
    return build_prompt("code", max_tokens=40).ids


def prompt_argmax_shifted():
    """The invariant set with the "prompt" role's argmax planted: it picks the next id after the top-1 (mod V).
    The decode role is untouched."""
    ks = get_set("invariant")
    spec = ks.prompt["argmax"]
    shifted = replace(spec, fn=lambda x, f=spec.fn: (f(x) + 1) % x.shape[-1])
    return replace(ks, name="invariant+prompt-argmax-shifted", prompt={**ks.prompt, "argmax": shifted})


def served(w, ids, ks, schedule, gen=GEN) -> tuple[torch.Tensor, torch.Tensor]:
    """``exactness serve``'s Scheduler alone with one request: (token ids [G], the logits rows [G, V] they were
    picked from)."""
    sch = Scheduler(w, ks, schedule, "bf16", max_batch=2, max_len=int(ids.numel()) + gen)
    rows, steps, done = [], [], threading.Event()
    step = sch._step
    sch._step = lambda r, tok, row: rows.append(row.cpu()) or step(r, tok, row)   # keep the rows it emits from
    sch.submit(Job(ids, gen, ignore_eos=True), lambda x: done.set() if x is END else steps.append(x))
    assert done.wait(120), "the scheduler never finished the request"
    return torch.tensor([s.token for s in steps]), torch.cat(rows)


def token0(kind: str, w, ids, ks, schedule) -> int:
    """Token 0 of one run kind under ``schedule`` (packed: the packed prefill, whatever the schedule)."""
    if kind == "plain":
        return int(generate(w, ids, GEN, ks, schedule).gen_ids[0])
    if kind == "resumed":
        pc = PromptCache(1.0, "any")
        generate_cached(w, pc, ids[:20], 1, ks, schedule)
        run = generate_cached(w, pc, ids, GEN, ks, schedule)
        assert run.prompt_start == 20
        return int(run.gen_ids[0])
    if kind == "concurrent":
        return int(run_streams(w, [ids, ids[:30]], GEN, ks, schedule, offset=1).streams[0].gen_ids[0])
    if kind == "packed":
        return int(run_packed(w, [ids, ids[:30]], GEN, ks)[0].gen_ids[0])
    if kind == "drafted":
        return int(generate_drafted(w, ids, GEN, ks, schedule, k=2).gen_ids[0])
    return int(served(w, ids, ks, schedule)[0][0])


KINDS = ("plain", "resumed", "concurrent", "packed", "drafted", "serve")


@pytest.mark.parametrize("kind", KINDS)
def test_token0_takes_the_argmax_of_the_role_that_computed_the_last_prompt_row(tiny_weights, ids, kind):
    """A fault planted in the "prompt" argmax only moves token 0 of every run kind whose last prompt row came from
    a prompt plan (batched prefill, resumed tail, concurrent join, packed prefill, drafted prefill, serve's
    admission), and of none on the decode path (its rows ran the decode kernels): one rule for all."""
    bad = prompt_argmax_shifted()
    batched = Schedule("batched", STEP)
    clean = token0(kind, tiny_weights, ids, "invariant", batched)
    assert token0(kind, tiny_weights, ids, bad, batched) == (clean + 1) % tiny_weights.cfg.vocab_size
    if kind != "packed":   # a packed prefill is a prompt-plan forward whatever the schedule
        decode = Schedule("decode")
        assert token0(kind, tiny_weights, ids, bad, decode) == token0(kind, tiny_weights, ids, "invariant", decode)


def test_first_token_is_the_role_s_argmax():
    ks, bad = get_set("invariant"), prompt_argmax_shifted()
    row = torch.tensor([[0.0, 3.0, 1.0, -2.0]])
    assert first_token(ks, row, "prompt").tolist() == [1] and first_token(bad, row, "decode").tolist() == [1]
    assert first_token(bad, row, "prompt").tolist() == [2]


def test_every_run_kind_shares_the_loop_bytes(tiny_weights, ids):
    """plain (paths.generate), concurrent (run_streams, alone and beside another stream), packed (run_packed),
    resumed (generate_cached) and serve's Scheduler give the same tokens and logits rows, compared as integer
    views, for the same prompt with the invariant set."""
    w, sched = tiny_weights, Schedule("batched")
    ref = generate(w, ids, GEN, "invariant", sched)
    pc = PromptCache(1.0, "any")
    generate_cached(w, pc, ids[:20], 1, "invariant", sched)
    runs = {"concurrent": run_streams(w, [ids[:30], ids], GEN, "invariant", sched, offset=1).streams[1],
            "packed": run_packed(w, [ids[:30], ids], GEN, "invariant")[1],
            "resumed": generate_cached(w, pc, ids, GEN, "invariant", sched)}
    got = {k: (r.gen_ids, r.gen_logits) for k, r in runs.items()}
    got["serve"] = served(w, ids, "invariant", sched)
    assert ref.gen_logits.shape == (GEN, w.cfg.vocab_size)
    for kind, (tokens, rows) in got.items():
        assert torch.equal(tokens, ref.gen_ids), kind
        assert torch.equal(as_int(rows), as_int(ref.gen_logits)), kind


def test_every_run_kind_returns_one_record(tiny_weights, ids):
    """One record: Run, named by its configuration, with what served it reachable."""
    w = tiny_weights
    plain = generate(w, ids, GEN, "invariant", Schedule("deep", STEP, 16), keep_cache=True)
    assert isinstance(plain, Run) and plain.config == "deep-16" and plain.path == "deep" and plain.step == STEP
    assert plain.served["deep"]["rows"] == 32 and plain.kernels == "invariant" and plain.graphs_record() is None
    assert len(plain.kv) == 2 * w.cfg.n_layers and plain.kv[0].shape[0] == ids.numel() + GEN - 1
    assert len(plain.token_times) == GEN and plain.ttft_s == plain.token_times[0]
    drafted = generate_drafted(w, ids, GEN, "invariant", Schedule("batched"), k=2)
    packed = run_packed(w, [ids], GEN, "invariant", "deep")[0]
    streams = run_streams(w, [ids], GEN, "invariant", Schedule("batched", STEP))
    assert all(isinstance(r, Run) for r in (drafted, packed, *streams.streams))
    assert (drafted.config, packed.config, packed.path, streams.streams[0].config) == (
        "batched", "packed-deep", "packed", f"batched-{STEP}")
    assert drafted.stats.rounds > 0 and streams.streams[0].info["join_step"] == 0


def test_a_progress_bar_does_not_stop_the_stream(tiny_weights, ids):
    """tqdm's update returns True when it redraws; the bar's callback must not read as "stop"."""
    class Bar:
        n = 0

        def update(self, k):
            self.n += k
            return True
    bar = Bar()
    run = generate(tiny_weights, ids, GEN, "invariant", Schedule("batched", STEP), progress=bar)
    assert run.gen_ids.numel() == GEN and bar.n == ids.numel() + GEN
