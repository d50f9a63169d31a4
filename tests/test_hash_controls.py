"""The hash matrix's control runs: a step sweep at tile and block boundaries, so that a fault that appears only at
some call sizes shows end to end, and an fp32 control run; KV differences located by position and layer."""
from __future__ import annotations

from dataclasses import replace

import pytest

from exactness.analysis import hashes
from exactness.kernels import KERNEL_SETS, KernelSet, get_set

BASE = dict(preset="tiny", device="cpu", dtype="bfloat16", prompts=["short"], prompt_max_tokens=None, steps=[100],
            gen_tokens=4, deep_threshold=100, hash_rerun=False, hash_sweep_tokens=130)


def at_call_size(rows: int) -> KernelSet:
    """The invariant set with RMSNorm's row 0 scaled by (1 + 2^-7) in calls of exactly ``rows`` rows (prompt role)."""
    ks = get_set("invariant")

    def wrap(fn):
        def f(x, *args):
            out = fn(x, *args)
            if x.shape[0] == rows:
                out = out.clone()
                out[0] = out[0] * (1 + 2 ** -7)
            return out
        return f
    prompt = {c: (replace(s, fn=wrap(s.fn)) if c == "rmsnorm" else s) for c, s in ks.prompt.items()}
    return KernelSet(f"invariant+rmsnorm@{rows}", ks.decode, prompt, False, "test-only perturbation")


@pytest.fixture
def faulty(monkeypatch):
    ks = at_call_size(65)
    monkeypatch.setitem(KERNEL_SETS, ks.name, ks)
    return ks.name


def test_a_fault_at_one_call_size_shows_only_in_the_step_sweep(faulty):
    plain = hashes.run_section({**BASE, "kernel_sets": [faulty]})["rows"]
    assert all(r["prompt_logits_equal"] and r["kv_equal"] for r in plain)   # steps of 100 never make a 65-row call
    rows = hashes.run_section({**BASE, "kernel_sets": [faulty], "hash_sweep_steps": [63, 64, 65]})["rows"]
    sweep = {(r["path"], r["step"]): r for r in rows if r.get("control") == "step sweep"}
    assert {k for k, r in sweep.items() if not r["prompt_logits_equal"]} == {("batched", 65), ("deep", 65)}
    bad = sweep[("batched", 65)]
    assert bad["first_differing_prompt_row"] == 0 and bad["kv_equal"] is False
    assert (bad["kv_first_position"], bad["kv_first_layer"]) == (0, 0)   # row 0's norm feeds layer 0's K and V
    assert all(r["prompt"] == "code[:130]" for r in sweep.values())


def test_the_fp32_control_runs_the_profile_steps_in_float32():
    rows = hashes.run_section({**BASE, "kernel_sets": ["invariant"], "hash_fp32_control": True})["rows"]
    ctrl = [r for r in rows if r.get("control") == "fp32 control"]
    assert {(r["path"], r["step"]) for r in ctrl} == {("decode", None), ("batched", 100), ("deep", 100)}
    assert all(r["prompt"] == "code[:130] fp32" and r["prompt_logits_equal"] and r["kv_equal"] for r in ctrl)
