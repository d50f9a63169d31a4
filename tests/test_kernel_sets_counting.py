"""A user's kernels are never bypassed. A user set (``module:ATTR``) that wraps every kernel of ``invariant`` with a
call counter per (class, role) has every kernel called in every section that runs kernels (hashes, contract, fp64,
streams, bench), on the CPU and on CUDA; and an imported copy keeps a built-in set's ``grouped_experts`` option only
while its expert kernels are that set's very callables (kernels/imported.py drop_bypassing_options)."""
from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

from exactness.analysis import bench, hashes, streams
from exactness.analysis.contract import cases
from exactness.analysis.contract import check as contract
from exactness.analysis.contract import validate
from exactness.analysis.fp64 import section as fp64
from exactness.kernels import KERNEL_CLASSES, KERNEL_SETS, cuda, fast_cuda, get_set, provenance
from exactness.kernels.registry import ROLES
from user_modules import user_module

MODULE = "user_counting_kit"
SOURCE = '''
import dataclasses
import functools
from collections import Counter

import torch

from exactness.kernels import KERNEL_SETS

_inv, _fast = KERNEL_SETS["invariant"], KERNEL_SETS["fast"]
COUNTS = Counter()   # (class, role) -> calls


def _counted(cls, role, fn):
    @functools.wraps(fn)   # keeps what the forward asks a kernel (attention's ``captures``)
    def kernel(*a, **k):
        COUNTS[cls, role] += 1
        return fn(*a, **k)
    return kernel


def _table(base, role, skip=(), only=None):
    """base's kernels of ``role``, counted: every (class, role) but those in ``skip``; only those in ``only``."""
    return {c: s if (c, role) in skip or (only is not None and (c, role) not in only) else
            dataclasses.replace(s, fn=_counted(c, role, s.fn)) for c, s in getattr(base, role).items()}


def _set(name, base=_inv, skip=(), only=None, **options):
    return dataclasses.replace(base, name=name, description=f"{name}: counted kernels",
                               decode=_table(base, "decode", skip, only), prompt=_table(base, "prompt", skip, only),
                               options={**base.options, **options})


def grouped_own(h, idx, w_gate, w_up, w_down):
    """A grouped_experts option of the user's own that never calls the set's (counted) expert kernels: every
    expert on every row h [M, H] through invariant's own kernels, then each row's k picks -> y [M, k, H]. Reads
    nothing on the host (a CUDA graph may record it)."""
    gu, dn = _inv.decode["expert_gate_up"].fn, _inv.decode["expert_down"].fn
    every = torch.stack([dn(gu(h, w_gate[e], w_up[e]), w_down[e]) for e in range(w_gate.shape[0])])  # [E, M, H]
    return every[idx, torch.arange(h.shape[0], device=h.device)[:, None]]


COUNTED = _set("u_counted")
ROPE_UNCOUNTED = _set("u_rope_uncounted", skip={("rope", "prompt")})   # one kernel left unwrapped
OWN_GROUPED = _set("u_own_grouped", grouped_experts=grouped_own)
EXACT = dataclasses.replace(_inv, name="u_exact")                        # invariant's very callables
DOWN_DECODE = _set("u_down_decode", only={("expert_down", "decode")})
FAST_GATE_UP = _set("u_fast_gate_up", base=_fast, only={("expert_gate_up", "prompt")})
'''

BASE = dict(preset="tiny", dtype="bfloat16", prompts=["short"], prompt_max_tokens=24, steps=[16], gen_tokens=3,
            deep_threshold=8)   # 24 prompt tokens, step 16: decode, batched and deep (>= 8 rows) paths all run
# Each section in-process on tiny parameters that still take every path it has: hashes (serial-decode oracle,
# batched, deep; CUDA graphs on CUDA), contract (see ``run``),
# fp64 (tapped decode, batched and deep runs), streams (self and MTP drafts, two concurrent streams, resumed and
# packed prompts), bench (plain, drafted, ITL, cold and stream runs).
SECTIONS = {
    "hashes": lambda p: hashes.run_section({**p, "hash_rerun": False, "hash_sweep_tokens": 24}),
    "contract": lambda p: contract.run_section({**p, "contract_sweep": "quick", "contract_dtypes": ["bfloat16"]}),
    "fp64": lambda p: fp64.run_section({**p, "fp64_tokens": 20, "fp64_rows": 4, "fp64_cert": 2,
                                        "fp64_synthetic": False}),
    "streams": lambda p: streams.run_section({**p, "stream_counts": [2], "drafts": ["self", "mtp"], "mtp_k": 1,
                                              "stream_prompt_tokens": 12}),
    "bench": lambda p: bench.run_section({**p, "prompt_max_tokens": 16, "bench_step": 8, "bench_reps": 1,
                                          "bench_itl_reps": 1, "bench_cold_lengths": [16], "offload": False}),
}
# Every section calls every (class, role) of the set, on both devices: no section runs one role only. The forward
# sections decode (the serial oracle, generated tokens) and prefill (prompt kernels), and argmax's prompt kernel
# picks token 0 after a prefill (loop.first_token); the contract calls each class's prompt and decode kernel.
EVERY = {(c, r) for c in KERNEL_CLASSES for r in ROLES}
EXPECTED = {name: EVERY for name in SECTIONS}
# The sections that run whole forwards (model.moe_block); the contract calls kernels on their own.
FORWARDS = ("hashes", "fp64", "streams", "bench")

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """The module above imported from a folder on sys.path; every set it gave is unregistered afterwards."""
    with user_module(tmp_path_factory.mktemp("countkit"), MODULE, SOURCE):
        __import__(MODULE)
        yield sys.modules[MODULE]


