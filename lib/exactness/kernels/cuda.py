"""Device dispatch for the invariant kernel set: CPU tensors run the CPU invariant kernels, CUDA tensors run Triton.

Every function here has its kernel class's signature (kernels/registry.py). On a CPU tensor it calls exactly the CPU
invariant kernel (dense.tile_linear, router.router_invariant, experts.*_invariant, attention.attention_invariant,
norm.rmsnorm_invariant, rope.rope_invariant, head.lm_head_invariant), looked up at call time so a patched module
function is honoured. On a CUDA tensor it calls the Triton kernels of triton_gemm.py, triton_attention.py,
triton_moe.py, triton_moe_rows.py and triton_rows.py, which keep the CPU kernels' semantics (storage-dtype outputs,
fp32 accumulation, the RoPE table, stable top-k with lower-id tie-break, fp32 combine in slot order, online softmax
over fixed KV blocks in ascending order, 1/sqrt(D) scale, causal by position per slot) and whose bytes per row do
not depend on the row count: decode (M = 1) and prompt rows run the same reduction order (a GEMM's K chunks and
split-K fixed per weight shape; its tile may follow M, gemm_configs' placements, without changing a byte).

``residual`` (one rounded add per element) and ``argmax`` (first maximal index, lowest id on ties) are row-invariant
on any device and run the same torch code on both.

Importing this module never imports Triton; the first CUDA call does (RuntimeError if Triton is missing).
"""
from __future__ import annotations

import importlib

import torch

from . import attention as _attention
from . import dense as _dense
from . import experts as _experts
from . import head as _head
from . import norm as _norm
from . import quant as _quant
from . import rope as _rope
from . import router as _router


_MODULES: dict = {}


def _gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def _tk(name: str):
    """The Triton module ``name`` (kernels/triton_*.py, e.g. triton_gemm or triton_rows), imported on first use.

    Raises:
        RuntimeError: Triton cannot be imported.
    """
    mod = _MODULES.get(name)
    if mod is None:
        try:
            mod = _MODULES[name] = importlib.import_module(f"{__package__}.{name}")
        except ImportError as e:  # depends on the machine
            raise RuntimeError(f"the invariant set's CUDA kernels need Triton (pip install triton), which failed "
                               f"to import: {e}") from e
    return mod


def dense(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] storage dtype (CPU: dense.tile_linear; CUDA: triton_gemm.linear)."""
    if _gpu(x):
        return _tk("triton_gemm").linear(x, w)
    return _dense.tile_linear(x, w)


def router(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool):
    """(weights [M, k] storage dtype, idx [M, k] int64, logits [M, E] storage dtype); ties go to the lower id.

    CPU: router.router_invariant. CUDA: triton_gemm.linear for the logits, triton_moe_rows.softmax_topk for the rest;
    both in one launch where triton_router serves (decode-size calls), with the same bytes.
    """
    if _gpu(x):
        one = _tk("triton_router").router(x, w, top_k, norm)
        if one is not None:
            return one
        logits = _tk("triton_gemm").linear(x, w)                                  # [M, E] storage dtype
        weights, idx = _tk("triton_moe_rows").softmax_topk(logits, top_k, norm)
        return weights, idx, logits
    return _router.router_invariant(x, w, top_k, norm)


def gate_up(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """SiLU(x w_gate^T) * (x w_up^T) -> [M, I] (CPU: experts.gate_up_invariant; CUDA: one fused Triton GEMM)."""
    if _gpu(x):
        return _tk("triton_gemm").gate_up(x, w_gate, w_up)
    return _experts.gate_up_invariant(x, w_gate, w_up)


def down(h: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """h [M, I] @ w_down [H, I]^T -> [M, H] (CPU: experts.down_invariant; CUDA: triton_gemm.linear)."""
    if _gpu(h):
        return _tk("triton_gemm").linear(h, w_down)
    return _experts.down_invariant(h, w_down)


def moe_experts(h: torch.Tensor, idx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor | None:
    """All routed experts of a layer at once -> y [M, k, H] (triton_moe.experts), or None where not served (CPU
    tensors, or shapes whose two expert configs differ in BLOCK_M in any placement): the caller then runs gate_up
    and down per expert.

    Args:
        h: [M, H]; idx: [M, k] int64; w_gate, w_up: [E, I, H]; w_down: [E, H, I] (stacked, contiguous).
    Every row equals gate_up then down of its expert computed alone (the same tile arithmetic and rounding).
    """
    if not moe_experts_serve(h, w_gate, w_up, w_down):
        return None
    return _tk("triton_moe").experts(h, idx, w_gate, w_up, w_down)


def moe_experts_serve(h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether moe_experts computes rows h [M, H] with stacked weights of these shapes, dtype and layout (on any
    device: an offload store asks with its host copies before staging them)."""
    return _gpu(h) and _tk("triton_moe").supported(h, w_gate, w_down)


