"""One comparison of a run against its reference (exact.compare -> Verdict).

- Hand-built runs: each part (tokens, prompt rows, generated rows, KV, a server's prompt logprobs) equal, different
  or not exposed; the first difference located (token position, row and count, KV position/layer/part); -0.0 and
  +0.0 are different bytes; a shape mismatch is a difference; a part either run lacks is "not exposed", never
  equal; a resumed run's rows are compared at their prompt positions; the margin is the reference's.
- Every stream equality through it: a fault planted in one run kind only (the verify forward of drafted runs, a
  prefill that starts off the step grid, a decode batch of more than one row, a forward holding more than one
  prompt) is named by the streams section's row of that kind, through the shared comparison; the other kinds stay
  equal, and an identical copy of the kernel set raises nothing.

Tiny preset, CPU.
"""
from __future__ import annotations

import pytest
import torch

from exactness.exact import NOT_EXPOSED, Part, compare, margin
from exactness.kernels import KERNEL_SETS, get_set, register_set
from exactness.run import Run

V, L = 6, 2   # vocabulary and layers of the hand-built runs


def run(**kw) -> Run:
    """A hand-built run: 4 generated tokens, 5 prompt rows, 2 layers of KV over 8 positions (deterministic)."""
    g = torch.Generator().manual_seed(0)
    base = dict(config="c", gen_ids=torch.tensor([3, 1, 4, 1]),
                prompt_logits=torch.randn(5, V, generator=g), gen_logits=torch.randn(4, V, generator=g),
                kv=[torch.randn(8, 2, 3, generator=g).to(torch.bfloat16) for _ in range(2 * L)])
    return Run(**{**base, **kw})


