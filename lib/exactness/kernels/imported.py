"""Kernel sets defined outside the package, named by reference ``package.module:ATTR``.

ATTR is a KernelSet or a function of no arguments returning one. :func:`import_set` imports it once per process,
labels its kernels with the set's name (a set built with ``dataclasses.replace`` from ``invariant`` keeps names
such as ``invariant.dense.prompt``: they become ``<set>.dense.prompt``), checks its tables (:func:`check_tables`) and
adds it to KERNEL_SETS under its own name, so every section and row names it by that one name. An option kept from
a built-in set that would compute rows with that set's kernels instead of the user's (``grouped_experts``,
``qk_norm_rope``, ``dense_group``, ``residual_norm``, ``combine_residual_norm``, ``dense_residual_norm``) is dropped
(:func:`drop_bypassing_options`). :func:`provenance` records where it came from (module file, SHA-256, package
version) and the options dropped, for the receipt.

Every failure is one ValueError line naming the reference (and the class and role where one kernel fails).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import sys
from pathlib import Path

from .registry import KERNEL_CLASSES, KERNEL_SETS, KERNELS, KernelSet, KernelSpec

_IMPORTED: dict[str, KernelSet] = {}   # reference -> its set, resolved once (a function is called once)
_REFS: dict[str, str] = {}             # set name -> the reference it was imported from
_DROPPED: dict[str, dict[str, str]] = {}  # set name -> option dropped on import -> why (one line)
# Options that compute some classes' rows instead of the set's kernels of those classes (model.moe_block): option ->
# the classes whose kernels (decode and prompt) it stands in for. An option whose callable names its kernels in
# ``stands_for`` ((class, kernel) pairs: kernels/fused.py) stands in for those classes without an entry here.
_STANDS_IN = {"grouped_experts": ("expert_gate_up", "expert_down")}


def _stands_in(opt: str, value) -> tuple:
    """The classes option ``opt`` (set to ``value``) computes instead of the set's kernels; () for none."""
    return _STANDS_IN.get(opt) or tuple(c for c, _ in getattr(value, "stands_for", ()))


