"""Config, prompts, tokenizer, paths: shapes, served-row accounting and the errors bad input gets."""
import hashlib

import pytest
import torch

from exactness import prompts as P
from exactness.analysis.hashes_report import hash_table
from exactness.checkpoint import resolve_device, resolve_dtype
from exactness.config import ModelConfig, get_preset
from exactness.kernels import KERNEL_SETS
from exactness.model import tapping
from exactness.paths import Schedule, generate
from exactness.profiles import get_profile
from exactness.tokenizer import ByteTokenizer


def test_unknown_names_are_errors_that_list_the_known_ones():
    with pytest.raises(ValueError, match="known presets: small, tiny"):
        get_preset("huge")
    with pytest.raises(ValueError, match="known profiles"):
        get_profile("nightly")
    with pytest.raises(ValueError, match="known prompts"):
        P.build_prompt("poem")
    with pytest.raises(ValueError, match="allowed: bfloat16, float32"):
        resolve_dtype("float8")


def test_config_validation_names_the_bad_field():
    with pytest.raises(ValueError, match="n_heads=6 is not a multiple of n_kv_heads=4"):
        get_preset("tiny").replace(n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="hidden"):
        ModelConfig(name="x", vocab_size=10, hidden=0, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=2,
                    n_experts=1, top_k=1, expert_inter=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_where_there_is_none_is_a_clear_error():
    with pytest.raises(ValueError, match="sees no CUDA device"):
        resolve_device("cuda")


def test_prompts_match_their_pins_and_sizes():
    sizes = {"short": 40, "code": 16022, "docs": 12780}
    for name, n in sizes.items():
        p = P.build_prompt(name)
        assert p.pin_ok and p.n_tokens == n and p.sha256 == P.PROMPTS[name].sha256
        assert hashlib.sha256(p.text).hexdigest() == p.sha256
        assert p.ids[0] == ByteTokenizer.bos_id and bytes(p.ids[1:].tolist()) == p.text


def test_a_changed_prompt_text_fails_unless_allowed(monkeypatch):
    real = P.prompt_text
    monkeypatch.setattr(P, "prompt_text", lambda spec: real(spec)[:-1] + b"!")
    with pytest.raises(P.PromptPinError, match="differs from the pin"):
        P.build_prompt("short")
    p = P.build_prompt("short", allow_unpinned=True)
    assert not p.pin_ok and p.sha256 != P.PROMPTS["short"].sha256


def test_cut_prompt_is_a_prefix_with_its_own_hash():
    full, cut = P.build_prompt("docs"), P.build_prompt("docs", max_tokens=100)
    assert cut.n_tokens == 100 and torch.equal(cut.ids, full.ids[:100]) and cut.pin_ok
    assert cut.sha256 == hashlib.sha256(full.text[:99]).hexdigest()


@pytest.mark.parametrize("step,threshold,expect", [
    (64, 64, {"deep": (2, 128), "batched": (1, 32)}),     # 160 = 64 + 64 + 32: the 32-row tail runs batched
    (100, 200, {"deep": (0, 0), "batched": (2, 160)}),    # below the threshold deep never runs, and says so
    (None, 100, {"deep": (1, 160), "batched": (0, 0)}),
])
def test_deep_path_records_what_it_served(tiny_weights, code_prompt, step, threshold, expect):
    r = generate(tiny_weights, code_prompt.ids, 2, "fast", Schedule("deep", step, threshold))
    for plan, (segs, rows) in expect.items():
        assert (r.served[plan]["segments"], r.served[plan]["rows"]) == (segs, rows)
    assert r.served["decode"]["rows"] == 0


def test_generate_shapes_and_decode_oracle_accounting(tiny_weights, code_prompt):
    r = generate(tiny_weights, code_prompt.ids, 5, "fast", Schedule("decode"))
    V = tiny_weights.cfg.vocab_size
    assert r.gen_ids.shape == (5,) and r.gen_ids.dtype == torch.int64
    assert r.prompt_logits.shape == (160, V) and r.prompt_logits.dtype == torch.float32
    assert r.gen_logits.shape == (5, V)
    assert torch.equal(r.gen_ids, r.gen_logits.argmax(dim=1))
    assert r.served["decode"] == {"segments": 160, "rows": 160}


@pytest.mark.parametrize("kwargs,match", [
    (dict(path="decode", step=0), "step size must be a positive int"),
    (dict(path="batched", step=-3), "step size must be a positive int"),
    (dict(path="sideways"), "unknown path 'sideways'"),
    (dict(path="deep", step=64, deep_threshold=0), "deep_threshold must be a positive int"),
])
def test_bad_run_arguments(tiny_weights, code_prompt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny_weights, code_prompt.ids, 2, "fast", Schedule(**kwargs))


def test_prompt_longer_than_positions_is_refused(tiny_weights):
    ids = torch.zeros(tiny_weights.cfg.max_positions, dtype=torch.int64)
    with pytest.raises(ValueError, match="exceeds the model's max_positions=32768"):
        generate(tiny_weights, ids, 1, "fast", Schedule("batched"))


def test_unknown_kernel_set_lists_known_ones(tiny_weights, code_prompt):
    with pytest.raises(ValueError, match="known sets: ") as e:
        generate(tiny_weights, code_prompt.ids, 1, "exact-ish", Schedule("batched"))
    assert "'exact-ish'" in str(e.value) and all(name in str(e.value) for name in KERNEL_SETS)  # every one listed


def test_taps_see_every_class_and_are_off_by_default(tiny_weights, code_prompt):
    class Rec:
        def __init__(self):
            self.seen = set()

        def record(self, **call):
            self.seen.add((call["cls"], call["plan"]))
    rec = Rec()
    with tapping(rec):
        generate(tiny_weights, code_prompt.ids[:70], 2, "invariant", Schedule("deep", 64, 64))
    classes = {c for c, _ in rec.seen}
    assert classes == {"dense", "router", "expert_gate_up", "expert_down", "moe_combine", "attention", "rmsnorm",
                       "rope", "residual", "lm_head"}
    assert {p for _, p in rec.seen} == {"deep", "batched", "decode"}
    before = len(rec.seen)
    generate(tiny_weights, code_prompt.ids[:10], 2, "fast", Schedule("batched"))  # outside the block: nothing recorded
    assert len(rec.seen) == before


def test_hash_matrix_marks_runs_that_differ_from_their_oracle():
    rows = [dict(prompt="p", kernels=ks, path=path, step=step, hash=h, equals_oracle=eq, prompt_tokens=3)
            for ks, path, step, h, eq in (("fast", "decode", None, "aaa", True), ("fast", "batched", 8, "bbb", False),
                                          ("invariant", "decode", None, "aaa", True),
                                          ("invariant", "batched", 8, "aaa", True))]
    m = {r["kernels"]: r for r in hash_table(rows).rows}
    assert m["fast"]["batched@8"] == "bbb ≠" and m["invariant"]["batched@8"] == "aaa"


def test_hash_matrix_with_offload_equals_the_resident_oracle():
    """Experts in host memory (offload.ExpertStore) must not change a byte: every offloaded run, the decode path
    included, equals the resident oracle in tokens, prompt-logit bytes and KV bytes (invariant set)."""
    from exactness.analysis.hashes import run_section
    from exactness.params import offload_modes
    params = dict(preset="tiny", device="cpu", dtype="bfloat16", prompts=["code"], prompt_max_tokens=96,
                  steps=[40], gen_tokens=4, deep_threshold=32, kernel_sets=["invariant"], hash_offload=True)
    rows = run_section(params)["rows"]
    off = [r for r in rows if r["offload"]]
    assert len(off) == 3 and len(rows) == 6
    assert all(r["equals_oracle"] and r["prompt_logits_equal"] and r["kv_equal"] for r in off)
    assert offload_modes([True]) == [False, True] and offload_modes(False) == [False]
    # hash_offload_paths: only those paths are repeated offloaded; hash_max_tokens cuts this section's prompts
    rows = run_section({**params, "hash_offload_paths": ["deep"], "hash_max_tokens": 64})["rows"]
    assert [(r["path"], r["offload"]) for r in rows] == [("decode", False), ("batched", False), ("deep", False),
                                                         ("deep", True)]
    assert {r["prompt_tokens"] for r in rows} == {64} and rows[-1]["equals_oracle"] and rows[-1]["kv_equal"]
    for bad in ([], ["prefill"], "deep"):
        with pytest.raises(ValueError, match="hash_offload_paths must be"):
            run_section({**params, "hash_offload_paths": bad})
    with pytest.raises(ValueError, match="hash_max_tokens"):
        run_section({**params, "hash_max_tokens": -3})
    with pytest.raises(ValueError, match="offload must be"):
        offload_modes("yes")


def test_rerun_control_tells_a_nondeterministic_set():
    """hash_rerun repeats each set's first batched run: identical for the CPU sets; a set whose RMSNorm changes a
    little on every call (run-to-run nondeterminism, planted) is caught as NOT identical."""
    from dataclasses import replace

    from exactness.analysis.hashes import run_prompt
    from exactness.kernels import KernelSet, get_set
    from exactness.weights import synthetic_weights
    w = synthetic_weights(get_preset("tiny"))
    prompt = P.build_prompt("code", 48)
    calls = [0]

    def drifting(fn):
        def f(x, *args):
            calls[0] += 1
            return fn(x, *args) * (1 + 2 ** -12 * calls[0])   # a different factor on every call
        return f
    inv = get_set("invariant")
    noisy = KernelSet("noisy", inv.decode, {c: (replace(s, fn=drifting(s.fn)) if c == "rmsnorm" else s)
                                            for c, s in inv.prompt.items()}, False, "test-only drift")
    rows = run_prompt(w, prompt, ["invariant", noisy], [16], 3, 8, rerun=True)
    rerun = {r["kernels"]: r["rerun_equal"] for r in rows if "rerun_equal" in r}
    assert rerun == {"invariant": True, "noisy": False}
    assert all("_logits" not in r for r in rows)
    assert [r["step"] for r in rows if "rerun_equal" in r] == [16, 16]