def edited(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


# --------------------------------------------------------------------------------------------- hand-built runs

def test_equal_runs_are_equal_in_every_part():
    v = compare(run(), run())
    assert v.equal and v.failed == [] and v.not_exposed == [] and v.line() == "equal"
    assert all(p == Part(True) for p in v.parts().values()) and v.oracle_margin is None
    assert v.prompt_logprobs is None and "prompt logprobs" not in v.parts()   # neither run has them


def test_first_differing_token_and_the_references_margin_there():
    ref = run()
    v = compare(run(gen_ids=torch.tensor([3, 1, 5, 9])), ref)
    assert v.tokens == Part(False, 2, 1) and v.failed == ["tokens"] and not v.equal
    assert v.oracle_margin == margin(ref.gen_logits[2]) > 0
    top = ref.gen_logits[2].sort(descending=True).values
    assert v.oracle_margin == float(top[0] - top[1])
    assert compare(run(gen_ids=torch.tensor([3, 1])), ref).tokens.first == 2    # a prefix: where it ends
    assert compare(run(gen_ids=torch.tensor([3, 1, 4, 1, 5])), ref).oracle_margin is None   # no reference row


def test_rows_first_difference_and_count():
    ref = run()
    a = edited(edited(ref.prompt_logits, (1, 2), 7.0), (3, 0), 7.0)
    v = compare(run(prompt_logits=a, gen_logits=edited(ref.gen_logits, (2, 5), 0.5)), ref)
    assert v.prompt_rows == Part(False, 1, 2) and v.gen_rows == Part(False, 2, 1)
    assert v.failed == ["prompt logits", "generated logits"] and v.line() == "differs: prompt logits, generated logits"


def test_negative_zero_is_another_byte():
    ref = run(gen_logits=edited(run().gen_logits, (1, 3), 0.0))
    v = compare(run(gen_logits=edited(ref.gen_logits, (1, 3), -0.0)), ref)
    assert bool((ref.gen_logits == run(gen_logits=edited(ref.gen_logits, (1, 3), -0.0)).gen_logits).all())
    assert v.gen_rows == Part(False, 1, 1)


def test_shape_mismatch_is_a_difference():
    ref = run()
    wide = compare(run(prompt_logits=torch.zeros(5, V + 1)), ref).prompt_rows
    assert wide == Part(False, 0, 5)                                    # rows of another shape: every row differs
    short = compare(run(prompt_logits=ref.prompt_logits[:3]), ref).prompt_rows
    assert short == Part(False, 3, 2)                                   # the common rows agree: it ends early
    assert compare(run(gen_logits=ref.gen_logits.double()), ref).gen_rows == Part(False, 0, 4)   # another dtype


def test_missing_parts_are_not_exposed_never_equal():
    v = compare(run(prompt_logits=None, kv=None), run())
    assert v.prompt_rows == NOT_EXPOSED and v.kv == NOT_EXPOSED and v.prompt_rows.equal is None
    assert v.not_exposed == ["prompt logits", "KV"] and v.equal            # nothing that is exposed differs
    assert v.line() == "equal (not exposed: prompt logits, KV)"
    v = compare(run(gen_logits=None), run(gen_ids=torch.tensor([3, 1, 4, 2])))
    assert v.gen_rows.equal is None and v.failed == ["tokens"] and v.oracle_margin is not None


def test_resumed_rows_are_compared_at_their_prompt_positions():
    fresh = run()
    tail = fresh.prompt_logits[3:]
    assert compare(run(prompt_logits=tail, prompt_start=3), fresh).prompt_rows == Part(True)
    v = compare(run(prompt_logits=edited(tail, (1, 0), 9.0), prompt_start=3), fresh)
    assert v.prompt_rows == Part(False, 4, 1)                          # prompt position 4, not tail row 1


def test_kv_first_site_by_position_then_layer_keys_first():
    ref = run()
    kv = [t.clone() for t in ref.kv]                                   # keys of layers 0, 1, then values
    kv[L + 1][5, 1, 2] = 3.0                                           # values, layer 1, position 5
    kv[0][7, 0, 0] = 3.0                                               # keys, layer 0, position 7
    v = compare(run(kv=kv), ref)
    assert v.kv == Part(False, {"position": 5, "layer": 1, "part": "v", "tensor": 0}, 2) and v.failed == ["KV"]
    kv[1][5, 0, 0] = -3.0                                              # keys, layer 1, position 5: keys first
    assert compare(run(kv=kv), ref).kv.first == {"position": 5, "layer": 1, "part": "k", "tensor": 0}
    signed = [t.clone() for t in ref.kv]
    signed[2][0, 0, 0], ref.kv[2][0, 0, 0] = -0.0, 0.0
    assert compare(run(kv=signed), ref).kv.first == {"position": 0, "layer": 0, "part": "v", "tensor": 2}
    longer = compare(run(kv=[torch.cat([t, t[:1]]) for t in ref.kv]), ref).kv
    assert longer.equal is False and longer.first["position"] == -1 and longer.first["layer"] is None


def test_prompt_logprobs_with_their_ids():
    lp, ids = torch.randn(4, 3, dtype=torch.float64), torch.arange(12).view(4, 3)
    ref = run(prompt_logprobs=lp, prompt_logprob_ids=ids)
    assert compare(run(prompt_logprobs=lp, prompt_logprob_ids=ids), ref).prompt_logprobs == Part(True)
    v = compare(run(prompt_logprobs=lp, prompt_logprob_ids=edited(ids, (2, 1), -1)), ref)
    assert v.prompt_logprobs == Part(False, 2, 1) and v.failed == ["prompt logprobs"]
    assert list(v.parts()) == ["tokens", "prompt logits", "prompt logprobs", "generated logits", "KV"]
    assert compare(run(), ref).prompt_logprobs == NOT_EXPOSED                      # one server gave them


def test_compare_of_different_token_dtypes_is_refused():
    with pytest.raises(ValueError, match="one dtype"):
        compare(run(gen_ids=torch.tensor([3, 1, 4, 1], dtype=torch.int32)), run())


# ------------------------------------------------------------------------ stream equalities, one fault each

STREAMS = {"profile": "test", "preset": "tiny", "device": "cpu", "dtype": "bfloat16", "prompts": ["short"],
           "prompt_max_tokens": 24, "steps": [16], "gen_tokens": 5, "deep_threshold": 512, "mtp_k": 2,
           "drafts": ["self"], "stream_counts": [2], "stream_prompt_tokens": 20}
STEP, VERIFY_ROWS = 16, 3   # the prefill step; rows of a verify forward (mtp_k + 1)

# where each fault acts: (role of the attention kernel, when(q, slots, positions)). Prefill segments of these
# prompts (24, 20 and 15 tokens at step 16) hold 16, 8, 4 or 15 rows and start on the step grid, except a resume
# off the grid; decode forwards of one stream hold one row.
FAULTS = {
    "drafted": ("prompt", lambda q, s, p: q.shape[0] == VERIFY_ROWS),
    "resumed": ("prompt", lambda q, s, p: q.shape[0] > VERIFY_ROWS and int(p[0]) % STEP != 0),
    "concurrent": ("decode", lambda q, s, p: q.shape[0] > 1),
    "packed": ("prompt", lambda q, s, p: s.unique().numel() > 1),
}
# the kinds each fault reaches: packed prompts also decode together (decode forwards of more than one row)
NAMED = {"drafted": {"drafted"}, "resumed": {"resumed"}, "concurrent": {"concurrent", "packed"},
         "packed": {"packed"}, None: set()}


def fault_set(kind: str | None) -> str:
    """Register (once) a claims-exact copy of ``invariant`` whose attention kernel scales row 0 of its output by
    1 + 2^-4 in the calls FAULTS[kind] names (None: an identical copy)."""
    name = f"compare_fault_{kind}"
    if name in KERNEL_SETS:
        return name
    inv = get_set("invariant")
    tables = {r: {c: (s.fn, s.doc) for c, s in getattr(inv, r).items()} for r in ("decode", "prompt")}
    if kind is not None:
        role, when = FAULTS[kind]
        clean = inv.fn("attention", role)

        def attention(q, k_cache, v_cache, slots, positions):
            out = clean(q, k_cache, v_cache, slots, positions)
            if when(q, slots, positions):
                out = out.clone()
                out[0] = out[0] * (1 + 2 ** -4)
            return out
        tables[role]["attention"] = (attention, "planted fault")
    register_set(name, decode=tables["decode"], prompt=tables["prompt"], claims_exact=True)
    return name


def stream_rows(weights, ks: str) -> dict[str, list[dict]]:
    """The streams section's rows of every kind for set ``ks`` on the short prompt."""
    from exactness.analysis import streams as S
    from exactness.prompts import build_prompt

    p = S.section_params({**STREAMS, "kernel_sets": [ks]})
    pr = build_prompt("short", p.prompt_max_tokens)
    step = S.prompt_step(p.steps[0], pr.n_tokens)
    plain = S.plain_runs(weights, pr, ks, p, step)
    return {"drafted": S.drafted_rows(weights, pr, ks, plain, p, step),
            "resumed": S.resumed_rows(weights, pr, ks, plain, p, step),
            "concurrent": S.concurrent_rows(weights, [pr], ks, p),
            "packed": S.packed_rows(weights, [pr], ks, p)}


@pytest.mark.parametrize("kind", [None, "drafted", "resumed", "concurrent", "packed"])
def test_a_fault_in_one_run_kind_is_named_by_that_equality(tiny_weights, kind):
    rows = stream_rows(tiny_weights, fault_set(kind))
    named = {k for k, rs in rows.items() for r in rs if not r["equal"]}
    assert named == NAMED[kind], {k: [(r["equal"], r["failed"]) for r in rs] for k, rs in rows.items()}
    for r in (r for k in named for r in rows[k] if not r["equal"]):
        assert r["failed"] and set(r["failed"]) <= {"tokens", "logits", "kv"}
    if kind == "drafted":     # row 0 comes from the shared prefill; row 1 is the first verified row
        assert rows["drafted"][0]["first_logits_row_diff"] == 1 and "logits" in rows["drafted"][0]["failed"]
    if kind == "resumed":     # only the resume off the grid prefills from an off-grid position: its first row
        grid, off = rows["resumed"]
        assert grid["equal"] and not off["equal"] and off["first_tail_row_diff"] == off["split"]
        assert off["first_kv_position_diff"] == off["split"] and off["tail_logits_equal"] is False
    if kind == "concurrent":  # stream 0 decodes alone until stream 1 joins; stream 1 sits in row 1 (unchanged)
        row = rows["concurrent"][0]
        assert "logits" in row["failed_vs"]["alone"] and row["first_kv_diff_alone"][1] is None
    if kind == "packed":      # row 0 of the packed forward is the first prompt's first row
        row = rows["packed"][0]
        assert row["first_prompt_row_diff_alone"] == [0, None] and row["first_kv_diff_alone"][0] == 0
