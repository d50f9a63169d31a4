"""Device dispatch for the invariant kernel set: CPU tensors run the CPU invariant kernels, CUDA tensors run Triton.

Every function here has its kernel class's signature (kernels/registry.py). On a CPU tensor it calls exactly the CPU
invariant kernel (dense.tile_linear, router.router_invariant, experts.*_invariant, attention.attention_invariant,
norm.rmsnorm_invariant, rope.rope_invariant, head.lm_head_invariant), looked up at call time so a patched module
function is honoured. On a CUDA tensor it calls the Triton kernels of triton_gemm.py, triton_attention.py and
triton_rows.py, which keep the CPU kernels' semantics (storage-dtype outputs, fp32 accumulation, the RoPE table,
stable top-k with lower-id tie-break, fp32 combine in slot order, online softmax over fixed KV blocks in ascending
order, 1/sqrt(D) scale, causal by position per slot) and whose bytes per row do not depend on the row count: decode
(M = 1) and prompt rows run the same reduction order (a GEMM's K chunks and split-K fixed per weight shape; its tile
may follow M, triton_gemm's placements, without changing a byte).

``residual`` (one rounded add per element) and ``argmax`` (first maximal index, lowest id on ties) are row-invariant
on any device and run the same torch code on both.

Importing this module never imports Triton; the first CUDA call does (RuntimeError if Triton is missing).
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import re

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
    """The Triton module ``name`` (triton_gemm, triton_attention, triton_rows or triton_moe), imported on first use.

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

    CPU: router.router_invariant. CUDA: triton_gemm.linear for the logits, triton_rows.softmax_topk for the rest.
    """
    if _gpu(x):
        logits = _tk("triton_gemm").linear(x, w)                                  # [M, E] storage dtype
        weights, idx = _tk("triton_rows").softmax_topk(logits, top_k, norm)
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
        return _tk("triton_rows").combine(y, weights, shared)
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
        return _tk("triton_gemm").linear(x, w).float()
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



# --------------------------------------------------------------------------------- offline compile (no GPU needed)

_SMEM_LIMIT = {9: 232448, 12: 101376}   # max dynamic shared memory per block (bytes): sm_90 / sm_120 (CUDA guide)


def _kernel_specs(cfg, dtype: torch.dtype, capability: tuple[int, int]) -> list[tuple]:
    """(name, jit fn, signature, constexprs, options) of every Triton kernel the preset ``cfg`` launches."""
    ty = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    H, D, I = cfg.hidden, cfg.head_dim, cfg.expert_inter
    shapes = {"q": (cfg.n_heads * D, H), "k/v": (cfg.n_kv_heads * D, H), "o": (H, cfg.n_heads * D),
              "router": (cfg.n_experts, H), "down": (H, I), "lm_head": (cfg.vocab_size, H), "gate_up": (I, H)}
    specs = []
    for name, (N, K) in shapes.items():
        kind = "gate_up" if name == "gate_up" else "linear"
        specs += _gemm_specs(name, kind, N, K, dtype, capability, ty)
    return specs + _attention_and_row_specs(cfg, dtype, capability, ty)


def _gemm_specs(name: str, kind: str, N: int, K: int, dtype: torch.dtype, capability: tuple[int, int],
                ty: str) -> list[tuple]:
    """One weight shape's GEMM kernels in every placement (triton_gemm.placements), with their split-K pairs."""
    tg = _tk("triton_gemm")
    p, i32, specs = f"*{ty}", "i32", []
    placed = [c for _, c in tg.placements(kind, N, K, dtype, capability)]
    for c in placed:
        tma = c.tma and capability[0] >= 9
        a = f"tensordesc<{ty}[{c.block_m}, {c.block_k}]>" if tma else p
        b = f"tensordesc<{ty}[{c.block_n}, {c.block_k}]>" if tma else p
        sig = dict(a_src=a, b_src=b, b2_src=b, c_ptr=p, M=i32, N=i32, K=i32, stride_am=i32, stride_bn=i32,
                   stride_cm=i32)
        const = dict(BM=c.block_m, BN=c.block_n, BK=c.block_k, GROUP_M=c.group_m, GATE_UP=kind == "gate_up",
                     TMA=tma, PRECISION="ieee" if dtype == torch.float32 else "tf32", EMULATE=False,
                     SPLIT=c.split_k, SPLIT_LOOP=tg.SPLIT_LOOPS.index(c.split_loop))
        fn = tg._gemm_kernel
        if c.persistent:
            fn, const = tg._gemm_persistent_kernel, const | dict(NUM_SMS=132, WS=c.warp_specialize)
        opts = dict(num_warps=c.num_warps, num_stages=c.num_stages)
        specs.append((f"gemm {name} {N}x{K} [{c.label()}]", fn, sig, const, opts))
        if c.split_k > 1 and kind == "linear":
            specs.append(_split_partials_spec(name, N, K, c, sig, const, opts))
    if placed[-1].split_k > 1 and kind == "linear":        # one sum per shape: its launch has no tile of its own
        specs.append((f"gemm {name} split-K sum", tg._split_reduce_kernel,
                      dict(ws_ptr="*fp32", c_ptr=p, M=i32, N=i32),
                      dict(**tg._REDUCE, SPLIT=placed[-1].split_k, EMULATE=False), dict(num_warps=4)))
    return specs


