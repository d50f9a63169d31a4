"""Kernels grouped by kernel class (one module per class) and registered into named kernel sets.

Import this package to register the built-in sets (``fast``, ``invariant``); see registry.py for the contract.
"""
from .registry import (KERNEL_CLASS_RECORDS, KERNEL_CLASSES, KERNEL_SETS, KERNELS, KernelClass, KernelSet,  # noqa: F401
                       KernelSpec, class_record, get_set, register_class, register_set)
from . import sets  # noqa: F401  (registers the built-in sets)