def one_line(e: BaseException) -> str:
    """``TypeName: message`` on one line, at most about 200 characters of the message."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200] + ' ...' if len(text) > 200 else text}"


def _load(ref: str) -> KernelSet:
    module, _, attr = ref.partition(":")
    if not module or not attr or ":" in attr:
        raise ValueError(f"kernel set reference {ref!r} is not of the form package.module:ATTR")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001  (any failure of the user's module is one line, not a traceback)
        raise ValueError(f"kernel set reference {ref!r}: cannot import module {module!r} ({one_line(e)})") from None
    if not hasattr(mod, attr):
        raise ValueError(f"kernel set reference {ref!r}: module {module!r} has no attribute {attr!r}")
    obj = getattr(mod, attr)
    if callable(obj) and not isinstance(obj, KernelSet):
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"kernel set reference {ref!r}: its function raised ({one_line(e)})") from None
    if not isinstance(obj, KernelSet):
        raise ValueError(f"kernel set reference {ref!r} gives a {type(obj).__name__}, not a KernelSet (allowed: a "
                         "KernelSet, or a function of no arguments returning one)")
    return obj


def relabel(ks: KernelSet) -> KernelSet:
    """``ks`` with every kernel named ``<set>.<class>.<role>`` (prompt kernels replacing the set's decode kernel of
    their class); the callables, docs and options are kept. Raises nothing."""
    dec = {c: dataclasses.replace(s, name=f"{ks.name}.{c}.decode", role="decode", replaces=None)
           for c, s in ks.decode.items()}
    pro = {c: dataclasses.replace(s, name=f"{ks.name}.{c}.prompt", role="prompt", replaces=f"{ks.name}.{c}.decode")
           for c, s in ks.prompt.items()}
    return dataclasses.replace(ks, decode=dec, prompt=pro)


def check_tables(ks: KernelSet, where: str) -> None:
    """Every class has a decode and a prompt KernelSpec with a callable fn; one ValueError line otherwise."""
    name = f"kernel set {ks.name!r}" + (f" ({where})" if where else "")
    for role, table in (("decode", ks.decode), ("prompt", ks.prompt)):
        if not isinstance(table, dict):
            raise ValueError(f"{name}: its {role} kernels are a {type(table).__name__}, not a dict class -> KernelSpec")
        missing = [c for c in KERNEL_CLASSES if c not in table]
        if missing:
            raise ValueError(f"{name} has no {role} kernel for classes {missing}; every class needs a decode and "
                             "a prompt kernel")
        for cls, spec in table.items():
            if cls not in KERNEL_CLASSES or not isinstance(spec, KernelSpec) or not callable(spec.fn):
                raise ValueError(f"{name}, class {cls!r}, {role}: not a KernelSpec of a known class with a callable "
                                 f"fn (known classes: {', '.join(KERNEL_CLASSES)})")


def import_set(ref: str) -> KernelSet:
    """The kernel set named by ``ref`` = ``"package.module:ATTR"``, imported, relabelled and checked once (every
    class has a decode and a prompt KernelSpec: :func:`check_tables`), stripped of options that would bypass its
    kernels (:func:`drop_bypassing_options`) and added to KERNEL_SETS under its own name.
    Calling each kernel on tiny inputs is analysis.contract.validate.validate_set (the contract's input builders),
    which the preflight of a run (receipt/preflight.py) and each section's run_section do.

    Raises:
        ValueError: one line naming ``ref``: not of that form, the module cannot be imported (or raises), no ATTR,
            ATTR neither a KernelSet nor a function returning one (or the function raises), a failed validation,
            or its set's name taken by another set.
    """
    if ref in _IMPORTED:
        return _IMPORTED[ref]
    ks = _load(ref)
    if KERNEL_SETS.get(ks.name, ks) is not ks and _REFS.get(ks.name) != ref:
        raise ValueError(f"kernel set reference {ref!r} gives a set named {ks.name!r}, a name another registered "
                         "set has")
    check_tables(ks, ref)   # before relabelling, which needs KernelSpecs
    ks, dropped = drop_bypassing_options(ks)
    ks = relabel(ks)
    _DROPPED[ks.name] = dropped
    KERNEL_SETS[ks.name] = ks
    _IMPORTED[ref], _REFS[ks.name] = ks, ref
    return ks


def _same_kernels(a: KernelSet, b: KernelSet, classes) -> bool:
    """Whether ``a`` and ``b`` have the very same callables (identity) for ``classes``, decode and prompt."""
    return all(c in t and c in u and t[c].fn is u[c].fn
               for t, u in ((a.decode, b.decode), (a.prompt, b.prompt)) for c in classes)


def drop_bypassing_options(ks: KernelSet) -> tuple[KernelSet, dict[str, str]]:
    """``ks`` without the options that would compute rows with a built-in set's kernel instead of its own: an
    option of _STANDS_IN whose value is the very callable a built-in (not imported) set names for it, while ``ks``
    has other callables than that set for the classes the option stands in for (a copy made with
    ``dataclasses.replace`` keeps ``invariant``'s grouped MoE kernel after its expert kernels were replaced). A
    callable of the user's own is kept, as is a built-in one over that set's own kernels.

    Returns:
        (the set, maybe with fewer options; option -> one line on why it was dropped). Raises nothing.
    """
    dropped = {}
    for opt in ks.options:
        value = getattr(ks.options, opt)
        classes = _stands_in(opt, value)
        if not classes:
            continue
        owners = [b for n, b in KERNEL_SETS.items() if n not in _REFS and getattr(b.options, opt) is value]
        if owners and not any(_same_kernels(ks, b, classes) for b in owners):
            fn = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
            dropped[opt] = (f"{fn} gives the bytes of the {' and '.join(classes)} kernels of built-in set "
                            f"{owners[0].name!r}, not of this set's own, which run instead")
    if not dropped:
        return ks, {}
    return dataclasses.replace(ks, options=ks.options.without(*dropped)), dropped


def _builtin_fns() -> dict:
    """(id(fn), role) and id(fn) -> the name of the registered (built-in) kernel with that callable."""
    out: dict = {}
    for n, s in KERNELS.items():
        out.setdefault((id(s.fn), s.role), n)
        out.setdefault(id(s.fn), n)
    return out


def provenance(name_or_ref: str) -> dict:
    """Where a kernel set comes from, for the receipt.

    Returns:
        {"reference", "name", "description", "claims_exact", "options" (names), "module", "file", "sha256",
        "package", "package_version", "kernels_own" (its kernels whose callable is no built-in kernel's),
        "kernels_builtin" (kernel -> the built-in kernel it calls), "options_dropped" (option -> why it was
        dropped on import: :func:`drop_bypassing_options`)}; a built-in set gives its name, description,
        claims_exact and options, with "module" "exactness.kernels.sets".
    Raises:
        ValueError: an unknown set or a reference that does not resolve (kernels.get_set).
    """
    from . import get_set
    ks = get_set(name_or_ref)
    rec = {"reference": name_or_ref, "name": ks.name, "description": ks.description,
           "claims_exact": ks.claims_exact, "options": sorted(ks.options)}
    if ks.name not in _REFS:
        return rec | {"module": f"{__package__}.sets"}
    module = _REFS[ks.name].partition(":")[0]
    path = getattr(sys.modules.get(module), "__file__", None)
    top = module.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top) or []
    builtin, own = _builtin_fns(), {}
    for s in (*ks.decode.values(), *ks.prompt.values()):
        own[s.name] = builtin.get((id(s.fn), s.role), builtin.get(id(s.fn)))
    return rec | {"module": module, "file": str(Path(path).resolve()) if path else None,
                  "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None,
                  "package": dists[0] if dists else None,
                  "package_version": importlib.metadata.version(dists[0]) if dists else None,
                  "kernels_own": [k for k, b in own.items() if b is None],
                  "kernels_builtin": {k: b for k, b in own.items() if b is not None},
                  "options_dropped": dict(_DROPPED.get(ks.name, {}))}


def set_names(refs) -> list[str]:
    """Each kernel set's own name (a reference resolved, a name as is), in order.

    Raises:
        ValueError: a set that does not resolve, or the same set given twice (by name or reference), naming it.
    """
    from . import get_set
    names = []
    for r in refs:
        n = get_set(r).name
        if n in names:
            raise ValueError(f"kernel set {n!r} is given twice ({r!r}); give each set once")
        names.append(n)
    return names
