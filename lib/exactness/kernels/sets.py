"""The registered kernel sets.

``fast``: the best stock PyTorch offers on the device, on whatever block of rows the path hands over: cuBLAS
(F.linear) for dense, FlashAttention-2 for attention and grouped GEMMs (torch._grouped_mm) for the routed experts on
CUDA (fast_cuda.py), the torch ops between them compiled by torch.compile on CUDA (fast_fused.py), plain torch ops
on the CPU. Its prompt rows are not expected to equal decode rows; it is the
control that says what exactness costs, kept so receipts show both sets side by side.

``invariant``: every class computes each row with the same shapes and the same accumulation order whatever the
chunk or segment length (fixed 64-row tiles, fixed 256-key attention blocks, a RoPE table, fp32 MoE combine in slot
order, stable top-k with lower-id tie-break). Its prompt kernels claim the decode kernels' bytes for every row.
"""
from __future__ import annotations

from . import attention, cuda, dense, experts, fast_cuda, fast_fused, fused, head, norm
from .registry import KERNEL_CLASSES, register_set

# The fast set's classes whose kernel is the same for both roles; dense, experts and attention differ by role.
_FAST_BOTH = {
    "router": (fast_fused.router, "F.linear, softmax, torch.topk (CUDA: compiled by torch.compile)"),
    "moe_combine": (fast_fused.combine, "einsum over k in storage dtype (CUDA: compiled)"),
    "rmsnorm": (fast_fused.rmsnorm, "fp32 mean of squares, rsqrt (CUDA: compiled)"),
    "rope": (fast_fused.rope, "cos/sin evaluated per call (CUDA: compiled)"),
    "residual": (norm.residual_add, "a + b"),
    "lm_head": (head.lm_head_fast, "F.linear"),
    "argmax": (head.argmax_first, "torch.argmax"),
}


def _fast(by_role: dict) -> dict:
    """The fast set's table for one role: ``by_role``'s kernels, the others from _FAST_BOTH, in class order."""
    both = {**_FAST_BOTH, **by_role}
    return {c: both[c] for c in KERNEL_CLASSES if c in both}


FAST = register_set(
    "fast",
    decode=_fast({
        "dense": (dense.linear_fast, "F.linear on the rows given (CUDA: cuBLAS)"),
        "expert_gate_up": (fast_fused.gate_up, "two F.linear, SiLU * up (CUDA: compiled; bf16 routed experts in "
                           "torch._grouped_mm, the set's grouped_experts option)"),
        "expert_down": (experts.down_fast, "F.linear (CUDA bf16: routed experts in torch._grouped_mm)"),
        "attention": (fast_cuda.attention_decode, "CUDA bf16/fp16: FlashAttention-2 varlen "
                      "(aten._flash_attention_forward), one launch, key counts read on the device; else "
                      "scaled_dot_product_attention per row (not cuDNN)"),
    }),
    prompt=_fast({
        "dense": (dense.linear_fast, "F.linear on the whole chunk (CUDA: cuBLAS; CPU deep plan: 64-row tiles)"),
        "expert_gate_up": (fast_fused.gate_up, "two F.linear on the expert's rows, SiLU * up (CUDA: compiled; "
                           "bf16 routed experts in torch._grouped_mm, grouped by expert, one launch per projection)"),
        "expert_down": (experts.down_fast, "F.linear on the expert's rows (CUDA bf16: routed experts in "
                        "torch._grouped_mm)"),
        "attention": (fast_cuda.attention_prompt, "CUDA bf16/fp16: FlashAttention-2 (aten._flash_attention_forward), "
                      "causal bottom-right, GQA in the kernel, one launch per slot; else "
                      "scaled_dot_product_attention, causal mask, KV heads repeated (not cuDNN)"),
    }),
    claims_exact=False,
    description="stock PyTorch (cuBLAS, FlashAttention-2, grouped expert GEMMs and torch.compile'd elementwise ops "
                "on CUDA); prompt rows may differ from decode rows",
    # grouped_experts: on CUDA (bf16, sm_90/sm_100) every routed expert of a layer in three torch._grouped_mm
    # launches (gate, up, down), the routing around them compiled, no host read; elsewhere None, and the experts
    # run one by one (F.linear).
    # tiles_in_kernels: on CUDA the deep plan hands the kernels whole calls (no host row tiles).
    # residual_norm, combine_residual_norm, dense_residual_norm, qk_norm_rope: on CUDA the same torch ops compiled
    # into one graph each (fast_fused), as the invariant set's options fuse its kernels.
    options={"grouped_experts": fast_cuda.moe_experts, "tiles_in_kernels": fast_cuda.whole_calls,
             "residual_norm": fast_fused.residual_norm, "combine_residual_norm": fast_fused.combine_residual_norm,
             "dense_residual_norm": fast_fused.dense_residual_norm, "qk_norm_rope": fast_fused.qk_norm_rope},
)

