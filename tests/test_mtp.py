"""Drafted decode (MTP head): drafted == plain with the invariant set for k = 1..4, the MTP cache rollback, the
self-draft sanity mode, negative controls (the fast set's byte differences, perturbed verify kernels) and bad input.

Tiny preset, bf16, CPU; the prompt is the `code` prompt cut to 32 tokens, prefilled in chunks of 16 rows."""
import copy

import pytest
import torch

from exactness import mtp
from exactness.exact import bytes_equal, first_differing_row, kv_first_difference
from exactness.cache import KVCache
from exactness.kernels import get_set
from exactness.model import BATCHED
from exactness.paths import Schedule, generate, prefill
import brute
from faults import row0_perturbed
from exactness.prompts import build_prompt

GEN, STEP = 8, 16


@pytest.fixture(scope="module")
def ids():
    return build_prompt("code", max_tokens=32).ids


@pytest.fixture(scope="module")
def plain(tiny_weights, ids):
    """The plain run: batched prefill at STEP, then decode; invariant set."""
    return generate(tiny_weights, ids, GEN, "invariant", Schedule("batched", STEP), keep_cache=True)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_drafted_equals_plain_invariant(tiny_weights, ids, plain, k):
    r = mtp.generate_drafted(tiny_weights, ids, GEN, "invariant", Schedule("batched", STEP), k=k, keep_cache=True)
    assert torch.equal(r.gen_ids, plain.gen_ids), f"k={k}: {r.gen_ids.tolist()} != {plain.gen_ids.tolist()}"
    assert bytes_equal(r.gen_logits, plain.gen_logits), first_differing_row(r.gen_logits, plain.gen_logits)
    assert kv_first_difference(r.cache, plain.cache) is None
    assert r.stats.proposed > 0 and r.stats.rounds > 0 and 0 <= r.stats.accepted <= r.stats.proposed
    assert r.info["mtp_source"].startswith("derived")


def test_self_draft_accepts_every_draft_invariant(tiny_weights, ids, plain):
    r = mtp.generate_drafted(tiny_weights, ids, GEN, "invariant", Schedule("batched", STEP), k=3, draft="self")
    assert torch.equal(r.gen_ids, plain.gen_ids)
    assert r.stats.acceptance_rate == 1.0, r.stats
    # token 0 from the prefill, rounds of 3 drafts + 1 model token: 4 + 3 (2 drafts: never past GEN)
    assert (r.stats.proposed, r.stats.rounds) == (5, 2)


@pytest.mark.parametrize("name", ["short", "code", "docs"])
def test_derived_head_accepts_most_drafts(tiny_weights, name):
    """The default head (derived from the model) on the ci profile's prompts: at least half the drafts accepted, so
    drafted == plain compares verify rows >= 1; drafted still equals plain."""
    ids = build_prompt(name, max_tokens=300).ids
    step = 128 if ids.numel() > 128 else ids.numel() // 3
    r = mtp.generate_drafted(tiny_weights, ids, 32, "invariant", Schedule("batched", step), k=2)
    assert r.info["mtp_source"].startswith("derived") and r.stats.acceptance_rate >= 0.5, r.stats
    assert torch.equal(r.gen_ids, generate(tiny_weights, ids, 32, "invariant", Schedule("batched", step)).gen_ids)


def test_derived_head_reads_no_random_state_and_shares_the_models_layers(tiny_weights):
    state = torch.random.get_rng_state()
    m = mtp.resolve_mtp(tiny_weights)
    assert torch.equal(state, torch.random.get_rng_state())
    assert m.derived and [lw.wq for lw in m.blocks] == [lw.wq for lw in tiny_weights.layers]
    assert bytes_equal(m.proj[:, :tiny_weights.cfg.hidden], torch.eye(tiny_weights.cfg.hidden, dtype=m.proj.dtype))
    assert not m.proj[:, tiny_weights.cfg.hidden:].any()


def test_derived_head_reads_offloaded_experts(tiny_weights, ids):
    """With an offload store the model's weights hold no experts: the derived head reads them from the store."""
    from exactness.offload import ExpertStore
    store = ExpertStore(tiny_weights, "offload", ring_slots=2)
    r = mtp.generate_drafted(store.weights, ids, GEN, "invariant", Schedule("batched", STEP), k=2, experts=store)
    ref = mtp.generate_drafted(tiny_weights, ids, GEN, "invariant", Schedule("batched", STEP), k=2)
    assert torch.equal(r.gen_ids, ref.gen_ids) and r.stats == ref.stats and store.stats["sync_fetches"] > 0


def test_mtp_cache_holds_exactly_the_accepted_rows(tiny_weights, ids):
    """After a drafted run the MTP cache equals one fresh head forward over (h_i, t_{i+1}) of the final sequence:
    rejected drafts were rolled back and every kept row pairs the main model's hidden row with the next token."""
    w = tiny_weights
    r = mtp.generate_drafted(w, ids, GEN, "invariant", Schedule("batched", STEP), k=2, keep_cache=True)
    n = r.mtp_cache.lengths[0]
    seq = torch.cat([ids, r.gen_ids])
    cache = KVCache(w.cfg, seq.numel(), 1, w.dtype)
    hid = prefill(w, cache, seq[:n], get_set("invariant"), Schedule("batched")).hidden
    head = mtp.MTPHead(w, mtp.resolve_mtp(w), seq.numel())
    head.forward(seq[1:n + 1], hid, torch.arange(n), get_set("invariant"), BATCHED)
    assert n >= ids.numel()
    for a, b in zip(head.cache.k + head.cache.v, r.mtp_cache.k + r.mtp_cache.v):
        assert bytes_equal(a[:, :n], b[:, :n])
        assert not b[:, n:].any(), "positions past the accepted rows must be rolled back (zero)"


