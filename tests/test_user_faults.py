"""Faults a user's kernel set (``module:ATTR``) may carry that only some calls of the forward show, each planted
through a user module and caught by the ``ci`` profile's parameters in the section named; an identical copy of
the same set stays clean there. The sections run directly (their run_section), on the fault's kernel class."""
from __future__ import annotations

import re

import pytest

from exactness.analysis import streams
from exactness.analysis.contract import cases
from exactness.analysis.contract import check as contract
from exactness.checkpoint import load_model
from exactness.kernels import set_names
from exactness.params import ParamError, check_common
from exactness.profiles import PROFILES
from exactness.prompt_files import build_prompts
from exactness.weights import sharing_synthetic_weights
from user_modules import user_module

MODULE = "user_faults_kit"
SOURCE = '''
import dataclasses

import torch

from exactness.config import PRESETS
from exactness.kernels import KERNEL_SETS

_inv = KERNEL_SETS["invariant"]
BUMP = 1 + 2 ** -5      # a few ULPs of bf16


def _spec(cls, role, fn):
    return dataclasses.replace(getattr(_inv, role)[cls], fn=fn)


def _set(name, decode=None, prompt=None, **options):
    """A copy of invariant with kernels replaced; options added (grouped_experts dropped: it would route around
    the expert kernels on CUDA)."""
    opts = {k: v for k, v in _inv.options.items() if k != "grouped_experts"}
    return dataclasses.replace(_inv, name=name, description=f"{name}: invariant with kernels replaced",
                               decode={**_inv.decode, **(decode or {})}, prompt={**_inv.prompt, **(prompt or {})},
                               options={**opts, **options})


def _by_expert(fn, bad=None):
    """An expert kernel taking expert_id=; with ``bad`` its rows of that expert a few ULPs off."""
    def kernel(x, *w, expert_id=None):
        assert expert_id is not None, "an expert-id-aware kernel called without expert_id"
        y = fn(x, *w)
        return y * BUMP if expert_id == bad else y
    return kernel


def _experts(name, bad):
    g, d = _inv.decode["expert_gate_up"].fn, _inv.decode["expert_down"].fn
    return _set(name, decode={"expert_gate_up": _spec("expert_gate_up", "decode", _by_expert(g)),
                              "expert_down": _spec("expert_down", "decode", _by_expert(d))},
                prompt={"expert_gate_up": _spec("expert_gate_up", "prompt", _by_expert(g, bad)),
                        "expert_down": _spec("expert_down", "prompt", _by_expert(d))},
                expert_id_aware=True)


EXPERT_CLEAN = _experts("u_expert_clean", None)
EXPERT_FAULT = _experts("u_expert_fault", 5)        # expert 5's gate/up rows only


def _attention(fn, when):
    def kernel(q, k_cache, v_cache, slots, positions):
        out = fn(q, k_cache, v_cache, slots, positions)
        return out * BUMP if when(q, k_cache) else out
    return kernel


_att = _inv.prompt["attention"].fn
FP8_CLEAN = _set("u_fp8_clean", prompt={"attention": _spec("attention", "prompt",
                                                           _attention(_att, lambda q, k: False))})
FP8_FAULT = _set("u_fp8_fault", prompt={"attention": _spec(
    "attention", "prompt", _attention(_att, lambda q, k: k.dtype == torch.uint8))})   # fp8 caches only
_datt = _inv.decode["attention"].fn
ROWS_CLEAN = _set("u_rows_clean", decode={"attention": _spec("attention", "decode",
                                                             _attention(_datt, lambda q, k: False))})
ROWS_FAULT = _set("u_rows_fault", decode={"attention": _spec(
    "attention", "decode", _attention(_datt, lambda q, k: q.shape[0] > 1))})   # decode calls of M > 1 rows


def _packing(fn, stale):
    """An expert kernel that packs its weight once per buffer; ``stale``: keyed by the buffer's address alone,
    so a buffer refilled with another expert's weights (an offload ring slot) reuses the old packing."""
    packed = {}

    def kernel(h, wd):
        if not stale:
            return fn(h, wd.clone())
        return fn(h, packed.setdefault((wd.data_ptr(), tuple(wd.shape), wd.dtype), wd.clone()))
    return kernel


_down = _inv.prompt["expert_down"].fn
def _ties(fn, swap):
    """A router whose ``swap`` reverses the tie-break of experts 0 and 1 (the higher id first) in calls routing in
    groups only."""
    def kernel(x, w, top_k, norm, groups=None):
        weights, idx, logits = fn(x, w, top_k, norm, groups)
        if swap and groups is not None:
            tie = (logits[:, 0] == logits[:, 1])[:, None]
            idx = torch.where(tie & (idx == 0), 1, torch.where(tie & (idx == 1), 0, idx))
        return weights, idx, logits
    return kernel


_router = _inv.prompt["router"].fn
TIES_CLEAN = _set("u_ties_clean", prompt={"router": _spec("router", "prompt", _ties(_router, False))})
TIES_FAULT = _set("u_ties_fault", prompt={"router": _spec("router", "prompt", _ties(_router, True))})


def _top4(fn, bump):
    """moe_combine with ``bump``: a few ULPs off once a row combines four or more routed experts."""
    def kernel(y, weights, shared):
        out = fn(y, weights, shared)
        return out * BUMP if bump and weights.shape[1] >= 4 else out
    return kernel


_comb = _inv.prompt["moe_combine"].fn
TOP4_CLEAN = _set("u_top4_clean", prompt={"moe_combine": _spec("moe_combine", "prompt", _top4(_comb, False))})
TOP4_FAULT = _set("u_top4_fault", prompt={"moe_combine": _spec("moe_combine", "prompt", _top4(_comb, True))})
# The tiny preset's layers routing top-4 of 16 experts (16 in 4 groups of 4: ci's routing groups [4, 1] fit)
TOP4 = PRESETS["tiny"].replace(name="tiny_top4", n_experts=16, top_k=4)



def _verify_rows(fn, bump):
    """dense with ``bump``: rows >= 1 of a prompt-role call of 2..5 rows a few ULPs off (a drafted decode's verify
    forward of k + 1 rows; the prefill's segments are longer, a decode step has one row)."""
    def kernel(x, w):
        y = fn(x, w)
        if bump and 2 <= x.shape[0] <= 5:
            y = torch.cat([y[:1], y[1:] * BUMP])
        return y
    return kernel


_dense = _inv.prompt["dense"].fn
VERIFY_CLEAN = _set("u_verify_clean", prompt={"dense": _spec("dense", "prompt", _verify_rows(_dense, False))})
VERIFY_FAULT = _set("u_verify_fault", prompt={"dense": _spec("dense", "prompt", _verify_rows(_dense, True))})

SLOT_CLEAN = _set("u_slot_clean", prompt={"expert_down": _spec("expert_down", "prompt", _packing(_down, False))})
SLOT_FAULT = _set("u_slot_fault", prompt={"expert_down": _spec("expert_down", "prompt", _packing(_down, True))})
'''


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """The module above importable; the sets and presets it gave unregistered afterwards."""
    with user_module(tmp_path_factory.mktemp("faultkit"), MODULE, SOURCE):
        yield MODULE