_INVARIANT = {
    "dense": (cuda.dense_invariant, "CPU: F.linear on 64-row tiles; CUDA: Triton GEMM, K chunks and split-K "
              "fixed per (N, K) for every M (tile size may follow M, same bytes), partials summed in split order "
              "(projections of one input with matching launches in one grouped pair of launches, same bytes); "
              "quantized weights: fp32 dequantized products, fixed pairwise sum per row (any device)"),
    "router": (cuda.router_any, "64-row tiles (CUDA: the dense Triton GEMM); fp32 softmax; top-k, lower id wins "
               "ties (group-limited: CPU only)"),
    "expert_gate_up": (cuda.gate_up_any, "64-row tiles for GEMMs and SiLU (CUDA: one fused Triton GEMM, K order "
                       "as dense)"),
    "expert_down": (cuda.down_any, "CPU: F.linear on fixed 64-row tiles; CUDA: the dense Triton GEMM"),
    "moe_combine": (cuda.combine, "fp32 sum over k in slot order"),
    "attention": (attention.reads_fp8(cuda.attention), "query-row tiles, fixed KV blocks (CPU 256, CUDA per "
                  "config), online softmax in order (CUDA: softmax weights rounded to the storage dtype for P·V, "
                  "as FlashAttention-2); an fp8 cache dequantized to fp32 (CUDA: the whole cache, then the fp32 "
                  "kernel)"),
    "rmsnorm": (cuda.rmsnorm, "64-row tiles (CUDA: one fixed row block per width; a layer's q/k norms with their "
                "RoPE, and each norm after a residual add with the add, in one launch, same bytes)"),
    "rope": (cuda.rope, "cos/sin gathered from a table"),
    "residual": (cuda.residual, "a + b"),
    "lm_head": (cuda.lm_head, "CPU: F.linear on fixed 64-row tiles; CUDA: the dense Triton GEMM"),
    "argmax": (cuda.argmax, "torch.argmax (first maximum)"),
}

INVARIANT = register_set(
    "invariant", decode=dict(_INVARIANT), prompt=dict(_INVARIANT), claims_exact=True,
    description="batch-invariant: fixed tiles and reduction orders; prompt rows claim decode bytes",
    # grouped_experts: model.moe_block runs all of a layer's experts at once (CUDA; resident or staged whole by
    # an offload store's layer ring), same bytes.
    # tiles_in_kernels: dense and expert kernels fix their own row tiles, so the deep plan hands them whole calls.
    # qk_norm_rope, dense_group, residual_norm, combine_residual_norm, dense_residual_norm: on CUDA a layer's q/k
    # norms and RoPE in one launch, the projections whose split-K launches can share one in one grouped launch,
    # each residual add with the next norm in one launch, after the MoE block with its combine and after attention
    # with the output projection (kernels/fused.py), same bytes.
    options={"grouped_experts": cuda.moe_experts, "tiles_in_kernels": True, "qk_norm_rope": fused.qk_norm_rope,
             "dense_group": fused.dense_group, "residual_norm": fused.residual_norm,
             "combine_residual_norm": fused.combine_residual_norm, "dense_residual_norm": fused.dense_residual_norm},
)
