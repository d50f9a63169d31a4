"""Kernels grouped by kernel class (one module per class) and registered into named kernel sets.

Import this package to register the built-in sets (``fast``, ``invariant``); see registry.py for the contract.
A kernel set may also be named by reference, ``package.module:ATTR`` (:func:`get_set`): ATTR is a KernelSet or a
function of no arguments returning one, so a set defined outside the package runs in every analysis
(imported.py: imported once, its kernels labelled with its name, validated, its provenance recorded).
"""
from __future__ import annotations

from . import registry
from .registry import (KERNEL_CLASS_RECORDS, KERNEL_CLASSES, KERNEL_SETS, KERNELS, KernelClass, KernelSet,  # noqa: F401
                       KernelSpec, class_record, register_class, register_set)
from . import sets  # noqa: F401  (registers the built-in sets)
from .imported import import_set, provenance, set_names  # noqa: F401


def get_set(name: str | KernelSet) -> KernelSet:
    """Return the kernel set called ``name`` (registry.get_set), or named by reference ``"package.module:ATTR"``
    (:func:`import_set`); a KernelSet passes through.

    Raises:
        ValueError: unknown set (the message lists the known ones) or a reference that does not resolve.
    """
    if isinstance(name, str) and ":" in name:
        return import_set(name)
    return registry.get_set(name)
