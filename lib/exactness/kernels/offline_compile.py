"""Offline compile of every Triton kernel a preset launches (no GPU needed): ``compile_report(capability)`` builds
each kernel for that architecture with the configs, placements and tables the engine would use there, and reports
registers, spills, shared memory, the MMA kind, TMA and programmatic dependent launch.
"""
from __future__ import annotations

import dataclasses
import os
import re

import torch

from .cuda import _tk

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
        if name == "k/v":                  # keys and values (one shape, so one config), with q (triton_group)
            specs += _group_specs(name, N, K, dtype, capability, ty, ("q", shapes["q"][0]))
    return specs + _attention_and_row_specs(cfg, dtype, capability, ty)


def _group_specs(name: str, N: int, K: int, dtype: torch.dtype, capability: tuple[int, int], ty: str,
                 first: tuple[str, int] | None = None) -> list:
    """The grouped split-K partials and sum of two weights of one shape, in each placement that splits K; with
    ``first`` (name, N of a weight of the same K), also of that weight then the two, where its placement for the
    same rows splits K with the same launch constants but its own tile columns and split_k (triton_group)."""
    tg, tt = _tk("triton_gemm"), _tk("triton_tiles")
    p, i32, specs = f"*{ty}", "i32", []
    rows_cfg = [(r, c) for r, c in tg.placements("linear", N, K, dtype, capability) if c.split_k > 1]
    heads = dict(tg.placements("linear", first[1], K, dtype, capability)) if first else {}
    shared = _tk("triton_group").SHARED
    for r, c in rows_cfg:
        a, b, tile = _tile(c, dtype, capability, ty)
        sig = dict(a_src=a, b0_src=b, b1_src=b, b2_src=b, ws_ptr="*fp32", c0_ptr=p, c1_ptr=p, c2_ptr=p,
                   cnt_ptr="*i32", M=i32, N0=i32, N1=i32, N2=i32, K=i32)
        const = tile | dict(BN0=c.block_n, GROUP_M=c.group_m, SPLIT0=c.split_k, SPLIT=c.split_k, NB=2, SUM=True)
        opts = dict(num_warps=c.num_warps, num_stages=c.num_stages)
        specs.append((f"gemm {name} x2 grouped split-K partials and sum [{c.label()}]", tt._gemm_split_group_kernel,
                      sig, const, opts))
        h = heads.get(r)
        if h is not None and h.split_k > 1 and all(getattr(h, f) == getattr(c, f) for f in shared):
            specs.append((f"gemm {first[0]}, {name} x2 grouped split-K partials and sum [{h.label()}; {c.label()}]",
                          tt._gemm_split_group_kernel, dict(sig, b0_src=_tile(h, dtype, capability, ty)[1]),
                          dict(const, BN0=h.block_n, SPLIT0=h.split_k, NB=3), opts))
            specs.append(_group_sum_spec(f"{first[0]}, {name}", h.split_k, c.split_k, 3, ty))
    specs += [_group_sum_spec(name, split, split, 2, ty) for split in sorted({c.split_k for _, c in rows_cfg})]
    return specs


def _tile(c, dtype: torch.dtype, capability: tuple[int, int], ty: str) -> tuple[str, str, dict]:
    """A GEMM config's x and weight operand types (TMA descriptors of its tiles where it loads through TMA on
    sm_90+, else pointers) and the tile constexprs every GEMM kernel takes."""
    tma = c.tma and capability[0] >= 9
    a = f"tensordesc<{ty}[{c.block_m}, {c.block_k}]>" if tma else f"*{ty}"
    b = f"tensordesc<{ty}[{c.block_n}, {c.block_k}]>" if tma else f"*{ty}"
    return a, b, dict(BM=c.block_m, BN=c.block_n, BK=c.block_k, TMA=tma,
                      PRECISION="ieee" if dtype == torch.float32 else "tf32", EMULATE=False)


def _group_sum_spec(name: str, split0: int, split: int, nb: int, ty: str) -> tuple:
    """The second-launch sum of a grouped split-K call of nb weights (weight 0's split0 splits, the others')."""
    p, i32 = f"*{ty}", "i32"
    return (f"gemm {name} x2 grouped split-K sum", _tk("triton_tiles")._split_reduce_group_kernel,
            dict(ws_ptr="*fp32", c0_ptr=p, c1_ptr=p, c2_ptr=p, M=i32, N0=i32, N1=i32, N2=i32),
            dict(**_tk("triton_split").REDUCE, SPLIT0=split0, SPLIT=split, EMULATE=False, NB=nb), dict(num_warps=4))


