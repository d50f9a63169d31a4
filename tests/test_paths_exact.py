"""End to end on the tiny preset (bf16; the path matrix also in fp32): with the invariant kernel set, batched and
deep prefill at two step sizes (128 and 77, the latter no multiple of 64) reproduce the serial-decode oracle's
generated tokens, the bytes of every prompt row's logits, of the generated tokens' logits and of the whole KV cache;
and a prefill split off any grid (77 rows, then the rest) continues to the same bytes as one unsplit prefill.
Negative controls: a planted fault (row 0 of multi-row RMSNorm calls one ULP off) makes the batched prompt logits
and the split prefill differ, on every machine; the fast set's own differences, which depend on the CPU, are
measured first and the comparison must agree with the measurement.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from exactness.cache import KVCache
from exactness.config import get_preset
from exactness.exact import bytes_equal, kv_first_difference
from exactness.kernels import KernelSet, get_set
from exactness.loop import decode_step
from exactness.paths import Schedule, generate, prefill
from exactness.prompts import build_prompt
from exactness.weights import synthetic_weights

import brute
from faults import row0_rmsnorm_perturbed

PROMPTS = ("short", "code", "docs")
MAX_TOKENS = 200
GEN = 8
STEPS = (128, 77)
DEEP_THRESHOLD = 32   # below every segment these prompts produce at these steps, so deep serves every segment
SPLIT = 77


def cache_bytes_equal(a: KVCache, b: KVCache, n: int) -> bool:
    """Both caches hold ``n`` positions in slot 0 with the same bytes, every layer, keys and values."""
    return a.lengths[0] == n and kv_first_difference(a, b) is None


@pytest.fixture(scope="module")
def weights():
    return synthetic_weights(get_preset("tiny"), torch.bfloat16)


@pytest.fixture(scope="module")
def prompt_ids():
    return {p: build_prompt(p, MAX_TOKENS).ids for p in PROMPTS}


@pytest.fixture(scope="module")
def oracles(weights, prompt_ids):
    """dtype -> prompt -> the invariant set's decode-path run (with its cache)."""
    out = {}
    for dt in ("bfloat16", "float32"):
        w = weights if dt == "bfloat16" else weights.to(dtype=torch.float32)
        out[dt] = (w, {p: generate(w, ids, GEN, "invariant", Schedule("decode"), keep_cache=True)
                       for p, ids in prompt_ids.items()})
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("path", ["batched", "deep"])
@pytest.mark.parametrize("step", STEPS)
def test_invariant_prefill_paths_equal_the_oracle_in_bytes(prompt_ids, oracles, dtype, prompt, path, step):
    ids, (w, runs) = prompt_ids[prompt], oracles[dtype]
    oracle = runs[prompt]
    run = generate(w, ids, GEN, "invariant", Schedule(path, step, DEEP_THRESHOLD), keep_cache=True)
    if path == "deep":
        assert run.served["deep"]["rows"] == ids.numel() and run.served["batched"]["rows"] == 0, run.served
    else:
        assert run.served["batched"]["segments"] == -(-ids.numel() // step)
    assert torch.equal(run.gen_ids, oracle.gen_ids)
    assert bytes_equal(run.prompt_logits, oracle.prompt_logits)
    assert bytes_equal(run.gen_logits, oracle.gen_logits)
    assert cache_bytes_equal(run.cache, oracle.cache, ids.numel() + GEN - 1)


def test_fast_set_prompt_logits_against_its_oracle(weights, prompt_ids):
    """The fast set's batched prefill against its own oracle: whether its prompt rows differ depends on the CPU's
    instruction set, so plain loops measure first (tests/brute.py) and the comparison must agree with them."""
    ids = prompt_ids["code"]
    oracle = generate(weights, ids, 1, "fast", Schedule("decode"))
    run = generate(weights, ids, 1, "fast", Schedule("batched", STEPS[1]))
    first = brute.first_row(run.prompt_logits, oracle.prompt_logits)
    assert bytes_equal(run.prompt_logits, oracle.prompt_logits) == (first is None)


def test_planted_fault_prompt_logits_differ_from_the_oracle(weights, prompt_ids):
    """Negative control on every machine: a prompt RMSNorm one ULP off on row 0 of every multi-row call changes the
    batched prefill's prompt logits, and the comparison says so, from the first chunk's row 0 on."""
    ids = prompt_ids["code"]
    ks = row0_rmsnorm_perturbed()
    oracle = generate(weights, ids, 1, ks, Schedule("decode"))
    run = generate(weights, ids, 1, ks, Schedule("batched", STEPS[1]))
    assert not bytes_equal(run.prompt_logits, oracle.prompt_logits)
    assert brute.first_row(run.prompt_logits, oracle.prompt_logits) == 0


def greedy_after_prefill(w, cache: KVCache, logits: torch.Tensor, n_prompt: int, kernels: str, n: int):
    """Continue greedily from prompt logits [P, V]: returns (token ids [n], their logits [n, V])."""
    ks = get_set(kernels)
    slots = torch.zeros(1, dtype=torch.int64)
    last, toks, logs = logits[-1:], [], []
    for i in range(n):
        toks.append(ks.fn("argmax", "decode")(last))
        logs.append(last)
        if i + 1 < n:
            last = decode_step(w, cache, toks[-1], torch.tensor([n_prompt + i]), slots, ks)
    return torch.cat(toks), torch.cat(logs)


def split_vs_whole(w, ids: torch.Tensor, kernels: str):
    """(unsplit, split at SPLIT) -> each (prompt logits, cache, next tokens, their logits)."""
    out = []
    for cuts in ((0, ids.numel()), (0, SPLIT, ids.numel())):
        cache = KVCache(w.cfg, ids.numel() + GEN, 1, w.dtype, w.device)
        logits = torch.cat([prefill(w, cache, ids[a:b], kernels, Schedule("batched"), start=a).logits
                            for a, b in zip(cuts[:-1], cuts[1:])])
        toks, logs = greedy_after_prefill(w, cache, logits, ids.numel(), kernels, GEN)
        out.append((logits, cache, toks, logs))
    return out


@pytest.mark.parametrize("prompt", ["code", "docs"])
def test_invariant_prefill_split_off_grid_equals_unsplit(weights, prompt_ids, prompt):
    ids = prompt_ids[prompt]
    (la, ca, ta, ga), (lb, cb, tb, gb) = split_vs_whole(weights, ids, "invariant")
    assert bytes_equal(la, lb) and bytes_equal(ga, gb) and torch.equal(ta, tb)
    assert cache_bytes_equal(ca, cb, ids.numel() + GEN - 1)


def test_fast_prefill_split_off_grid_against_unsplit(weights, prompt_ids):
    """The fast set's split prefill against its unsplit one, measured first by plain loops (CPU-dependent), the
    comparison agreeing."""
    (la, _, _, _), (lb, _, _, _) = split_vs_whole(weights, prompt_ids["code"], "fast")
    assert bytes_equal(la, lb) == (brute.first_row(la, lb) is None)


def test_planted_fault_split_prefill_differs_from_unsplit(weights, prompt_ids):
    """Negative control on every machine: with row 0 of every multi-row RMSNorm call one ULP off, the split
    prefill's second part starts with a perturbed row that the unsplit prefill computes unperturbed."""
    (la, _, _, _), (lb, _, _, _) = split_vs_whole(weights, prompt_ids["code"], row0_rmsnorm_perturbed())
    assert not bytes_equal(la, lb)
    assert brute.first_row(la, lb) == SPLIT


def recording(rows: dict, tiles_in_kernels: bool) -> KernelSet:
    """The invariant set, with or without its ``tiles_in_kernels`` option, whose prompt dense and expert gate/up
    kernels append each call's row count to ``rows[cls]``; not registered."""
    ks = get_set("invariant")

    def rec(cls, fn):
        def f(x, *args, **kw):
            rows.setdefault(cls, []).append(x.shape[0])
            return fn(x, *args, **kw)
        return f
    prompt = {c: (replace(s, fn=rec(c, s.fn)) if c in ("dense", "expert_gate_up") else s) for c, s in ks.prompt.items()}
    options = {k: v for k, v in ks.options.items() if k != "tiles_in_kernels" or tiles_in_kernels}
    return replace(ks, name=f"invariant+rows-{tiles_in_kernels}", prompt=prompt, options=options)


def test_deep_plan_hands_whole_calls_to_a_set_that_tiles_in_its_kernels(weights, prompt_ids):
    """The deep plan calls the invariant set's dense and expert kernels once per call's rows (the set's option
    ``tiles_in_kernels``), and the same set without that option once per 64-row (64-member) host tile; both give the
    same generated tokens, prompt-logit bytes and KV-cache bytes, as the kernels' row bytes do not depend on M."""
    ids = prompt_ids["code"]
    P, runs, rows = ids.numel(), {}, {}
    for whole in (True, False):
        rows[whole] = {}
        runs[whole] = generate(weights, ids, GEN, recording(rows[whole], whole), Schedule("deep", None, 32),
                               keep_cache=True)
        assert runs[whole].served["deep"]["rows"] == P, runs[whole].served
    assert P > 64 and max(rows[True]["dense"]) == P and max(rows[False]["dense"]) == 64
    assert max(rows[False]["expert_gate_up"]) <= 64 <= max(rows[True]["expert_gate_up"])
    a, b = runs[True], runs[False]
    assert torch.equal(a.gen_ids, b.gen_ids)
    assert bytes_equal(a.prompt_logits, b.prompt_logits)
    assert cache_bytes_equal(a.cache, b.cache, P + GEN - 1)


def test_deep_plan_keeps_host_tiles_while_tapped(weights, prompt_ids):
    """While kernel calls are tapped, the deep plan hands even a ``tiles_in_kernels`` set 64-row tiles (the taps
    record the deep plan's calls as tiles); untapped, the same run makes whole calls."""
    from exactness.model import tapping

    class Count:
        calls = 0

        def record(self, **call):
            Count.calls += 1
    ids, tapped, untapped = prompt_ids["code"], {}, {}
    with tapping(Count()):
        generate(weights, ids, 1, recording(tapped, True), Schedule("deep", None, 32))
    generate(weights, ids, 1, recording(untapped, True), Schedule("deep", None, 32))
    assert Count.calls > 0 and max(tapped["dense"]) == 64 and max(untapped["dense"]) == ids.numel()