def ci(**changes) -> dict:
    """The ci profile's parameters with ``changes``."""
    return {**PROFILES["ci"].parameters(), **changes}


def _contract(attr: str, classes: list[str]) -> dict:
    return contract.run_section(ci(kernel_sets=[f"{MODULE}:{attr}"], contract_classes=classes))


def _bad(section: dict, key: str = "rows") -> list[dict]:
    return [r for r in section[key] if r["mismatches"]]


def test_decode_row_counts_cover_batched_decode_and_serve():
    from exactness.batch import BATCH_LIMIT
    from exactness.engines.serve import MAX_BATCH
    assert set(range(2, max(BATCH_LIMIT, MAX_BATCH) + 1)) <= set(cases.DECODE_M)


@pytest.mark.slow
@pytest.mark.parametrize("clean, fault, classes, where", [
    ("EXPERT_CLEAN", "EXPERT_FAULT", ["expert_gate_up"], {"site": "routed", "role": "prompt", "expert_id": 5}),
    ("FP8_CLEAN", "FP8_FAULT", ["attention"], {"site": "fp8", "role": "prompt"}),
    ("ROWS_CLEAN", "ROWS_FAULT", ["attention"], {"site": "bf16", "role": "decode"}),
])
def test_a_fault_in_some_calls_only_is_caught_by_the_contract(kit, clean, fault, classes, where):
    ok = _contract(clean, classes)
    assert ok["rows"] and not _bad(ok) and not _bad(ok, "offload_rows"), ok["rows"]
    bad = _bad(_contract(fault, classes))
    assert [r["class"] for r in bad] == classes, bad
    fm = bad[0]["first_mismatch"]
    assert {k: fm.get(k) for k in where} == where, fm
    if where["role"] == "decode":
        assert fm["M"] in cases.DECODE_M and bad[0]["decode_rows"][1] == bad[0]["mismatches"] > 0   # decode only
    if where["site"] == "fp8":
        assert fm["kv_dtype"].startswith("fp8") and bad[0]["by_site"]["bf16"][1] == 0