def _gemm_specs(name: str, kind: str, N: int, K: int, dtype: torch.dtype, capability: tuple[int, int],
                ty: str) -> list[tuple]:
    """One weight shape's GEMM kernels in every placement (gemm_configs.placements), with their split-K pairs."""
    tg = _tk("triton_gemm")
    p, i32, specs = f"*{ty}", "i32", []
    placed = [c for _, c in tg.placements(kind, N, K, dtype, capability)]
    for c in placed:
        a, b, tile = _tile(c, dtype, capability, ty)
        sig = dict(a_src=a, b_src=b, b2_src=b, c_ptr=p, M=i32, N=i32, K=i32, stride_am=i32, stride_bn=i32,
                   stride_cm=i32)
        const = tile | dict(GROUP_M=c.group_m, GATE_UP=kind == "gate_up", SPLIT=c.split_k,
                            SPLIT_LOOP=tg.SPLIT_LOOPS.index(c.split_loop))
        fn = tg._gemm_kernel
        if c.persistent:
            fn, const = tg._gemm_persistent_kernel, const | dict(NUM_SMS=132, WS=c.warp_specialize)
        opts = dict(num_warps=c.num_warps, num_stages=c.num_stages)
        specs.append((f"gemm {name} {N}x{K} [{c.label()}]", fn, sig, const, opts))
        if c.split_k > 1 and kind == "linear":
            specs.append(_split_partials_spec(name, N, K, c, sig, const, opts, dtype))
    if placed[-1].split_k > 1 and kind == "linear":        # one sum per shape: its launch has no tile of its own
        specs.append((f"gemm {name} split-K sum", _tk("triton_tiles")._split_reduce_kernel,
                      dict(ws_ptr="*fp32", c_ptr=p, M=i32, N=i32),
                      dict(**_tk("triton_split").REDUCE, SPLIT=placed[-1].split_k, EMULATE=False, WIDE=0),
                      dict(num_warps=4)))
    return specs


def _router_specs(cfg, dtype: torch.dtype, capability: tuple[int, int], ty: str) -> list[tuple]:
    """The router's logits and softmax/top-k in one launch (triton_router), in each placement it fits."""
    tg, trt, mr = _tk("triton_gemm"), _tk("triton_router"), _tk("triton_moe_rows")
    p, i32, specs, E = f"*{ty}", "i32", [], cfg.n_experts
    for _, c in tg.placements("linear", E, cfg.hidden, dtype, capability):
        if not trt.fits(c, E, cfg.top_k):
            continue
        a, b, tile = _tile(c, dtype, capability, ty)
        sig = dict(a_src=a, b_src=b, ws_ptr="*fp32", c_ptr=p, cnt_ptr="*i32", w_ptr=p, i_ptr="*i64", M=i32, N=i32,
                   K=i32)
        const = tile | dict(GROUP_M=c.group_m, SPLIT=c.split_k, TOPK=cfg.top_k, NORM=cfg.norm_topk_prob, BR=mr.ROWS,
                            BE=triton_next_pow2(E), BKK=triton_next_pow2(cfg.top_k))
        specs.append((f"router logits and softmax/top-k in one launch [{c.label()}]", trt._router_split_kernel, sig,
                      const, dict(num_warps=c.num_warps, num_stages=c.num_stages, enable_fp_fusion=False)))
    return specs


