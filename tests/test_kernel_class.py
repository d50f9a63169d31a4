"""One description per kernel class: a class registered with one KernelClass record (and kernels in a set) is
checked by the contract and listed by the FP64 analysis with no other edit; the built-in records resolve and
derive the per-class tables; a registration leaves nothing behind."""
from __future__ import annotations

import pytest
import torch

from exactness.analysis.contract import check as C
from exactness.analysis.contract import cases as cc
from exactness.analysis.contract import combine
from exactness.analysis.fp64 import section as fp64
from exactness.analysis.fp64 import cert as fp64_cert
from exactness.analysis.fp64 import ref as fp64_ref
from exactness.analysis.fp64 import synth as fp64_synth
from exactness.analysis.taps import Sample, TapRecorder
from exactness.kernels import KERNEL_CLASSES, KERNEL_SETS, get_set, registry
from exactness.model import DECODE, Ops

WIDTH = 8   # elements per row of the toy class


def _scale(x: torch.Tensor, s: float) -> torch.Tensor:
    """The toy class: y [M, WIDTH] = x * s, one rounding per element (row-invariant on any M)."""
    return x * s


def _scale_shifted(x: torch.Tensor, s: float) -> torch.Tensor:
    """A faulty prompt kernel: every row is off by one when the call has more than one row."""
    return x * s + (x.shape[0] > 1)


def _inputs(inp):
    """Toy random-input builder: rows x [n, WIDTH] N(0, 1), fixed s = 2."""
    return inp.cast(inp.randn(inp.n, WIDTH)), (2.0,)


def _fp64(samples, params, kv):
    """Toy FP64 evaluator: y = 2x exactly; the stored value is the only rounding (beta = 0)."""
    x = torch.stack([s.data["x"] for s in samples]).double()
    yhat = torch.stack([s.data["y"] for s in samples])
    y = (2 * x).reshape(-1)
    n, w = x.shape
    return fp64_ref.Eval("scale", samples, y, yhat.reshape(-1), y.abs(), torch.zeros_like(y),
                         torch.ones(n * w, dtype=torch.int64), torch.arange(n).repeat_interleave(w),
                         torch.arange(w).repeat(n))


TOY = registry.KernelClass("scale", "y[M, W] = x[M, W] * s", row_args=(0,), reduction="none (elementwise)",
                           contract_inputs=_inputs, fp64=_fp64)


def _register_toy(mp: pytest.MonkeyPatch) -> None:
    """Register the toy class and the sets ``toy`` (invariant kernels + scale) and ``toy_bad`` (faulty prompt
    kernel) into copies of the registry's tables, which ``mp`` restores; the pools cached meanwhile are dropped."""
    mp.setattr(registry, "KERNEL_CLASS_RECORDS", dict(registry.KERNEL_CLASS_RECORDS))
    mp.setattr(registry, "KERNELS", dict(registry.KERNELS))
    mp.setattr(registry, "KERNEL_SETS", dict(registry.KERNEL_SETS))
    mp.setattr(C, "KERNEL_SETS", registry.KERNEL_SETS)   # contract/check.py holds the table it imported
    cc.make_pool.cache_clear()
    registry.register_class(TOY)
    base = {c: (k.fn, k.doc) for c, k in get_set("invariant").decode.items()}
    for name, prompt in (("toy", _scale), ("toy_bad", _scale_shifted)):
        registry.register_set(name, base | {"scale": (_scale, "x * s")}, base | {"scale": (prompt, "x * s")},
                              claims_exact=True)


@pytest.fixture
def toy():
    with pytest.MonkeyPatch.context() as mp:
        _register_toy(mp)
        yield
    cc.make_pool.cache_clear()


