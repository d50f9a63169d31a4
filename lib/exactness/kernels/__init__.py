"""Kernels grouped by kernel class (one module per class) and registered into named kernel sets.

Import this package to register the built-in sets (``fast``, ``invariant``); see registry.py for the contract.
A kernel set may also be named by reference, ``package.module:ATTR`` (:func:`get_set`): ATTR is a KernelSet or a
function of no arguments returning one, so a set defined outside the package runs in every analysis
(imported.py: imported once, its kernels labelled with its name, validated, its provenance recorded).
"""
from __future__ import annotations

from . import registry
from .registry import (KERNEL_CLASS_RECORDS, KERNEL_CLASSES, KERNEL_SETS, KERNELS, KernelClass, KernelOptions,
                       KernelSet, KernelSpec, class_record, register_class, register_set)
from . import sets
from .imported import import_set, provenance, set_names

# the package's public names (sets: imported for its side effect, registering the built-in sets)
__all__ = ["KERNEL_CLASS_RECORDS", "KERNEL_CLASSES", "KERNEL_SETS", "KERNELS", "KernelClass", "KernelOptions",
           "KernelSet", "KernelSpec",
           "class_record", "get_set", "import_set", "provenance", "register_class", "register_set", "set_names",
           "sets"]


def get_set(name: str | KernelSet) -> KernelSet:
    """Return the kernel set called ``name`` (registry.get_set), or named by reference ``"package.module:ATTR"``
    (:func:`import_set`); a KernelSet passes through.

    Raises:
        ValueError: unknown set (the message lists the known ones) or a reference that does not resolve.
    """
    if isinstance(name, str) and ":" in name:
        return import_set(name)
    return registry.get_set(name)