@pytest.fixture
def run(kit, monkeypatch):
    """run(section, attr, device) -> the Counter of (class, role) calls that section made on set ``attr``.

    The validation of a set on tiny inputs (validate_set, which every section but fp64 calls first) calls each
    kernel once; its calls are not counted, so the counts are the section's own. The contract's quick sweep feeds
    M up to 4097 rows per class (minutes on 2 cores); here it feeds M in {1, 2, 3, 65} and KV lengths around the
    first 256-key block, which still reaches every site it feeds here (random and captured rows, decode blocks of
    M = 2 and 3, fp8 caches, offloaded experts).
    """
    def uncounted(ks, *a, **k):
        before = Counter(kit.COUNTS)
        try:
            return real(ks, *a, **k)
        finally:
            kit.COUNTS.clear()
            kit.COUNTS.update(before)
    real = validate.validate_set
    monkeypatch.setattr(validate, "validate_set", uncounted)
    monkeypatch.setattr(cases, "FULL_M", (1, 2, 3, 65))
    monkeypatch.setattr(cases, "KV_BOUNDARIES", (256,))

    def go(section: str, attr: str, device: str) -> Counter:
        kit.COUNTS.clear()
        SECTIONS[section]({**BASE, "device": device, "kernel_sets": [f"{MODULE}:{attr}"]})
        return Counter(kit.COUNTS)
    return go


def called(counts: Counter) -> set:
    """The (class, role) pairs called at least once."""
    return {key for key, n in counts.items() if n > 0}


def routed_through_kernels(counts: Counter) -> bool:
    """Whether a forward section ran its routed experts through the set's expert kernels: each MoE block calls
    moe_combine once and the shared expert once (tiny has one), so the expert kernels are called more often than
    moe_combine only when routed experts go through them too (not through a grouped_experts option)."""
    return all(counts[c, r] > counts["moe_combine", r] for c in ("expert_gate_up", "expert_down") for r in ROLES)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_kernel_of_a_counted_user_set_is_called_in_each_section(run, section, device):
    counts = run(section, "COUNTED", device)
    assert called(counts) == EXPECTED[section], sorted(EXPECTED[section] ^ called(counts))
    if section in FORWARDS:   # the set's grouped_experts was dropped on import: the routed experts are its kernels'
        assert routed_through_kernels(counts), dict(counts)


@pytest.mark.parametrize("device", DEVICES)
def test_the_counting_check_can_fail(run, device):
    """Negative controls: a kernel left unwrapped is not seen called; a grouped_experts option of the user's own
    (kept on import) that computes the routed experts without the set's expert kernels is seen as such."""
    counts = run("hashes", "ROPE_UNCOUNTED", device)
    assert called(counts) != EXPECTED["hashes"] and EVERY - called(counts) == {("rope", "prompt")}
    counts = run("hashes", "OWN_GROUPED", device)
    assert called(counts) == EVERY and not routed_through_kernels(counts)
    assert counts["expert_gate_up", "decode"] == counts["moe_combine", "decode"]   # the shared expert's calls only


def test_a_builtin_grouped_option_is_dropped_unless_the_expert_kernels_are_the_builtin_ones(kit):
    """On import, invariant's (or fast's) grouped MoE kernel is dropped from a copy whose expert kernels (decode or
    prompt) are other callables, and the drop is in its provenance; an exact copy and a grouped callable of the
    user's own keep the option. A copy whose every kernel is another callable (COUNTED) also loses invariant's
    fused norm, RoPE, residual, MoE combine and projection options."""
    fused = {"qk_norm_rope", "dense_group", "residual_norm", "combine_residual_norm", "dense_residual_norm"}
    for attr, base, more in (("COUNTED", "invariant", fused), ("DOWN_DECODE", "invariant", set()),
                             ("FAST_GATE_UP", "fast", set())):
        ks, rec = get_set(f"{MODULE}:{attr}"), provenance(f"{MODULE}:{attr}")
        assert "grouped_experts" not in ks.options and "grouped_experts" not in rec["options"], attr
        assert ks.options["tiles_in_kernels"] is KERNEL_SETS[base].options["tiles_in_kernels"]   # kept
        assert set(rec["options_dropped"]) == {"grouped_experts"} | more, attr
        assert set(KERNEL_SETS[base].options) - set(ks.options) == {"grouped_experts"} | more, attr
        why = rec["options_dropped"]["grouped_experts"]
        assert f"built-in set {base!r}" in why and "\n" not in why, why
    assert get_set(f"{MODULE}:EXACT").options["grouped_experts"] is cuda.moe_experts
    assert provenance(f"{MODULE}:EXACT")["options_dropped"] == {}
    assert get_set(f"{MODULE}:OWN_GROUPED").options["grouped_experts"] is kit.grouped_own
    assert set(provenance(f"{MODULE}:OWN_GROUPED")["options_dropped"]) == fused     # its kernels are counted copies
    assert KERNEL_SETS["invariant"].options["grouped_experts"] is cuda.moe_experts          # built-ins untouched
    assert KERNEL_SETS["fast"].options["grouped_experts"] is fast_cuda.moe_experts
    assert "options_dropped" not in provenance("invariant")