def _dense_norm_specs(cfg, dtype: torch.dtype, capability: tuple[int, int], ty: str) -> list[tuple]:
    """The attention output projection with the residual add and the next RMSNorm in one launch
    (triton_dense_norm), in each placement it fits."""
    tg, tdn, tr = _tk("triton_gemm"), _tk("triton_dense_norm"), _tk("triton_rows")
    p, i32, specs, H = f"*{ty}", "i32", [], cfg.hidden
    br, bh, _ = tr._row_block(H)
    for _, c in tg.placements("linear", H, cfg.n_heads * cfg.head_dim, dtype, capability):
        if not tdn.fits(c, H):
            continue
        a, b, tile = _tile(c, dtype, capability, ty)
        sig = dict(a_src=a, b_src=b, ws_ptr="*fp32", c_ptr=p, cnt_ptr="*i32", r_ptr=p, wn_ptr=p, x_ptr=p, h_ptr=p,
                   M=i32, N=i32, K=i32, eps="fp32")
        const = tile | dict(GROUP_M=c.group_m, SPLIT=c.split_k, BR=br, BH=bh)
        specs.append((f"o projection + residual + rmsnorm in one launch [{c.label()}]", tdn._dense_norm_kernel, sig,
                      const, dict(num_warps=c.num_warps, num_stages=c.num_stages, enable_fp_fusion=False)))
    return specs


