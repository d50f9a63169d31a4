"""Kernel registry: every registered set pairs each class's prompt kernel with the decode kernel it replaces;
bad registrations fail with clear errors, at import time for a module that registers them; unknown names list the
known ones."""
from __future__ import annotations

import sys

import pytest

from exactness.kernels import KERNEL_CLASSES, KERNEL_SETS, KernelSpec, get_set, registry


@pytest.fixture
def fresh_registry(monkeypatch):
    """Registrations inside a test go to copies of the global tables (the built-in sets stay visible)."""
    monkeypatch.setattr(registry, "KERNELS", dict(registry.KERNELS))
    monkeypatch.setattr(registry, "KERNEL_SETS", dict(registry.KERNEL_SETS))
    return registry


def _f(*args):
    return args[0]


def test_builtin_sets_pair_every_class():
    assert {"fast", "invariant"} <= set(KERNEL_SETS)
    for ks in (get_set("fast"), get_set("invariant")):
        pairs = ks.pairs()
        assert [p.cls for p, _ in pairs] == list(KERNEL_CLASSES)
        for p, d in pairs:
            assert (p.role, d.role, p.replaces, p.cls) == ("prompt", "decode", d.name, d.cls)
    assert get_set("invariant").claims_exact and not get_set("fast").claims_exact


def test_prompt_kernel_replacing_no_decode_kernel_is_rejected(fresh_registry):
    with pytest.raises(ValueError, match=r"replaces 'nope.dense.decode', which is no registered decode kernel of "
                                         r"class 'dense'; known: \[.*'fast.dense.decode'"):
        fresh_registry.register_kernel(KernelSpec("dense", "t.dense.prompt", "prompt", _f, "nope.dense.decode"))
    with pytest.raises(ValueError, match="no registered decode kernel of class 'rope'"):  # right name, wrong class
        fresh_registry.register_kernel(KernelSpec("rope", "t.rope.prompt", "prompt", _f, "fast.dense.decode"))
    with pytest.raises(ValueError, match="which is no registered decode kernel"):        # a prompt kernel's name
        fresh_registry.register_kernel(KernelSpec("dense", "t2.dense.prompt", "prompt", _f, "fast.dense.prompt"))
    assert "t.dense.prompt" not in fresh_registry.KERNELS


def test_two_kernels_under_one_name_are_rejected(fresh_registry):
    fresh_registry.register_kernel(KernelSpec("dense", "t.dup", "decode", _f))
    with pytest.raises(ValueError, match="kernel name 't.dup' is registered twice"):
        fresh_registry.register_kernel(KernelSpec("dense", "t.dup", "decode", _f))
    with pytest.raises(ValueError, match="kernel name 'fast.dense.decode' is registered twice"):
        fresh_registry.register_kernel(KernelSpec("dense", "fast.dense.decode", "decode", _f))
    with pytest.raises(ValueError, match="kernel set 'fast' is registered twice"):
        fresh_registry.register_set("fast", {}, {}, claims_exact=False)


def test_unknown_class_role_and_missing_classes_are_rejected(fresh_registry):
    with pytest.raises(ValueError, match="unknown class 'softmax'; known: dense, router"):
        fresh_registry.register_kernel(KernelSpec("softmax", "t.softmax", "decode", _f))
    with pytest.raises(ValueError, match="role must be one of"):
        fresh_registry.register_kernel(KernelSpec("dense", "t.dense.verify", "verify", _f))
    table = {c: (_f, "") for c in KERNEL_CLASSES if c != "rope"}
    with pytest.raises(ValueError, match=r"kernel set 't_missing' has no decode kernel for classes \['rope'\]"):
        fresh_registry.register_set("t_missing", table, dict(table), claims_exact=True)


def test_bad_registration_fails_at_import(tmp_path, monkeypatch, fresh_registry):
    (tmp_path / "bad_kernels_mod.py").write_text(
        "from exactness.kernels.registry import KernelSpec, register_kernel\n"
        "register_kernel(KernelSpec('dense', 'bad.dense.prompt', 'prompt', lambda x, w: x, 'missing.decode'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="prompt kernel 'bad.dense.prompt' replaces 'missing.decode'"):
        __import__("bad_kernels_mod")
    sys.modules.pop("bad_kernels_mod", None)


def test_unknown_set_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown kernel set 'fastest'; known sets: .*fast, invariant"):
        get_set("fastest")
