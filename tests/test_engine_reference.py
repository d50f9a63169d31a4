"""Our engine built once (engines/reference.py): its runs are the paths' runs byte for byte, configurations by name or
by (path, step, deep threshold), every run kind behind one object, kernel sets swapped with the model shared."""
from __future__ import annotations

import pytest
import torch

from exactness.batch import run_packed
from exactness.engines.base import CAPABILITIES, Configuration
from exactness.engines.reference import ReferenceEngine
from exactness.exact import compare
from exactness.mtp import generate_drafted
from exactness.paths import Schedule, generate
from exactness.prompts import build_prompt

GEN = 3


@pytest.fixture(scope="module")
def ids():
    return build_prompt("short", 20).ids


@pytest.fixture(scope="module")
def engine(tiny_weights):
    return ReferenceEngine(tiny_weights, None, "fast", steps=[8], deep_threshold=8)


def test_configurations_by_name_and_by_settings(engine):
    assert [c.name for c in engine.configurations()] == ["decode", "batched", "batched-8", "deep-8"]
    c = engine.configuration("deep", None, 1)
    assert c.name == "deep" and c.settings == {"path": "deep", "step": None, "deep_threshold": 1, "kernels": "fast"}
    assert engine.schedule(c) == Schedule("deep", None, 1)
    assert engine.schedule("batched-8") == engine.schedule(engine.configuration("batched", 8)) == Schedule("batched", 8, 8)
    with pytest.raises(ValueError, match="has no configuration 'deep'; it has: decode, batched"):
        engine.schedule("deep")
    with pytest.raises(ValueError, match="unknown path 'wide'"):
        engine.configuration("wide")
    with pytest.raises(ValueError, match="no path, step and deep_threshold settings"):
        engine.schedule(Configuration("x", {"chunk": 7}))


def test_runs_are_the_paths_runs_byte_for_byte(engine, tiny_weights, ids):
    for name in ("decode", "deep-8"):
        mine = engine.run(ids, GEN, name, keep_kv=True)
        theirs = generate(tiny_weights, ids, GEN, "fast", engine.schedule(name), keep_cache=True)
        assert compare(mine, theirs).equal and mine.info["path"] == theirs.info["path"]
    mine = engine.run_drafted(ids, GEN, "batched-8", draft="self", keep_kv=True)
    theirs = generate_drafted(tiny_weights, ids, GEN, "fast", Schedule("batched", 8, 8), k=2, draft="self",
                              keep_cache=True)
    assert compare(mine, theirs).equal and mine.stats == theirs.stats
    mine = engine.run_packed([ids, ids[:12]], GEN, "deep", keep_kv=True)
    theirs = run_packed(tiny_weights, [ids, ids[:12]], GEN, "fast", "deep", keep_cache=True)
    assert all(compare(a, b).equal for a, b in zip(mine, theirs))


def test_every_run_kind_behind_the_engine(engine, ids):
    assert {"packed", "kernel_taps"} <= engine.capabilities <= set(CAPABILITIES)
    inv = engine.with_kernels("invariant")
    fresh = inv.run(ids, GEN, "batched-8", keep_kv=True)
    pc = inv.prompt_cache(1.0, "grid", 8)
    inv.run_resumed(ids[:17], 1, "batched-8", pc)
    resumed = inv.run_resumed(ids, GEN, "batched-8", pc, keep_kv=True)
    assert resumed.prompt_start == 16 and compare(resumed, fresh).tokens.equal
    res = inv.run_concurrent([ids, ids[:15]], GEN, "batched-8", offset=1)
    assert res.max_batch_rows == 2 and torch.equal(res.streams[0].gen_ids, fresh.gen_ids)
    calls = []

    class Rec:
        def record(self, **call):
            calls.append(call["cls"])
    with inv.tapping(Rec()):
        inv.run(ids, 1, "decode")
    assert calls and "attention" in calls


def test_with_kernels_shares_the_model_and_the_mtp_head(engine):
    other = engine.with_kernels("invariant")
    assert other.ks.name == "invariant" and other.w is engine.w and other.kv == engine.kv
    assert other.load_mtp() is engine.load_mtp()


def test_protocol_view_keeps_what_the_engines_section_records(engine, ids):
    run = engine.generate(ids.tolist(), GEN, "batched-8")
    assert run.info == {"served": engine.run(ids, GEN, "batched-8").served} and run.cache is None
    assert run.kv is not None and run.prompt_logits is not None