def test_fast_set_byte_difference_is_detected_at_a_verify_row(tiny_weights):
    """The fast set (no exactness claim): its verify rows may differ from its decode rows in bytes, and whether they
    do depends on the CPU's instruction set. Measured first by plain loops (tests/brute.py); the comparisons the
    streams section uses must agree: the same first differing row (after row 0, which the shared prefill makes) and
    KV position, or none. That they can fail is shown by the planted faults below, on every machine."""
    ids = build_prompt("code", max_tokens=110).ids
    pl = generate(tiny_weights, ids, 4, "fast", Schedule("batched", 32), keep_cache=True)
    r = mtp.generate_drafted(tiny_weights, ids, 4, "fast", Schedule("batched", 32), k=2, keep_cache=True)
    i = brute.first_row(r.gen_logits, pl.gen_logits)
    assert first_differing_row(r.gen_logits, pl.gen_logits) == i
    assert kv_first_difference(r.cache, pl.cache) == brute.first_kv_position(r.cache, pl.cache)
    if i is not None:
        assert i >= 1, "row 0 comes from the shared prefill and must be equal"
        assert bytes_equal(r.gen_logits[:i], pl.gen_logits[:i]) and not bytes_equal(r.gen_logits[i], pl.gen_logits[i])


def test_perturbed_verify_kernel_is_caught(tiny_weights, ids, plain):
    """Negative controls: a verify-row perturbation must show up where it acts (gen index 1 = the first verify
    forward's row 0). One ulp on row 0's RMSNorm: logits bytes; a shifted lm_head row 0: the token comparison."""
    ulp = row0_perturbed("rmsnorm", lambda t: t * (1 + 2 ** -7))
    r = mtp.generate_drafted(tiny_weights, ids, GEN, ulp, Schedule("batched", STEP), k=2)
    ref = generate(tiny_weights, ids, GEN, ulp, Schedule("batched", STEP))
    assert first_differing_row(r.gen_logits, ref.gen_logits) == 1
    shift = row0_perturbed("lm_head", lambda t: t.roll(1), roles=("prompt",))
    r = mtp.generate_drafted(tiny_weights, ids, GEN, shift, Schedule("batched", STEP), k=2)
    ref = generate(tiny_weights, ids, GEN, shift, Schedule("batched", STEP))
    assert torch.equal(r.gen_ids[:1], ref.gen_ids[:1]) and r.gen_ids[1] != ref.gen_ids[1]


@pytest.mark.parametrize("k", [0, 5, -1, True, 2.0, "2"])
def test_bad_k_is_refused(tiny_weights, ids, k):
    with pytest.raises(ValueError, match="draft count k"):
        mtp.generate_drafted(tiny_weights, ids, 4, "invariant", k=k)


def test_unknown_draft_source_is_refused(tiny_weights, ids):
    with pytest.raises(ValueError, match="unknown draft source 'eagle'"):
        mtp.generate_drafted(tiny_weights, ids, 4, "invariant", k=2, draft="eagle")


def test_synthetic_mtp_weights_are_seeded_and_separate(tiny_weights):
    cfg = tiny_weights.cfg
    a, b = mtp.synthetic_mtp_weights(cfg), mtp.synthetic_mtp_weights(cfg)
    assert a.proj.shape == (cfg.hidden, 2 * cfg.hidden) and a.layer.w_gate.shape == tiny_weights.layers[0].w_gate.shape
    assert bytes_equal(a.proj, b.proj)
    assert not torch.equal(a.layer.wq, tiny_weights.layers[0].wq)  # own generator (seed + 1000), not the decoder's


def test_checkpoint_mtp_tensors_are_used_where_present(tiny_weights):
    m = mtp.synthetic_mtp_weights(tiny_weights.cfg)
    lw, p = m.layer, "mtp.layers.0."
    extra = {"mtp.fc.weight": m.proj, "mtp.pre_fc_norm_embedding.weight": m.emb_norm,
             "mtp.pre_fc_norm_hidden.weight": m.hidden_norm, "mtp.norm.weight": m.final_norm.clone() * 2}
    extra.update({p + n: getattr(lw, f) for f, n in mtp._LAYER_NAMES.items()})
    for e in range(tiny_weights.cfg.n_experts):
        for n, t in (("gate", lw.w_gate), ("up", lw.w_up), ("down", lw.w_down)):
            extra[f"{p}mlp.experts.{e}.{n}_proj.weight"] = t[e]
    for n, t in (("gate", lw.shared_gate), ("up", lw.shared_up), ("down", lw.shared_down)):
        extra[f"{p}mlp.shared_expert.{n}_proj.weight"] = t
    w2 = copy.copy(tiny_weights)
    w2.extra = extra
    got = mtp.resolve_mtp(w2)
    assert got.source == "checkpoint" and torch.equal(got.final_norm, m.final_norm * 2)
    assert torch.equal(got.layer.w_down, lw.w_down)
    del extra["mtp.norm.weight"]
    with pytest.raises(ValueError, match="mtp.norm.weight"):
        mtp.resolve_mtp(w2)
