"""Where the engine stores a call's keys and values in the KV cache in one launch (cache.KVCache.write's ``store``).

On a CUDA cache the Triton copy of triton_cache.py; elsewhere, or where Triton is missing, nothing (the cache
stores the rows by indexing, one launch per tensor). A copy: the cache holds the same bytes either way, so it is
the engine's, not a kernel set's, and every set uses it.
"""
from __future__ import annotations

import importlib

import torch

_MODULE: list = []          # [triton_cache] once imported, [None] when Triton failed to import


def _triton_cache():
    if not _MODULE:
        try:
            _MODULE.append(importlib.import_module(f"{__package__}.triton_cache"))
        except ImportError:   # no Triton on this machine: indexing stores the rows
            _MODULE.append(None)
    return _MODULE[0]


def store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
          k: torch.Tensor, v: torch.Tensor) -> bool:
    """k_cache[slots, positions] = k and v_cache[slots, positions] = v in one launch where served (CUDA caches, Triton
    importable, triton_cache.store); True if stored, False if not (the caller stores them)."""
    if not k_cache.is_cuda:
        return False
    mod = _triton_cache()
    return mod is not None and mod.store(k_cache, v_cache, slots, positions, k, v)