@pytest.mark.slow
def test_a_stale_offload_slot_is_caught_by_the_contracts_offload_check(kit):
    """A kernel keeping packed weights by buffer address: exact while each buffer holds one expert (resident), wrong
    once a ring slot holds another expert; the clean copy packs on every call."""
    ok = _contract("SLOT_CLEAN", ["expert_down"])
    assert ok["offload_rows"] and not _bad(ok) and not _bad(ok, "offload_rows")
    sec = _contract("SLOT_FAULT", ["expert_down"])
    assert not _bad(sec), _bad(sec)                    # resident: every buffer keeps its expert
    bad = _bad(sec, "offload_rows")
    assert bad and bad[0]["first_mismatch"]["site"] == "routed", bad


@pytest.mark.slow
def test_a_grouped_routing_tie_fault_is_caught_by_the_ci_contract(kit):
    """ci's contract routes in groups too (contract_router_groups), where the tie-break fault lives."""
    assert ci()["contract_router_groups"]
    ok = _contract("TIES_CLEAN", ["router"])
    assert ok["rows"] and not _bad(ok)
    bad = _bad(_contract("TIES_FAULT", ["router"]))
    assert bad and bad[0]["first_mismatch"]["site"] == "grouped" and bad[0]["by_site"]["topk"][1] == 0, bad


@pytest.mark.slow
def test_a_top4_only_fault_shows_with_a_user_preset(kit):
    """A user preset (preset=module:ATTR) with top_k 4 shows a fault the tiny preset's top-2 routing never calls."""
    tiny = _contract("TOP4_FAULT", ["moe_combine"])
    assert tiny["rows"] and not _bad(tiny)                              # top-2: invisible
    check_common({"preset": f"{MODULE}:TOP4"})                          # the reference is a preset parameter
    top4 = dict(kernel_sets=[f"{MODULE}:TOP4_CLEAN"], contract_classes=["moe_combine"], preset=f"{MODULE}:TOP4")
    assert not _bad(contract.run_section(ci(**top4)))
    bad = _bad(contract.run_section(ci(**{**top4, "kernel_sets": [f"{MODULE}:TOP4_FAULT"]})))
    assert bad and bad[0]["preset"] == f"{MODULE}:TOP4", bad


def _drafted(attr: str) -> list[dict]:
    """The streams section's drafted rows (ci parameters) of the set ``attr``, every ci prompt."""
    p = streams.section_params(ci(kernel_sets=[f"{MODULE}:{attr}"]))
    w, tok = load_model(p.preset, p.device, p.dtype, p.checkpoint, p.weights)
    rows, ks = [], set_names(p.kernel_sets)[0]
    with sharing_synthetic_weights():
        for pr in build_prompts(p.prompts, p.prompt_max_tokens, p.allow_unpinned, tok, w.cfg.vocab_size):
            step = streams.prompt_step(p.steps[0], pr.n_tokens)
            rows += streams.drafted_rows(w, pr, ks, streams.plain_runs(w, pr, ks, p, step), p, step)
    return rows


@pytest.mark.slow
def test_a_verify_row_fault_is_caught_by_the_ci_drafted_rows(kit):
    """A fault on rows >= 1 of short prompt-role calls is seen by drafted decoding only: its verify forwards run
    k + 1 rows, and drafted runs whose drafts are accepted keep rows >= 1 of them."""
    ok = _drafted("VERIFY_CLEAN")
    assert ok and all(r["equal"] for r in ok), [(r["prompt"], r["draft"], r["failed"]) for r in ok]
    bad = _drafted("VERIFY_FAULT")
    caught = {r["draft"]: r for r in bad if not r["equal"]}
    assert set(caught) == {"mtp", "self (sanity)"}, [(r["prompt"], r["draft"], r["accepted"]) for r in bad]
    for r in caught.values():   # row 0 of every verify is clean: the first differing row is one a draft made
        assert r["accepted"] > 0 and "logits" in r["failed"] and r["first_logits_row_diff"] >= 1, r


@pytest.mark.parametrize("ref, words", [
    ("nope_module_x:CFG", r"preset reference 'nope_module_x:CFG' does not resolve \(ModuleNotFoundError: "),
    (f"{MODULE}:NOPE", r"does not resolve \(AttributeError: "),
    (f"{MODULE}:BUMP", r"gives a float; allowed: package.module:ATTR \(a ModelConfig"),
    ("a:b:c", r"is not of the form package.module:ATTR"),
])
def test_a_bad_user_preset_is_refused_in_one_line(kit, ref, words):
    with pytest.raises(ParamError) as e:
        check_common({"preset": ref})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"parameter preset={ref!r} is not allowed: "), msg
    assert re.search(words, msg), msg
    with pytest.raises(ParamError, match=r"preset='huge' is not allowed; allowed: small, tiny.*, or package"):
        check_common({"preset": "huge"})
