"""Kernels grouped by kernel class (one module per class) and registered into named kernel sets.

Import this package to register the built-in sets (``fast``, ``invariant``); see registry.py for the contract.
A kernel set may also be named by reference, ``package.module:ATTR`` (:func:`get_set`): ATTR is a KernelSet or a
function of no arguments returning one, so a set defined outside the package runs in every analysis.
"""
from __future__ import annotations

import importlib

from . import registry
from .registry import (KERNEL_CLASS_RECORDS, KERNEL_CLASSES, KERNEL_SETS, KERNELS, KernelClass, KernelSet,  # noqa: F401
                       KernelSpec, class_record, register_class, register_set)
from . import sets  # noqa: F401  (registers the built-in sets)

_IMPORTED: dict[str, KernelSet] = {}   # reference -> its set, resolved once (a function is called once)


def import_set(ref: str) -> KernelSet:
    """The kernel set named by ``ref`` = ``"package.module:ATTR"``: the module is imported and ATTR, a KernelSet or
    a function of no arguments returning one, resolved once. The set is added to KERNEL_SETS under its own name
    (unless that name is registered already for this very set), so the analyses can look it up by that name.

    Raises:
        ValueError: ``ref`` is not of that form, the module cannot be imported, it has no ATTR, ATTR is neither a
            KernelSet nor a function returning one, or its set's name is taken by another set; the message names
            ``ref``.
    """
    if ref in _IMPORTED:
        return _IMPORTED[ref]
    module, _, attr = ref.partition(":")
    if not module or not attr or ":" in attr:
        raise ValueError(f"kernel set reference {ref!r} is not of the form package.module:ATTR")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ValueError(f"kernel set reference {ref!r}: cannot import module {module!r} ({e})") from None
    except AttributeError:
        raise ValueError(f"kernel set reference {ref!r}: module {module!r} has no attribute {attr!r}") from None
    ks = obj() if callable(obj) and not isinstance(obj, KernelSet) else obj
    if not isinstance(ks, KernelSet):
        raise ValueError(f"kernel set reference {ref!r} gives a {type(ks).__name__}, not a KernelSet (allowed: a "
                         "KernelSet, or a function of no arguments returning one)")
    if KERNEL_SETS.setdefault(ks.name, ks) is not ks:
        raise ValueError(f"kernel set reference {ref!r} gives a set named {ks.name!r}, a name another registered "
                         "set has")
    _IMPORTED[ref] = ks
    return ks


def get_set(name: str | KernelSet) -> KernelSet:
    """Return the kernel set called ``name`` (registry.get_set), or named by reference ``"package.module:ATTR"``
    (:func:`import_set`); a KernelSet passes through.

    Raises:
        ValueError: unknown set (the message lists the known ones) or a reference that does not resolve.
    """
    if isinstance(name, str) and ":" in name:
        return import_set(name)
    return registry.get_set(name)