def _attention_and_row_specs(cfg, dtype: torch.dtype, capability: tuple[int, int], ty: str) -> list[tuple]:
    """The attention, row-wise and grouped MoE kernels of the preset ``cfg``."""
    ta, tr, mr = _tk("triton_attention"), _tk("triton_rows"), _tk("triton_moe_rows")
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
    for br in sorted({ta.combine_rows(1), ta.COMBINE_ROWS}):                      # a decode row; the most rows
        specs.append((f"attention chunk combine D={D}, {br} rows a program", ta._combine_kernel,
                      dict(ws_ptr="*fp32", ml_ptr="*fp32", o_ptr=p, pos_ptr="*i64", M=i32, NC=i32, sq_m=i32,
                           sq_h=i32),
                      dict(D=D, BD=triton_next_pow2(D), BR=br, CH=ac.chunk, STAGES=ta.COMBINE_STAGES, EMULATE=False),
                      dict(num_warps=4, enable_fp_fusion=False)))
    tc, it = _tk("triton_cache"), "i32" if dtype == torch.float32 else "i16"      # the store copies integers
    specs.append(("KV cache store", tc._kv_store_kernel,
                  dict(k_ptr=f"*{it}", v_ptr=f"*{it}", kc_ptr=f"*{it}", vc_ptr=f"*{it}", s_ptr="*i64", p_ptr="*i64",
                       S=i32, T=i32, W=i32), dict(BW=triton_next_pow2(cfg.n_kv_heads * D)), dict(num_warps=4)))
    for width in (H, D):
        br, bh, warps = tr._row_block(width)
        specs.append((f"rmsnorm H={width}", tr._rmsnorm_kernel,
                      dict(x_ptr=p, w_ptr=p, o_ptr=p, R=i32, H=i32, eps=f32),
                      dict(BR=br, BH=bh, EMULATE=False), dict(num_warps=warps, enable_fp_fusion=False)))
    br, bh, warps = tr._row_block(H)
    specs.append((f"residual + rmsnorm H={H}", _tk("triton_fused")._residual_norm_kernel,
                  dict(a_ptr=p, b_ptr=p, w_ptr=p, x_ptr=p, h_ptr=p, R=i32, H=i32, eps=f32),
                  dict(BR=br, BH=bh, EMULATE=False), dict(num_warps=warps, enable_fp_fusion=False)))
    specs.append((f"moe combine + residual + rmsnorm H={H}", _tk("triton_fused")._combine_residual_norm_kernel,
                  dict(y_ptr=p, c_ptr=p, s_ptr=p, a_ptr=p, w_ptr=p, x_ptr=p, h_ptr=p, R=i32, H=i32, eps=f32),
                  dict(K=cfg.top_k, HAS_SHARED=cfg.shared_expert_inter > 0, BR=br, BH=bh, EMULATE=False),
                  dict(num_warps=warps, enable_fp_fusion=False)))
    br, bd, warps = tr._row_block(D)
    for store, vt in ((False, p), (True, f"*{it}")):                  # the KV store's values copy integers
        name = "q/k rmsnorm + rope" + (" + KV cache store" if store else "")
        specs.append((name, _tk("triton_fused")._qk_norm_rope_kernel,
                      dict(q_ptr=p, k_ptr=p, wq_ptr=p, wk_ptr=p, qo_ptr=p, ko_ptr=p, pos_ptr="*i64", cos_ptr=p,
                           sin_ptr=p, v_ptr=vt, kc_ptr=p, vc_ptr=vt, s_ptr="*i64", M=i32, HQ=i32, HK=i32, D=i32,
                           L=i32, S=i32, T=i32, eps=f32),
                      dict(BR=br, BD=bd, STORE=store, EMULATE=False), dict(num_warps=warps, enable_fp_fusion=False)))
    specs.append(("rope", tr._rope_kernel, dict(x_ptr=p, pos_ptr="*i64", cos_ptr=p, sin_ptr=p, o_ptr=p, M=i32,
                                                  L=i32, NH=i32, D=i32, HALF=i32),
                  dict(BHN=triton_next_pow2(cfg.n_heads), BHALF=triton_next_pow2(D // 2), EMULATE=False),
                  dict(num_warps=4, enable_fp_fusion=False)))
    specs.append(("router softmax/top-k", mr._softmax_topk_kernel,
                  dict(l_ptr=p, w_ptr=p, i_ptr="*i64", M=i32, E=i32),
                  dict(TOPK=cfg.top_k, NORM=cfg.norm_topk_prob, BR=mr.ROWS, BE=triton_next_pow2(cfg.n_experts),
                       BK=triton_next_pow2(cfg.top_k), EMULATE=False),
                  dict(num_warps=mr.WARPS, enable_fp_fusion=False)))
    specs += _router_specs(cfg, dtype, capability, ty) + _dense_norm_specs(cfg, dtype, capability, ty)
    specs += _grouped_specs(cfg, dtype, capability, ty)
    specs.append(("moe combine", mr._combine_kernel, dict(y_ptr=p, w_ptr=p, s_ptr=p, o_ptr=p, M=i32, H=i32),
                  dict(K=cfg.top_k, HAS_SHARED=cfg.shared_expert_inter > 0, BH=min(1024, triton_next_pow2(H)),
                       EMULATE=False), dict(num_warps=4, enable_fp_fusion=False)))
    return specs


def _split_partials_spec(name: str, N: int, K: int, c, sig: dict, const: dict, opts: dict,
                         dtype: torch.dtype) -> tuple:
    """The per-split partials kernel of a linear shape whose config splits K, in config ``c`` (the lm_head's with
    its sum stored widened to fp32, as triton_gemm.logits launches it)."""
    tg = _tk("triton_gemm")
    ssig = dict(a_src=sig["a_src"], b_src=sig["b_src"], ws_ptr="*fp32", c_ptr=sig["c_ptr"], cnt_ptr="*i32",
                M="i32", N="i32", K="i32", stride_am="i32", stride_bn="i32")
    sconst = {k: v for k, v in const.items() if k in ("BM", "BN", "BK", "GROUP_M", "TMA", "PRECISION", "EMULATE",
                                                       "SPLIT")}
    wide = _tk("triton_split").WIDE.get(dtype, 0) if name == "lm_head" else 0    # the logits stored widened
    if wide:
        ssig["c_ptr"] = "*fp32"
    return (f"gemm {name} {N}x{K} split-K partials and sum{' widened' if wide else ''} [{c.label()}]",
            tg._gemm_split_kernel, ssig, sconst | dict(SUM=True, WIDE=wide), opts)


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
        a, b, tile = _tile(c, dtype, capability, ty)
        sig = dict(a_src=a, b_src=b, b2_src=b, c_ptr=p, tile_e_ptr="*i32", dest_ptr="*i32", n_rows=i32, N=i32, K=i32,
                   stride_am=i32, stride_bn=i32, stride_cm=i32)
        const = tile | dict(GATE_UP=kind == "gate_up", SCATTER=kind == "linear", SPLIT=c.split_k, ONE_ROW=False)
        specs.append((f"grouped moe {kind} {E}x{N}x{K} [{c.label()}]", tm._grouped_kernel, sig, const,
                      dict(num_warps=c.num_warps, num_stages=c.num_stages)))
        if c is placed[0][1] or c is placed[0][2]:                 # the fewest rows' placement: one-row calls
            specs.append((f"grouped moe {kind} {E}x{N}x{K} [{c.label()}] one row", tm._grouped_kernel,
                          dict(sig, tile_e_ptr="*i64", dest_ptr="*i64"), const | dict(ONE_ROW=True),
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