def test_toy_class_is_checked_by_the_contract(toy):
    assert "scale" in KERNEL_CLASSES and "scale" in cc.ADAPTED
    p, d = get_set("toy").pairs()[-1]
    assert (p.cls, p.name, d.name) == ("scale", "toy.scale.prompt", "toy.scale.decode")
    assert (p, d) in C.selected_pairs("toy", ["scale"])
    res = C.check_pair(p, d, "cpu", "float32", "quick", sources=("random",))
    assert (res.cls, res.set, res.mismatches) == ("scale", "toy", 0)
    both = cc.plan("scale", "quick") + cc.decode_plan("scale", "quick")   # prompt kernel; decode kernel at M > 1
    assert res.cases == sum(c.M for c in both) and res.m_ranges.startswith("1-130,")
    cov, unc = combine.coverage([res.to_row()], ["toy", "invariant"], "cpu", ["float32"])
    status = {(c["class"], c["set"]): c["status"] for c in cov}
    assert status[("scale", "toy")] == "checked" and status[("dense", "toy")] == "uncovered"
    want = {"class": "scale", "set": "invariant", "dtype": "float32", "device": "cpu", "reason": "no registered pair"}
    assert any({k: u.get(k) for k in want} == want for u in unc)
    bad = C.check_pair(*get_set("toy_bad").pairs()[-1], "cpu", "float32", "quick", sources=("random",),
                       stop_at_first=True)
    first = bad.first_mismatch                           # M = 1 behind mates: the first call of more than one row
    assert bad.mismatches == 1 and (first["M"], first["variant"], first["output"]) == (1, "random+mates", "out")
    assert first["call_rows"] > 1 and first["prompt"] == pytest.approx(first["decode"] + 1)


def test_toy_class_is_listed_and_evaluated_by_the_fp64_analysis(toy):
    assert "scale" in fp64.CLASSES and "scale" in TapRecorder.CLASSES and fp64.CLASSES[-1] == "scale"
    assert "scale" not in fp64_synth.TILED and "scale" not in [*fp64_cert.SUM_CLASSES, *fp64_cert.MP_CLASSES]
    x = torch.randn(3, WIDTH).to(torch.bfloat16)
    samples = [Sample("scale", 0, "syn", i, "decode", {"x": x[i], "y": _scale(x[i:i + 1], 2.0)[0]})
               for i in range(3)]
    st = fp64.error_stats(fp64_ref.evaluate("scale", samples, {}, {}))
    assert st["n"] == 3 * WIDTH and st["ulp_max"] == 0 and st["bound_use"] == 0.0
    ops = Ops(get_set("toy"), DECODE)                   # the engine's Ops gets the class from the set
    assert torch.equal(ops.scale(x, 2.0), 2 * x)
    assert not hasattr(Ops(get_set("fast"), DECODE), "scale")   # a set registered before the class has none


def test_registration_leaves_nothing_behind():
    before = (list(KERNEL_CLASSES), set(KERNEL_SETS), set(registry.KERNELS))
    with pytest.MonkeyPatch.context() as mp:
        _register_toy(mp)
        assert "scale" in KERNEL_CLASSES and "toy" in registry.KERNEL_SETS
        with pytest.raises(ValueError, match="kernel class 'scale' is registered twice"):
            registry.register_class(TOY)
    cc.make_pool.cache_clear()
    assert (list(KERNEL_CLASSES), set(KERNEL_SETS), set(registry.KERNELS)) == before
    assert "scale" not in cc.ADAPTED and "scale" not in fp64.CLASSES
    with pytest.raises(ValueError, match="unknown kernel class 'scale'; known: dense, router"):
        registry.class_record("scale")


def test_builtin_records_resolve_and_derive_the_tables():
    recs = registry.KERNEL_CLASS_RECORDS
    for r in recs.values():
        assert callable(registry.resolve(r.contract_inputs)) and r.doc and r.reduction
        assert r.fp64 is None or callable(registry.resolve(r.fp64))
    assert [c for c in KERNEL_CLASSES if recs[c].fp64 is None] == ["argmax"] == [c for c in KERNEL_CLASSES
                                                                                if c not in fp64.CLASSES]
    assert list(cc.ADAPTED) == list(KERNEL_CLASSES) and list(TapRecorder.CLASSES) == list(fp64.CLASSES)
    assert list(fp64_synth.TILED) == ["dense", "expert_gate_up", "expert_down"]
    assert set(fp64_cert.SUM_CLASSES) | set(fp64_cert.MP_CLASSES) == set(fp64.CLASSES)
    q, kc, vc, slots, pos = (torch.full((1,), float(i)) for i in range(5))
    assert registry.class_record("attention").arrange((q, slots, pos), (kc, vc)) == (q, kc, vc, slots, pos)
    assert registry.class_record("rope").arrange(("x", "p"), ("theta",)) == ("x", "p", "theta")