def _attention_and_row_specs(cfg, dtype: torch.dtype, capability: tuple[int, int], ty: str) -> list[tuple]:
    """The attention, row-wise and grouped MoE kernels of the preset ``cfg``."""
    ta, tr = _tk("triton_attention"), _tk("triton_rows")
    p, i32, f32, specs = f"*{ty}", "i32", "fp32", []
    H, D = cfg.hidden, cfg.head_dim
    ac = ta.config_for(D, dtype, capability)
    kv_tma = capability[0] >= 9 and D == triton_next_pow2(D)
    kv = f"tensordesc<{ty}[1, {ac.block_n}, {D}]>" if kv_tma else p
    sig = dict(q_ptr=p, k_src=kv, v_src=kv, o_ptr=p, pos_ptr="*i64", rows_ptr="*i64", tstart_ptr="*i64",
               tlen_ptr="*i64", tslot_ptr="*i64", M=i32, n_tiles=i32, T=i32, sq_m=i32, sq_h=i32, sk_s=i32,
               sk_t=i32, sk_h=i32, scale=f32)
    const = dict(G=cfg.n_heads // cfg.n_kv_heads, D=D, BD=triton_next_pow2(D), BM=ac.block_m, BN=ac.block_n,
                 CH=ac.chunk, GROUPED=0, KV_TMA=kv_tma, PRECISION="ieee" if dtype == torch.float32 else "tf32",
                 EMULATE=False)
    aopts = dict(num_warps=ac.num_warps, num_stages=ac.num_stages, enable_fp_fusion=False)
    specs.append((f"attention D={D} [{ac.label()}]", ta._attn_kernel, sig, const, aopts))
    split_sig = {**{k: v for k, v in sig.items() if k != "o_ptr"}, "ws_ptr": "*fp32", "ml_ptr": "*fp32", "NC": i32}
    order = ["q_ptr", "k_src", "v_src", "ws_ptr", "ml_ptr", "pos_ptr", "rows_ptr", "tstart_ptr", "tlen_ptr",
             "tslot_ptr", "M", "n_tiles", "T", "NC", "sq_m", "sq_h", "sk_s", "sk_t", "sk_h", "scale"]
    for grouped, hpp in ((0, 1), (0, const["G"]), (2, const["G"])):   # packed heads: one slot, one row per tile
        specs.append((f"attention split-KV D={D} [{ac.label()}] tiles {grouped} heads/program {hpp}",
                      ta._attn_split_kernel, {k: split_sig[k] for k in order}, const | dict(GROUPED=grouped, HPP=hpp),
                      aopts))
    for rows, over in ta.SPLIT_PLACEMENTS.get(ta._key(D, dtype, capability), ()):   # few rows: packed heads
        pc = dataclasses.replace(ac, **over)
        for grouped in (0, 2):
            specs.append((f"attention split-KV D={D} [{pc.label()}] calls of <= {rows} rows, tiles {grouped}",
                          ta._attn_split_kernel, {k: split_sig[k] for k in order},
                          const | dict(BM=pc.block_m, GROUPED=grouped, HPP=const["G"]),
                          dict(aopts, num_warps=pc.num_warps, num_stages=pc.num_stages)))
    specs.append((f"attention chunk combine D={D}", ta._combine_kernel,
                  dict(ws_ptr="*fp32", ml_ptr="*fp32", o_ptr=p, pos_ptr="*i64", M=i32, NC=i32, sq_m=i32, sq_h=i32),
                  dict(D=D, BD=triton_next_pow2(D), BR=ta.COMBINE_ROWS, CH=ac.chunk, STAGES=ta.COMBINE_STAGES,
                       EMULATE=False), dict(num_warps=4, enable_fp_fusion=False)))
    tc, it = _tk("triton_cache"), "i32" if dtype == torch.float32 else "i16"      # the store copies integers
    specs.append(("KV cache store", tc._kv_store_kernel,
                  dict(k_ptr=f"*{it}", v_ptr=f"*{it}", kc_ptr=f"*{it}", vc_ptr=f"*{it}", s_ptr="*i64", p_ptr="*i64",
                       S=i32, T=i32, W=i32), dict(BW=triton_next_pow2(cfg.n_kv_heads * D)), dict(num_warps=4)))
    for width in (H, D):
        br, bh, warps = tr._row_block(width)
        specs.append((f"rmsnorm H={width}", tr._rmsnorm_kernel,
                      dict(x_ptr=p, w_ptr=p, o_ptr=p, R=i32, H=i32, eps=f32),
                      dict(BR=br, BH=bh, EMULATE=False), dict(num_warps=warps, enable_fp_fusion=False)))
    specs.append(("rope", tr._rope_kernel, dict(x_ptr=p, pos_ptr="*i64", cos_ptr=p, sin_ptr=p, o_ptr=p, M=i32,
                                                  L=i32, NH=i32, D=i32, HALF=i32),
                  dict(BHN=triton_next_pow2(cfg.n_heads), BHALF=triton_next_pow2(D // 2), EMULATE=False),
                  dict(num_warps=4, enable_fp_fusion=False)))
    specs.append(("router softmax/top-k", tr._softmax_topk_kernel,
                  dict(l_ptr=p, w_ptr=p, i_ptr="*i64", M=i32, E=i32),
                  dict(TOPK=cfg.top_k, NORM=cfg.norm_topk_prob, BR=8, BE=triton_next_pow2(cfg.n_experts),
                       BK=triton_next_pow2(cfg.top_k), EMULATE=False), dict(num_warps=4, enable_fp_fusion=False)))
    specs += _grouped_specs(cfg, dtype, capability, ty)
    specs.append(("moe combine", tr._combine_kernel, dict(y_ptr=p, w_ptr=p, s_ptr=p, o_ptr=p, M=i32, H=i32),
                  dict(K=cfg.top_k, HAS_SHARED=cfg.shared_expert_inter > 0, BH=min(1024, triton_next_pow2(H)),
                       EMULATE=False), dict(num_warps=4, enable_fp_fusion=False)))
    return specs


def _split_partials_spec(name: str, N: int, K: int, c, sig: dict, const: dict, opts: dict) -> tuple:
    """The per-split partials kernel of a linear shape whose config splits K, in config ``c``."""
    tg = _tk("triton_gemm")
    ssig = dict(a_src=sig["a_src"], b_src=sig["b_src"], ws_ptr="*fp32", M="i32", N="i32", K="i32", stride_am="i32",
                stride_bn="i32")
    sconst = {k: v for k, v in const.items() if k in ("BM", "BN", "BK", "GROUP_M", "TMA", "PRECISION", "EMULATE",
                                                       "SPLIT")}
    return (f"gemm {name} {N}x{K} split-K partials [{c.label()}]", tg._gemm_split_kernel, ssig, sconst, opts)


def _grouped_specs(cfg, dtype: torch.dtype, capability: tuple[int, int], ty: str) -> list[tuple]:
    """The grouped invariant MoE kernels (triton_moe.py): the route kernel and the gate/up and down GEMMs over the
    stacked [E*N, K] expert weights, in every placement (triton_moe.expert_placements)."""
    tm = _tk("triton_moe")
    p, i32 = f"*{ty}", "i32"
    E, H, I = cfg.n_experts, cfg.hidden, cfg.expert_inter
    specs = []
    placed = tm.expert_placements(I, H, dtype, capability)
    gemms = [("gate_up", I, H, gu) for _, gu, _ in placed] + [("linear", H, I, dn) for _, _, dn in placed]
    for kind, N, K, c in gemms:
        tma = c.tma and capability[0] >= 9
        a = f"tensordesc<{ty}[{c.block_m}, {c.block_k}]>" if tma else p
        b = f"tensordesc<{ty}[{c.block_n}, {c.block_k}]>" if tma else p
        sig = dict(a_src=a, b_src=b, b2_src=b, c_ptr=p, tile_e_ptr="*i32", dest_ptr="*i32", n_rows=i32, N=i32, K=i32,
                   stride_am=i32, stride_bn=i32, stride_cm=i32)
        const = dict(BM=c.block_m, BN=c.block_n, BK=c.block_k, GATE_UP=kind == "gate_up", SCATTER=kind == "linear",
                     TMA=tma, PRECISION="ieee" if dtype == torch.float32 else "tf32", EMULATE=False,
                     SPLIT=c.split_k)
        specs.append((f"grouped moe {kind} {E}x{N}x{K} [{c.label()}]", tm._grouped_kernel, sig, const,
                      dict(num_warps=c.num_warps, num_stages=c.num_stages)))
    sig = dict(h_ptr=p, ids_ptr="*i64", sorted_ptr="*i64", order_ptr="*i64", xs_ptr=p, dest_ptr="*i32",
               tile_e_ptr="*i32", n_pairs=i32, n_iter=i32, E=i32, H=i32)
    for bm in sorted({gu.block_m for _, gu, _ in placed}):
        const = dict(TOPK=cfg.top_k, BM=bm, BE=triton_next_pow2(E), BH=min(tm.ROUTE_COLUMNS, triton_next_pow2(H)),
                     SMALL=True, BP=triton_next_pow2(tm.SMALL_PAIRS))
        specs.append((f"grouped moe route {bm}-row tiles", tm._route_kernel, sig, const, dict(num_warps=4)))
    return specs


def triton_next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(1, n) - 1).bit_length()


def compile_report(capability: tuple[int, int] = (12, 0), dtype: torch.dtype = torch.bfloat16,
                   preset: str = "small", pdl: bool | None = None) -> list[dict]:
    """Compile every Triton kernel the preset launches for ``capability`` without that GPU being present.

    Uses ``triton.compile(ASTSource(...), target=GPUTarget("cuda", major*10+minor, 32))`` (LLVM -> PTX -> ptxas ->
    cubin on this machine) and reads registers/stack from the cubin with the cuobjdump that ships with Triton.

    Returns:
        One dict per kernel: kernel, target, shared (bytes), smem_ok (shared <= the architecture's per-block limit),
        regs, stack (bytes of local memory per thread: spills), mma ("wgmma" / "mma.sync" / "fma"), tma (PTX uses
        cp.async.bulk.tensor), pdl (the PTX waits with griddepcontrol.wait before its first global, TMA or
        mbarrier instruction: programmatic dependent launch), seconds (compile time). ``pdl``: compile the kernels
        with programmatic dependent launch (None: as launch() does, on sm_90 and newer).
    Raises:
        RuntimeError: Triton missing; ValueError: unknown preset or dtype.
    """
    import subprocess
    import tempfile
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..config import get_preset
    cfg = get_preset(preset)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    rows = []
    pdl = _tk("triton_rows").pdl_arch(capability) if pdl is None else pdl
    for name, fn, sig, const, opts in _kernel_specs(cfg, dtype, capability):
        const, opts = const | {"PDL": pdl}, opts | ({"launch_pdl": True} if pdl else {})
        t0 = time.perf_counter()
        k = triton.compile(ASTSource(fn=fn, signature=sig | {c: "constexpr" for c in const}, constexprs=const),
                           target=target, options=opts)
        secs = time.perf_counter() - t0
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True,
                                   text=True).stdout if os.path.exists(cuobjdump) else ""
        reg = re.search(r"REG:(\d+)", usage)
        stack = re.search(r"STACK:(\d+)", usage)
        ptx = k.asm["ptx"]
        mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "fma"
        rows.append(dict(kernel=name, target=f"sm_{target.arch}", shared=k.metadata.shared,
                         smem_ok=k.metadata.shared <= _SMEM_LIMIT.get(capability[0], 101376),
                         regs=int(reg.group(1)) if reg else None, stack=int(stack.group(1)) if stack else None,
                         mma=mma, tma="cp.async.bulk.tensor" in ptx, pdl=_waits_first(ptx),
                         seconds=round(secs, 2)))
    return rows


_MEMORY_OPS = re.compile(r"\b(ld\.global|st\.global|atom\.global|red\.global|cp\.async|mbarrier|tensormap)")


def _waits_first(ptx: str) -> bool:
    """Whether the PTX's griddepcontrol.wait comes before its first global, TMA or mbarrier instruction."""
    wait = ptx.find("griddepcontrol.wait")
    first = _MEMORY_OPS.search(ptx)
    return wait >= 0 and (first is None or wait < first.start())
