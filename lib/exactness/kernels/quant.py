"""Quantized weights and the ``dense`` / expert kernels that read them.

Formats (``WEIGHT_FORMATS``; ``"bf16"`` means no quantization):

    int4_g128  codes: int8 tensor [..., N, K] holding one signed int4 code in -8..7 per weight (not packed: one
               code per byte keeps the kernels plain torch); scales: bf16 [..., N, ceil(K/128)], one per group of
               128 consecutive K (the last group may be shorter). w[n, k] = code[n, k] * scale[n, k // 128].
    nvfp4      codes: int8 [..., N, K] holding a 4-bit e2m1 code 0..15 (bit 3 = sign, bits 0-2 index
               0, 0.5, 1, 1.5, 2, 3, 4, 6); scales: float8_e4m3fn [..., N, ceil(K/16)], one per block of 16
               consecutive K; gscale: fp32 [...], one per matrix (per expert for stacked experts).
               w[n, k] = fp32(e2m1(code) * scale[n, k // 16]) * gscale, the first product exact in fp32 and the
               second rounded once to fp32.

Dequantization (:meth:`QuantWeight.dequantize`) defines the weight's fp32 values; int4_g128's are exact products
(a 4-bit integer times a bf16 scale fits in fp32's 24 bits). An FP64 reference must use these fp32 values.

Kernels. ``linear_rows`` computes y[m, n] = sum_k x[m, k] * w[n, k] for each row by itself: the weights are
dequantized to fp32, each product is rounded once to fp32, and the K products are summed by a fixed pairwise tree
(element k is added to element k + K'/2 with K' = K padded with zeros to a power of two, halving until one is left),
then rounded once to the storage dtype. Every step is an elementwise torch op, so a row's bytes do not depend on how
many rows or output columns are computed together; rows and columns are processed in chunks only to bound memory.
The invariant set uses it for decode (one row) and prompt (64-row tiles) alike. The fast set uses it below
``FAST_GEMM_ROWS`` rows and above that dequantizes to the storage dtype and calls the library GEMM, as engines do,
so its prompt rows differ from its decode rows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

WEIGHT_FORMATS = ("bf16", "int4_g128", "nvfp4")
GROUP = {"int4_g128": 128, "nvfp4": 16}        # weights per scale along K
FAST_GEMM_ROWS = 8                               # fast set: calls of at least this many rows dequantize + GEMM
_CHUNK_ELEMS = 1 << 22                           # fp32 products held at once by linear_rows (16 MiB)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the e2m1 codes 0..7
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E4M3_MAX, _E2M1_MAX = 448.0, 6.0
_OF_CODES = ("shape", "device", "dtype", "data_ptr")   # the tensor attributes a QuantWeight answers from its codes


@dataclass(frozen=True)
class QuantWeight:
    """A quantized weight matrix (or a stack of them), laid out like the bf16 tensor it replaces: [..., N, K].

    Attributes:
        fmt: ``"int4_g128"`` or ``"nvfp4"``.
        codes: int8 [..., N, K] (module docstring: value ranges).
        scales: [..., N, ceil(K / group)], bf16 (int4_g128) or float8_e4m3fn (nvfp4).
        gscale: fp32 [...] per-matrix scale (nvfp4), None for int4_g128.

    Indexing the leading dim (``qw[e]``) gives expert ``e`` as a QuantWeight; ``to`` moves it; ``shape``,
    ``device``, ``dtype`` (int8: the dequantized values are fp32) and ``data_ptr()`` (identifies the weight) are the
    codes'. Other tensor attributes are refused with NotImplementedError naming the format, so a kernel that only
    knows plain tensors (e.g. a CUDA GEMM) fails clearly instead of reading codes as weights.
    """

    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor
    gscale: torch.Tensor | None = None

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("fmt", "codes", "scales", "gscale"):
            raise AttributeError(name)
        if name in _OF_CODES:
            return getattr(self.codes, name)
        raise NotImplementedError(f"weights={self.fmt!r}: a kernel used the quantized weight as a plain tensor "
                                  f"(attribute {name!r}); only the torch kernels of the fast and invariant sets "
                                  "(kernels/quant.py) read quantized weights")

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.gscale is None else self.gscale.nbytes)

    def is_floating_point(self) -> bool:
        """False: Weights.to must not cast the codes to a float dtype."""
        return False

    def __getitem__(self, i) -> "QuantWeight":
        return QuantWeight(self.fmt, self.codes[i], self.scales[i], None if self.gscale is None else self.gscale[i])

    def to(self, device=None, dtype=None) -> "QuantWeight":
        """A copy on ``device``.

        Raises:
            NotImplementedError: a cast to another dtype than the codes' (int8); dequantize() gives the fp32 values.
        """
        if isinstance(device, torch.dtype):
            device, dtype = None, device
        if dtype not in (None, self.codes.dtype):
            raise NotImplementedError(f"weights={self.fmt!r}: cannot cast quantized weights to {dtype}; "
                                      "dequantize() gives their fp32 values")
        return QuantWeight(self.fmt, self.codes.to(device), self.scales.to(device),
                           None if self.gscale is None else self.gscale.to(device))

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """fp32 [..., n, K]: the weights of output rows ``rows`` (all by default), as the module docstring defines."""
        codes, scales, g = self.codes[..., rows, :], self.scales[..., rows, :], GROUP[self.fmt]
        K = codes.shape[-1]
        s = scales.float().repeat_interleave(g, dim=-1)[..., :K]                     # [..., n, K] fp32
        if self.fmt == "int4_g128":
            return codes.float() * s
        table = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)
        c = codes.long()
        v = torch.where(c >= 8, -table[c & 7], table[c & 7])                          # [..., n, K] fp32
        return (v * s) * self.gscale.float()[..., None, None]


def _blocks(w: torch.Tensor, g: int) -> torch.Tensor:
    """w [..., N, K] fp32 -> [..., N, ceil(K/g), g], zero-padded along K."""
    pad = (-w.shape[-1]) % g
    w = F.pad(w, (0, pad)) if pad else w
    return w.view(*w.shape[:-1], w.shape[-1] // g, g)


def quantize(w: torch.Tensor, fmt: str) -> QuantWeight:
    """Quantize ``w`` [..., N, K] (any float dtype, read as fp32) to ``fmt``, deterministically (round half to even,
    symmetric scales from each group's absolute maximum).

    int4_g128: scale = bf16(amax / 7) (1 for an all-zero group), code = clamp(round(w / scale), -8, 7).
    nvfp4: gscale = amax(matrix) / (6 * 448) (1 for a zero matrix), block scale = e4m3(min(amax(block) / 6 /
    gscale, 448)), code = nearest e2m1 magnitude of |w| / (scale * gscale) (ties to the smaller), with the sign.

    Raises:
        ValueError: ``fmt`` is not one of the quantized formats.
    """
    if fmt not in GROUP:
        raise ValueError(f"unknown quantized weight format {fmt!r}; allowed: {', '.join(GROUP)}")
    w32 = w.float()
    K, b = w32.shape[-1], _blocks(w32, GROUP[fmt])
    if fmt == "int4_g128":
        s = (b.abs().amax(-1) / 7).to(torch.bfloat16)
        s = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.round(b / s.float()[..., None]).clamp(-8, 7)
        return QuantWeight(fmt, q.flatten(-2)[..., :K].to(torch.int8).contiguous(), s.contiguous())
    amax = w32.abs().amax(dim=(-2, -1))
    gs = torch.where(amax > 0, amax / (_E2M1_MAX * _E4M3_MAX), torch.ones_like(amax))       # [...] fp32
    bs = (b.abs().amax(-1) / _E2M1_MAX / gs[..., None, None]).clamp(max=_E4M3_MAX).to(torch.float8_e4m3fn)
    denom = bs.float() * gs[..., None, None]                                                 # [..., N, nb]
    v = torch.where(denom[..., None] > 0, b / denom[..., None], torch.zeros_like(b))
    mids = torch.tensor(_E2M1_MIDS, dtype=torch.float32, device=w.device)
    mag = torch.bucketize(v.abs().clamp(max=_E2M1_MAX).contiguous(), mids)                   # 0..7, ties down
    code = torch.where((v < 0) & (mag > 0), mag + 8, mag)
    return QuantWeight(fmt, code.flatten(-2)[..., :K].to(torch.int8).contiguous(), bs.contiguous(), gs)


def pairwise_sum(p: torch.Tensor) -> torch.Tensor:
    """Sum ``p`` [..., K] fp32 over its last dim by the fixed pairwise tree of the module docstring -> [...] fp32."""
    K = p.shape[-1]
    width = 1 << max(K - 1, 0).bit_length()
    if width != K:
        p = F.pad(p, (0, width - K))
    while p.shape[-1] > 1:
        h = p.shape[-1] // 2
        p = p[..., :h] + p[..., h:]
    return p[..., 0]


def linear_rows(x: torch.Tensor, qw: QuantWeight, tile: int = 1) -> torch.Tensor:
    """x [M, K] (storage dtype) @ dequantized qw [N, K]^T -> [M, N] storage dtype, each row by the fixed-order fp32
    reduction of the module docstring; rows go ``tile`` at a time (fewer when the products would pass the chunk
    budget), which does not change any byte.

    Raises:
        ValueError: qw is a stack (3-d) or its K differs from x's.
    """
    if qw.codes.dim() != 2 or qw.shape[1] != x.shape[1]:
        raise ValueError(f"linear_rows needs x [M, K] and one weight [N, K]; got x {tuple(x.shape)}, "
                         f"weight {tuple(qw.shape)}")
    (M, K), N = x.shape, qw.shape[0]
    width = 1 << max(K - 1, 0).bit_length()
    n_step = max(1, min(N, _CHUNK_ELEMS // width))
    m_step = max(1, min(tile, _CHUNK_ELEMS // (width * n_step)))
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    for n0 in range(0, N, n_step):
        w32 = qw.dequantize(slice(n0, n0 + n_step))                                  # [n, K] fp32
        for m0 in range(0, M, m_step):
            p = x[m0:m0 + m_step, None, :].float() * w32[None]                       # [m, n, K] fp32 products
            out[m0:m0 + m_step, n0:n0 + n_step] = pairwise_sum(p)
    return out.to(x.dtype)


def linear_decode(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """Decode kernel: dequantize-in-register mat-vec, one row at a time ([M, K] -> [M, N] storage dtype)."""
    return linear_rows(x, qw, tile=1)


def linear_tiles(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """Invariant prompt kernel: the decode kernel's per-row arithmetic on 64-row tiles ([M, K] -> [M, N])."""
    return linear_rows(x, qw, tile=64)


def linear_fast(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """Fast set: the mat-vec below FAST_GEMM_ROWS rows, else dequantize to the storage dtype (one more rounding)
    and the library GEMM on the whole block ([M, K] -> [M, N] storage dtype)."""
    if x.shape[0] < FAST_GEMM_ROWS:
        return linear_decode(x, qw)
    return F.linear(x, qw.dequantize().to(x.dtype))


def with_scale(qw: QuantWeight, row: int, group: int, factor: float) -> QuantWeight:
    """A copy of ``qw`` (2-d) whose scale of (row, group) is multiplied by ``factor`` (rounded to the scale dtype);
    for planted faults."""
    s = qw.scales.clone()
    s[row, group] = (s[row, group].float() * factor).to(s.dtype)
    return replace(qw, scales=s)
