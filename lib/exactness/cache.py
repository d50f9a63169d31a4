"""KV cache: per layer, per stream slot, the keys and values of every position written so far.

Layout per layer: ``k[layer]`` and ``v[layer]`` are ``[S, T, Hkv, X]`` (S slots, T positions of capacity). The
cache's *KV format* (KVFormat, chosen by ``kv_dtype``) decides X and the dtype:

    bf16             the model's storage dtype (bf16, or fp32 with fp32 weights), X = D: the rows as computed
    fp8_e4m3         uint8, X = D + 4: D fp8 e4m3fn codes, then the fp32 scale's 4 bytes (native byte order);
                     one scale per (layer, keys/values) tensor, fixed when the cache is made (calibrate() derives
                     it from a bf16 run; 1.0 when none is given), and stored in every row
    fp8_e4m3_block   as fp8_e4m3, with one scale per (layer, slot, position, kv head): the block is one head's
                     D-vector, scale = amax(|row|) / 448 (1.0 for an all-zero row)

Why these scales: a row's codes and scale are computed from that row alone (or from a constant), so the prompt path
and the decode path write the same bytes for the same token whatever number of rows a call writes. A scale shared
by a block of positions would depend on rows not written yet (a prefill writes the block at once, decode row by
row), so it is not offered. Codes and scales live in one tensor so that snapshot/restore, the prompt cache and the
byte comparisons (exact.kv_first_difference) carry and compare both, never dequantized values. Attention kernels
read a uint8 cache through ``dequantize``. Unwritten positions hold zeros (codes and scale 0 read as 0.0), so
kernels that read a whole block see finite values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ModelConfig

KV_DTYPES = ("bf16", "fp8_e4m3", "fp8_e4m3_block")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # largest finite e4m3fn value
SCALE_BYTES = 4          # one fp32 scale after the D codes of a row


@dataclass(frozen=True)
class KVFormat:
    """What the cache stores (module docstring).

    Attributes:
        dtype: one of KV_DTYPES.
        k_scales, v_scales: fp8_e4m3 only: one positive finite scale per layer (None: 1.0 for every layer).
    Raises:
        ValueError: an unknown dtype, scales given for another dtype, or a scale that is not positive and finite.
    """

    dtype: str = "bf16"
    k_scales: tuple[float, ...] | None = None
    v_scales: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"unknown kv_dtype {self.dtype!r}; allowed: {', '.join(KV_DTYPES)}")
        for name in ("k_scales", "v_scales"):
            s = getattr(self, name)
            if s is None:
                continue
            if self.dtype != "fp8_e4m3":
                raise ValueError(f"{name} are per-tensor scales of kv_dtype 'fp8_e4m3', not of {self.dtype!r}")
            bad = [x for x in s if not (isinstance(x, (int, float)) and math.isfinite(x) and x > 0)]
            if bad:
                raise ValueError(f"{name} must be positive finite floats, got {bad[0]!r}")

    @property
    def quantized(self) -> bool:
        return self.dtype != "bf16"

    @classmethod
    def of(cls, kv_dtype: "str | KVFormat") -> "KVFormat":
        """A KVFormat from a name of KV_DTYPES (or a KVFormat, passed through)."""
        return kv_dtype if isinstance(kv_dtype, KVFormat) else cls(kv_dtype)

    def tensor_scale(self, kind: str, layer: int) -> float | None:
        """The per-tensor scale of ``kind`` (``"k"``/``"v"``) at ``layer``; None for per-row scales or bf16."""
        if self.dtype != "fp8_e4m3":
            return None
        s = self.k_scales if kind == "k" else self.v_scales
        return 1.0 if s is None else float(s[layer])


def quantize(x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Rows x [..., D] (any float dtype) -> packed uint8 [..., D + 4]: fp8 e4m3fn codes of x / scale (rounded to
    nearest even, clamped to +-448), then the fp32 scale's bytes. ``scale`` None: per row amax(|x|) / 448 in fp32
    (1.0 for an all-zero row); a float: that scale (rounded to fp32) for every row. Elementwise and per row only,
    so a row's bytes do not depend on the other rows of the call."""
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True)                                   # [..., 1] fp32
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    else:
        s = torch.full((*xf.shape[:-1], 1), scale, dtype=torch.float32, device=x.device)
    codes = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)                                # [..., D] fp8
    return torch.cat([codes.view(torch.uint8), s.view(torch.uint8)], dim=-1)


def codes_and_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed uint8 [..., D + 4] -> (codes [..., D] float8_e4m3fn view, scales [...] fp32)."""
    codes = packed[..., :-SCALE_BYTES].view(FP8)
    scales = packed[..., -SCALE_BYTES:].contiguous().view(torch.float32)[..., 0]
    return codes, scales


def dequantize(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed uint8 [..., D + 4] -> rows [..., D] in ``dtype``: fp32 code * fp32 scale, then cast to ``dtype``."""
    codes, scales = codes_and_scales(packed)
    return (codes.float() * scales[..., None]).to(dtype)


