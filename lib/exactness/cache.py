"""KV cache: per layer, per stream slot, the keys and values of every position written so far.

Layout per layer: ``k[layer]`` and ``v[layer]`` are ``[S, T, Hkv, D]`` in the storage dtype (S slots, T positions
of capacity). Unwritten positions hold zeros, so kernels that read a whole block see finite values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass
class KVState:
    """A copy of one slot's first ``length`` positions: k, v lists of ``[length, Hkv, D]`` per layer."""

    length: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def nbytes(self) -> int:
        """Bytes held by the copy."""
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)


class KVCache:
    """Keys and values of ``slots`` streams, ``capacity`` positions each.

    Args:
        cfg: model config (layers, kv heads, head dim, max positions).
        capacity: positions per slot (tokens); must not exceed ``cfg.max_positions``.
        slots: number of streams.
        dtype, device: storage dtype and device.
    Raises:
        ValueError: capacity outside 1..cfg.max_positions or slots < 1.
    """

    def __init__(self, cfg: ModelConfig, capacity: int, slots: int = 1, dtype=torch.bfloat16, device="cpu"):
        if not 1 <= capacity <= cfg.max_positions:
            raise ValueError(f"cache capacity {capacity} outside 1..{cfg.max_positions} (max_positions)")
        if slots < 1:
            raise ValueError(f"cache slots must be >= 1, got {slots}")
        shape = (slots, capacity, cfg.n_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.lengths = [0] * slots
        self.capacity = capacity

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v ``[M, Hkv, D]`` of rows at (slots[m], positions[m])."""
        self.k[layer][slots, positions] = k
        self.v[layer][slots, positions] = v

    def advance(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Record that the slots now hold every position up to the largest written one."""
        for s, p in zip(slots.tolist(), positions.tolist()):
            self.lengths[s] = max(self.lengths[s], p + 1)

    def snapshot(self, slot: int = 0, length: int | None = None) -> KVState:
        """Copy of ``slot``'s first ``length`` positions (default: all written ones)."""
        n = self.lengths[slot] if length is None else length
        return KVState(n, [k[slot, :n].clone() for k in self.k], [v[slot, :n].clone() for v in self.v])

    def restore(self, state: KVState, slot: int = 0) -> None:
        """Load ``state`` into ``slot`` (positions past ``state.length`` are zeroed).

        Raises:
            ValueError: the state does not fit the capacity.
        """
        if state.length > self.capacity:
            raise ValueError(f"state of {state.length} positions exceeds cache capacity {self.capacity}")
        for layer in range(len(self.k)):
            self.k[layer][slot].zero_()
            self.v[layer][slot].zero_()
            self.k[layer][slot, :state.length] = state.k[layer]
            self.v[layer][slot, :state.length] = state.v[layer]
        self.lengths[slot] = state.length

    def truncate(self, slot: int, length: int) -> None:
        """Roll ``slot`` back to ``length`` positions (rejected draft rows), zeroing what follows."""
        for layer in range(len(self.k)):
            self.k[layer][slot, length:].zero_()
            self.v[layer][slot, length:].zero_()
        self.lengths[slot] = min(self.lengths[slot], length)
