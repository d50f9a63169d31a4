"""Kernels grouped by kernel class (one module per class) and registered into named kernel sets.

Import this package to register the built-in sets (``fast``, ``invariant``); see registry.py for the contract.
"""
from .registry import KERNEL_CLASSES, KERNEL_SETS, KERNELS, KernelSet, KernelSpec, get_set, register_set  # noqa: F401
from . import sets  # noqa: F401  (registers the built-in sets)