def kv_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as an attention kernel reads them: a packed uint8 cache dequantized to ``dtype``, any other cache
    as it is."""
    return dequantize(x, dtype) if x.dtype == torch.uint8 else x


@dataclass
class KVState:
    """A copy of one slot's first ``length`` positions: k, v lists of ``[length, Hkv, X]`` per layer (the cache's
    storage, codes and scales included for an fp8 cache)."""

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
        dtype, device: the model's storage dtype and device (the storage of a ``bf16`` cache).
        kv_dtype: a name of KV_DTYPES or a KVFormat (module docstring).
    Raises:
        ValueError: capacity outside 1..cfg.max_positions, slots < 1, a bad kv_dtype, or per-tensor scales whose
            count is not the number of layers.
    """

    def __init__(self, cfg: ModelConfig, capacity: int, slots: int = 1, dtype=torch.bfloat16, device="cpu",
                 kv_dtype: str | KVFormat = "bf16"):
        if not 1 <= capacity <= cfg.max_positions:
            raise ValueError(f"cache capacity {capacity} outside 1..{cfg.max_positions} (max_positions)")
        if slots < 1:
            raise ValueError(f"cache slots must be >= 1, got {slots}")
        self.format = KVFormat.of(kv_dtype)
        for s in (self.format.k_scales, self.format.v_scales):
            if s is not None and len(s) != cfg.n_layers:
                raise ValueError(f"per-tensor KV scales: {len(s)} given, the model has {cfg.n_layers} layers")
        q = self.format.quantized
        shape = (slots, capacity, cfg.n_kv_heads, cfg.head_dim + (SCALE_BYTES if q else 0))
        store = torch.uint8 if q else dtype
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(cfg.n_layers)]
        self.lengths = [0] * slots
        self.capacity = capacity
        self.cfg, self.dtype, self.device = cfg, dtype, device

    @property
    def kv_dtype(self) -> str:
        return self.format.dtype

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              store=None):
        """Store k, v ``[M, Hkv, D]`` of rows at (slots[m], positions[m]); an fp8 cache quantizes them first.

        ``store``: None, or ``fn(k_cache, v_cache, slots, positions, k, v) -> bool`` that stores the (quantized)
        rows itself in one launch (kernels.cache_store.store), False where it does not: indexing stores them then.
        """
        if self.format.quantized:
            k = quantize(k, self.format.tensor_scale("k", layer))
            v = quantize(v, self.format.tensor_scale("v", layer))
        if store is not None and store(self.k[layer], self.v[layer], slots, positions, k, v):
            return
        self.k[layer][slots, positions] = k
        self.v[layer][slots, positions] = v

    def advance(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Record that the slots now hold every position up to the largest written one.

        slots, positions: [M] int64, one device. A call of more rows than the cache has slots is first reduced on
        that device to each slot's largest position (-1 for a slot without rows): the host reads S values, not a
        prompt's rows one by one.
        """
        if positions.numel() > len(self.lengths):
            top = torch.full((len(self.lengths),), -1, dtype=positions.dtype, device=positions.device)
            slots, positions = torch.arange(len(self.lengths)), top.scatter_reduce_(0, slots, positions, "amax")
        for s, p in zip(slots.tolist(), positions.tolist()):
            self.lengths[s] = max(self.lengths[s], p + 1)

    def snapshot(self, slot: int = 0, length: int | None = None) -> KVState:
        """Copy of ``slot``'s first ``length`` positions (default: all written ones)."""
        n = self.lengths[slot] if length is None else length
        return KVState(n, [k[slot, :n].clone() for k in self.k], [v[slot, :n].clone() for v in self.v])

    def restore(self, state: KVState, slot: int = 0) -> None:
        """Load ``state`` into ``slot`` (positions past ``state.length`` are zeroed).

        Raises:
            ValueError: the state does not fit the capacity, or its rows are not of this cache's storage (dtype and
                row shape: a state of another kv_dtype would be silently converted otherwise).
        """
        if state.length > self.capacity:
            raise ValueError(f"state of {state.length} positions exceeds cache capacity {self.capacity}")
        row = self.k[0].shape[2:]
        if state.k and (state.k[0].dtype != self.k[0].dtype or state.k[0].shape[1:] != row):
            raise ValueError(f"state rows {state.k[0].dtype} {tuple(state.k[0].shape[1:])} do not match this cache's "
                             f"{self.k[0].dtype} {tuple(row)} (kv_dtype {self.kv_dtype!r})")
        for layer in range(len(self.k)):
            self.k[layer][slot].zero_()
            self.v[layer][slot].zero_()
            self.k[layer][slot, :state.length] = state.k[layer]
            self.v[layer][slot, :state.length] = state.v[layer]
        self.lengths[slot] = state.length

    def select(self, slot: int) -> "KVCache":
        """A one-slot copy of ``slot`` (same capacity and format), so that one stream of a shared cache compares
        with a cache of its own (exact.kv_first_difference reads slot 0)."""
        one = KVCache(self.cfg, self.capacity, 1, self.dtype, self.device, self.format)
        one.restore(self.snapshot(slot), 0)
        return one

    def truncate(self, slot: int, length: int) -> None:
        """Roll ``slot`` back to ``length`` positions (rejected draft rows), zeroing what follows."""
        for layer in range(len(self.k)):
            self.k[layer][slot, length:].zero_()
            self.v[layer][slot, length:].zero_()
        self.lengths[slot] = min(self.lengths[slot], length)


def calibrate(cache: KVCache) -> KVFormat:
    """Per-tensor fp8 scales from a ``bf16`` cache's written rows: per layer, amax(|keys|) / 448 and
    amax(|values|) / 448 over every slot's written positions (fp32; 1.0 where all are zero).

    Raises:
        ValueError: the cache is quantized already, or holds no written position.
    """
    if cache.format.quantized:
        raise ValueError(f"calibrate needs a bf16 cache, got kv_dtype {cache.kv_dtype!r}")
    if not any(cache.lengths):
        raise ValueError("calibrate needs a cache with written positions; this one is empty")

    def scale(t: torch.Tensor) -> float:
        amax = max(float(t[s, :n].float().abs().max()) for s, n in enumerate(cache.lengths) if n)
        return float(torch.tensor(amax / FP8_MAX, dtype=torch.float32)) if amax > 0 else 1.0
    return KVFormat("fp8_e4m3", tuple(scale(t) for t in cache.k), tuple(scale(t) for t in cache.v))