moe_experts.serves = moe_experts_serve   # model.moe_block hands it to the expert provider as ``accept``


def combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """fp32 sum over slots 0..k-1 of w*y (+ shared) -> [M, H] (CPU: experts.combine_invariant; CUDA: Triton)."""
    if _gpu(y):
        return _tk("triton_moe_rows").combine(y, weights, shared)
    return _experts.combine_invariant(y, weights, shared)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention -> [M, Hq, D] (CPU: attention.attention_invariant; CUDA: triton_attention)."""
    if _gpu(q):
        return _tk("triton_attention").attention(q, k_cache, v_cache, slots, positions)
    return _attention.attention_invariant(q, k_cache, v_cache, slots, positions)


def attention_captures(k_cache: torch.Tensor, rows: int) -> bool:
    """Whether attention reads a call's slots and positions on the device with a launch that depends on neither
    (so a CUDA graph can hold it): on a CUDA cache, every call (triton_attention groups rows by slot on the
    device, over a tile count fixed by the row and slot counts)."""
    return k_cache.is_cuda


attention.captures = attention_captures   # graphs.py asks a decode attention kernel whether a graph can hold it


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim -> x's shape (CPU: norm.rmsnorm_invariant; CUDA: triton_rows.rmsnorm)."""
    if _gpu(x):
        return _tk("triton_rows").rmsnorm(x, w, eps)
    return _norm.rmsnorm_invariant(x, w, eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE from one cos/sin table (CPU: rope.rope_invariant; CUDA: triton_rows.rope over rope._table's table).

    On CUDA the table covers at least 32768 positions (rope._table's minimum; grown when the CPU path asked for
    more); a position past it gives NaN rows rather than a device sync per call.
    """
    if _gpu(x):
        cos, sin = _rope._table(x.shape[-1], theta, 1, x.device, x.dtype)         # [L, D] storage dtype
        return _tk("triton_rows").rope(x, positions, cos, sin)
    return _rope.rope_invariant(x, positions, theta)


def residual(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b (norm.residual_add on every device: one rounded add per element)."""
    return _norm.residual_add(a, b)


def lm_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """logits [M, V] fp32 = storage-dtype GEMM widened (CPU: head.lm_head_invariant; CUDA: triton_gemm.linear)."""
    if _gpu(x):
        return _tk("triton_gemm").logits(x, w)
    return _head.lm_head_invariant(x, w)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """ids [M] int64, first maximum (head.argmax_first on every device)."""
    return _head.argmax_first(logits)

def dense_invariant(x: torch.Tensor, w) -> torch.Tensor:
    """The invariant set's dense kernel on any weights: quantized weights run quant.linear_tiles (plain torch, so
    on CUDA too), plain tensors ``dense`` (CPU tiles or the Triton GEMM). [M, N] storage dtype."""
    if isinstance(w, _quant.QuantWeight):
        return _quant.linear_tiles(x, w)
    return dense(x, w)


def gate_up_any(x: torch.Tensor, w_gate, w_up) -> torch.Tensor:
    """The invariant set's expert_gate_up on any weights: quantized ones run experts.gate_up_invariant (plain
    torch, any device), plain tensors ``gate_up``. [M, I] storage dtype."""
    if isinstance(w_gate, _quant.QuantWeight):
        return _experts.gate_up_invariant(x, w_gate, w_up)
    return gate_up(x, w_gate, w_up)


def down_any(h: torch.Tensor, w_down) -> torch.Tensor:
    """The invariant set's expert_down on any weights (as gate_up_any). [M, H] storage dtype."""
    if isinstance(w_down, _quant.QuantWeight):
        return _experts.down_invariant(h, w_down)
    return down(h, w_down)


def router_any(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool, groups: tuple[int, int] | None = None):
    """The invariant set's router: ``router`` (CPU tiles or Triton) without groups; group-limited routing runs
    router.router_invariant on CPU.

    Raises:
        NotImplementedError: group-limited routing (n_groups > 1) on a CUDA tensor (no Triton kernel for it).
    """
    if groups is None or groups[0] == 1:
        return router(x, w, top_k, norm)
    if x.is_cuda:
        raise NotImplementedError(f"group-limited routing (n_groups={groups[0]}, topk_groups={groups[1]}) has no "
                                  "CUDA kernel in the invariant set; use n_groups=1 or the CPU")
    return _router.router_invariant(x, w, top_k, norm, groups)
