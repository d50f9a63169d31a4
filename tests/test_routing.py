"""Routing variants: ModelConfig's group-limited top-k (validation, kernels against a brute force, the model's
wiring) and expert-id-aware expert kernels (a residency-dependent set compared row for row)."""
import pytest
import torch

from exactness.config import PRESETS, get_preset
from exactness.exact import bytes_equal, differing_rows, first_differing_row, kv_first_difference
from exactness.kernels import cuda, experts, get_set
from exactness.kernels.router import router_fast, router_invariant
from exactness.model import tapping
from exactness.paths import Schedule, generate, prefill
from exactness.cache import KVCache
from exactness.weights import synthetic_weights


def test_config_groups_validated_and_presets_unchanged():
    for p in PRESETS.values():
        assert (p.n_groups, p.topk_groups, p.router_groups) == (1, 1, None)
    tiny = get_preset("tiny")
    assert tiny.replace(n_groups=4, topk_groups=2).router_groups == (4, 2)
    assert tiny.replace(n_experts=16, top_k=4).n_experts == 16
    bad = [({"n_groups": 3}, "multiple of n_groups=3"), ({"n_groups": 4, "topk_groups": 5}, "exceeds n_groups"),
           ({"n_groups": 8, "topk_groups": 1}, "top_k=2 exceeds the 1 experts"), ({"topk_groups": 2}, "n_groups > 1"),
           ({"n_groups": 0}, "n_groups must be a positive int"), ({"top_k": 9}, "exceeds n_experts")]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            tiny.replace(**change)


def allowed_experts(logits: torch.Tensor, groups: tuple[int, int]) -> torch.Tensor:
    """Brute force [M, E] bool: experts of the groups a row may keep (the top groups by largest logit, every group
    tied with the last kept one included)."""
    G, Gk = groups
    M, E = logits.shape
    out = torch.zeros(M, E, dtype=torch.bool)
    for m in range(M):
        best = [max(float(logits[m, e]) for e in range(g * E // G, (g + 1) * E // G)) for g in range(G)]
        cut = sorted(best, reverse=True)[Gk - 1]
        for g in range(G):
            if best[g] >= cut:
                out[m, g * E // G:(g + 1) * E // G] = True
    return out


def outside_kept_groups(idx: torch.Tensor, logits: torch.Tensor, groups: tuple[int, int]) -> list[int]:
    """Rows whose picked experts idx [M, k] include one outside the allowed groups (the checker)."""
    ok = allowed_experts(logits.float(), groups).gather(1, idx)
    return [m for m in range(idx.shape[0]) if not bool(ok[m].all())]


def _distinct_logits(M: int = 40, E: int = 16):
    """x [M, M] one-hot rows and w [E, M] with w[:, m] a permutation of 0.25 * (0..E-1): the router's logits
    are w^T exactly (one nonzero product per sum) and no two experts of a row tie."""
    g = torch.Generator().manual_seed(3)
    w = torch.stack([torch.randperm(E, generator=g) * 0.25 for _ in range(M)], dim=1).to(torch.bfloat16)
    return torch.eye(M, dtype=torch.bfloat16), w


@pytest.mark.parametrize("router", [router_fast, router_invariant])
def test_grouped_topk_picks_only_from_kept_groups(router):
    x, w = _distinct_logits()
    groups, k = (4, 2), 3
    weights, idx, logits = router(x, w, k, True, groups)
    assert bytes_equal(logits, w.t().contiguous())                    # the logits are exact
    assert outside_kept_groups(idx, logits, groups) == []
    for m in range(idx.shape[0]):                                      # and they are the best k of the kept groups
        kept = allowed_experts(logits, groups)[m].nonzero().flatten().tolist()
        best = sorted(kept, key=lambda e: -float(logits[m, e]))[:k]
        assert idx[m].tolist() == best, m
    # negative control: the plain top-k of the same logits leaves the kept groups on some rows
    _, plain, _ = router(x, w, k, True)
    assert outside_kept_groups(plain, logits, groups) != []


class _Taps:
    def __init__(self, cls: str, layer: int | None = None):
        self.cls, self.layer, self.calls = cls, layer, []

    def record(self, cls, layer, args, out, **_):
        if cls == self.cls and (self.layer is None or layer == self.layer):
            self.calls.append((args, out))


@pytest.fixture(scope="module")
def ids(code_prompt):
    return code_prompt.ids[:40]


def test_grouped_routing_in_the_model(ids):
    w = synthetic_weights(get_preset("tiny").replace(n_groups=4, topk_groups=2))
    for ks in ("invariant", "fast"):
        with tapping(_Taps("router")) as taps:
            generate(w, ids, 2, ks, Schedule("batched", 16))
        assert len(taps.calls) > 0
        for args, (_, idx, logits) in taps.calls:
            assert args[4] == (4, 2)                                   # the model passes the groups
            assert outside_kept_groups(idx, logits, (4, 2)) == [], ks
    oracle = generate(w, ids, 2, "invariant", Schedule("decode"), keep_cache=True)
    inv = generate(w, ids, 2, "invariant", Schedule("batched", 16), keep_cache=True)
    assert first_differing_row(oracle.prompt_logits, inv.prompt_logits) is None
    assert kv_first_difference(oracle.cache, inv.cache) is None


def _nudged_down(h, w_down):
    """The invariant expert_down with element 0 of every row moved to the next bf16 value (a cold kernel that
    rounds differently)."""
    out = cuda.down_any(h, w_down).clone()
    out[:, 0] = (out[:, 0].view(torch.int16) + 1).view(out.dtype)
    return out


def _layer0(w, ids, ks):
    """(logits [P, V], layer-0 expert outputs y [P, k*H], layer-0 routing idx [P, k]) of one batched prefill."""
    cache = KVCache(w.cfg, ids.numel(), 1, w.dtype, w.device)
    combine, router = _Taps("moe_combine", 0), _Taps("router", 0)
    with tapping(combine), tapping(router):
        logits = prefill(w, cache, ids, ks, Schedule("batched")).logits
    (y, *_), _ = combine.calls[0]
    return logits, y.reshape(y.shape[0], -1), router.calls[0][1][1]


def test_expert_id_aware_residency_set(tiny_weights, ids):
    base = get_set("invariant")
    hot = {0, 1, 2, 3}
    same = experts.by_expert(base, hot, cuda.gate_up_any, cuda.down_any, name="hot-cold-same")
    assert same.options["expert_id_aware"] and "grouped_experts" not in same.options
    ref_logits, ref_y, idx = _layer0(tiny_weights, ids, base)
    logits, y, _ = _layer0(tiny_weights, ids, same)
    assert bytes_equal(ref_logits, logits) and bytes_equal(ref_y, y)  # identical variants: nothing flagged
    oracle = generate(tiny_weights, ids, 2, same, Schedule("decode"))
    assert first_differing_row(oracle.prompt_logits, ref_logits) is None
    # hot and cold kernels that differ: exactly the rows routed to a cold expert in layer 0 are flagged
    cold = experts.by_expert(base, hot, cuda.gate_up_any, _nudged_down, name="hot-cold-differ")
    logits, y, _ = _layer0(tiny_weights, ids, cold)
    has_cold = (idx >= len(hot)).any(dim=1)
    assert bool(has_cold.any()) and not bool(has_cold.all())
    assert torch.equal(differing_rows(ref_y, y), has_cold)
    assert first_differing_row(ref_logits, logits) is not None
    with pytest.raises(ValueError, match="hot expert ids"):
        experts.by_expert(base, {-2}, cuda.gate_up_any, cuda.down_any)
