"""The fast set's CUDA kernels: the best stock PyTorch offers, batch-variant (the control the invariant set is
measured against).

    moe_experts        torch._grouped_mm (CUTLASS grouped GEMM, bf16, sm_90/sm_100): every routed expert of a layer
                       in one launch per projection (gate, up, down); (row, slot) pairs grouped by expert on the
                       device, so no host read and a fixed launch (capturable in a CUDA graph)
    attention_prompt   FlashAttention-2 (aten._flash_attention_forward, the kernel behind scaled_dot_product_attention's
                       flash backend), varlen form reading the cache slot in place: causal aligned bottom-right (a
                       chunk's rows are the last of its keys), KV heads not repeated (GQA in the kernel)
    attention_decode   the same kernel, one sequence per row: its key count (position + 1) and cache slot are read on
                       the device (seqused_k, cu_seqlens_k), so the launch does not depend on them (capturable); a
                       prompt call of a few rows (a drafted verify) runs it too

Where a kernel does not apply (CPU tensors, fp32 or an fp8 cache, a head size flash does not take, an older GPU)
the fast set's torch kernels of attention.py and the per-expert loop serve instead: CPU rows are those of plain
torch. ``run_compiled`` compiles the torch ops around them (moe_experts' routing, gather and scatter, the decode
indices, fast_fused.py's ops) with torch.compile on CUDA. ``_STATE["cpu_grouped"]`` (tests only) lets moe_experts
run on CPU tensors through torch's reference _grouped_mm.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from . import attention as _attention

_STATE = {"cpu_grouped": False}
# What served on this machine: "untried", "ok", or why the torch kernel failed on its first call (its fallback then
# serves every later call, and benchmarks print this so a row never names a kernel that did not run).
STATUS = {"grouped_mm": "untried", "flash": "untried", "inductor": "untried"}


def served() -> dict[str, str]:
    """What the fast set's CUDA kernels did in this process: kind -> "ok" or why its fallback serves; the kinds
    not called yet are left out (empty when the fast set ran no CUDA call)."""
    return {k: v for k, v in STATUS.items() if v != "untried"}


def failed(record: dict[str, str] | None = None) -> dict[str, str]:
    """The kinds of a served() record (default: this process's) whose kernel failed, kind -> why (its fallback
    served every call from then on); neither "ok" nor "untried"."""
    return {k: v for k, v in (STATUS if record is None else record).items() if v not in ("ok", "untried")}


def _first(kind: str, fn, fallback):
    """fn() the first time ``kind`` runs (recording "ok" or the error), fallback() thereafter if it failed."""
    state = STATUS[kind]
    if state == "ok":
        return fn()
    if state != "untried":
        return fallback()
    try:
        out = fn()
    except (RuntimeError, TypeError, NotImplementedError) as e:   # a torch build or GPU without the kernel
        STATUS[kind] = _why(e)
        return fallback()
    STATUS[kind] = "ok"
    return out


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


# ---------------------------------------------------------------------------------------------- torch.compile

_GRAPHS: dict = {}
_COMPILE = {"cpu": False}     # tests only: compile for CPU tensors too


def compiled(fn, variant: tuple = ()):
    """fn compiled by torch.compile (Inductor), whole graph, sizes static but those run_compiled marks dynamic (the
    row count); one per (fn, variant) and process.

    Each variant compiles a copy of fn with a code object of its own: Dynamo counts a function's graphs per code
    object (8 by default, a hard error with fullgraph), and one fn serves many (a norm over [M, H] and [M, h, D],
    bf16 and fp32, one row or more, with and without autograd, of several models)."""
    g = _GRAPHS.get((fn, variant))
    if g is None:
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        g = _GRAPHS[(fn, variant)] = torch.compile(own, dynamic=False, fullgraph=True, options=_inductor_options())
    return g


def _variant(x: torch.Tensor, args: tuple, rows: tuple[int, ...]) -> tuple:
    """A compiled copy's key: autograd (on, off, inference mode), one row or more, and every argument but the row
    count (dim 0 of the tensors at positions ``rows`` of (x, *args)): tensors by dtype, device, requires_grad,
    other sizes and strides (Dynamo guards static strides too: a strided view is a graph of its own; a row tensor's
    strides do not hold the row count unless its rows are not outermost in memory, then it is keyed per row
    count), the rest by value."""
    def sig(i, a):
        if isinstance(a, torch.Tensor):
            return (a.dtype, a.device, a.requires_grad, a.dim(), tuple(a.shape[1:] if i in rows else a.shape),
                    a.stride())
        return a
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), x.shape[0] == 1,
            tuple(sig(i, a) for i, a in enumerate((x, *args))))


def _rows_dynamic(x: torch.Tensor, args: tuple, rows: tuple[int, ...]) -> tuple:
    """(x, *args) with the tensors at positions ``rows``, where x has more than one row, replaced by aliases (views
    of the same memory) whose dim 0 is marked dynamic (torch._dynamo.mark_dynamic), so one graph serves every row
    count above 1 with the other sizes static: Inductor then knows the row width (vectorised loads, no division by
    a symbolic size), as a graph compiled for one shape would. The caller's tensors carry no mark (a mark stays
    with its tensor, which a later call may pass as a weight); a weight is never marked (a size equal to the row
    count by chance would tie the two, and Dynamo refuses the graph). ValueError where a tensor named in ``rows``
    has not x's row count as its dim 0."""
    import torch._dynamo
    out = [x, *args]
    for i in rows:
        a = out[i]
        if not isinstance(a, torch.Tensor):
            continue
        if a.dim() == 0 or a.shape[0] != x.shape[0]:
            raise ValueError(f"argument {i} of shape {tuple(a.shape)} is named a row tensor, but x has "
                             f"{x.shape[0]} rows")
        if x.shape[0] > 1:
            out[i] = a.view(a.shape)
            torch._dynamo.mark_dynamic(out[i], 0)
    return tuple(out)


def _inductor_options() -> dict:
    """Inductor settings that keep a compiled graph's bytes the same from one process to the next: no on-device
    benchmarking of configs that change numerics (``deterministic``), and no reduction split chosen from the first
    call's sizes (``split_reductions``). Those this torch's Inductor has."""
    import torch._inductor.config as cfg
    return {k: v for k, v in (("deterministic", True), ("split_reductions", False)) if hasattr(cfg, k)}


def compiles(x: torch.Tensor) -> bool:
    """Whether run_compiled compiles for x's device: CUDA (or any, under _COMPILE["cpu"])."""
    return x.is_cuda or _COMPILE["cpu"]


def run_compiled(fn, x: torch.Tensor, *args, rows: tuple[int, ...] = (0,)):
    """fn(x, *args) compiled where x is a CUDA tensor with elements and Inductor works here; eagerly elsewhere, and
    from the first call that fails to compile (any graph, any shape) on: STATUS["inductor"] says why. ``rows``: the
    positions in (x, *args) of the tensors whose dim 0 is x's row count (the one size a graph leaves dynamic);
    ValueError where one has not."""
    if not compiles(x) or x.numel() == 0 or STATUS["inductor"] not in ("untried", "ok"):
        return fn(x, *args)
    marked = _rows_dynamic(x, args, rows)
    try:
        out = compiled(fn, _variant(x, args, rows))(*marked)
    except Exception as e:  # noqa: BLE001 -- whatever Inductor raises here; a genuine error recurs eagerly below
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise               # a failed capture: graphs.py runs the forward eagerly instead
        STATUS["inductor"] = _why(e)
        return fn(x, *args)
    STATUS["inductor"] = "ok"
    return out


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


# ---------------------------------------------------------------------------------------------- routed experts

def moe_experts_serve(h: torch.Tensor, w_gate, w_up, w_down) -> bool:
    """Whether moe_experts computes rows h [M, H] with stacked weights w_gate, w_up [E, I, H], w_down [E, H, I]:
    bf16 plain tensors, widths a multiple of 8 (16-byte rows), h on an sm_90/sm_100 GPU (the weights may still be
    host copies: an offload store asks before staging them)."""
    ws = (w_gate, w_up, w_down)
    if not hasattr(torch, "_grouped_mm") or h.dtype != torch.bfloat16 or not all(
            type(w) is torch.Tensor and w.dim() == 3 and w.dtype == h.dtype for w in ws):
        return False
    E, I, H = w_gate.shape
    if w_up.shape != (E, I, H) or w_down.shape != (E, H, I) or I % 8 or H % 8 or STATUS["grouped_mm"] not in (
            "untried", "ok"):
        return False
    if _STATE["cpu_grouped"] and h.device.type == "cpu":
        return True
    return h.is_cuda and _capability(h.device)[0] in (9, 10)


def moe_experts(h: torch.Tensor, idx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor | None:
    """All routed experts of a layer, grouped GEMMs -> y [M, k, H] in h's dtype, or None where not served
    (moe_experts_serve): the caller then runs the set's expert kernels expert by expert.

    Args:
        h: [M, H] normalised rows; idx: [M, k] int64 expert ids; w_gate, w_up: [E, I, H]; w_down: [E, H, I].
    y[m, j] = down_e(SiLU(h[m] gate_e^T) * (h[m] up_e^T)), e = idx[m, j]; each projection one grouped GEMM over
    the pairs sorted by expert (fp32 accumulation, rounded to bf16 once per projection, as F.linear).
    """
    if not moe_experts_serve(h, w_gate, w_up, w_down):
        return None
    return _first("grouped_mm", lambda: run_compiled(_grouped, h, idx, w_gate, w_up, w_down, rows=(0, 1)),
                  lambda: None)


def _grouped(h, idx, w_gate, w_up, w_down) -> torch.Tensor:
    M, k = idx.shape
    H = w_gate.shape[2]
    y = h.new_empty(M, k, H)                                                         # [M, k, H]
    if M == 0:
        return y
    order, offs = route(idx, w_gate.shape[0])
    out = grouped_swiglu(h.index_select(0, order // k), offs, w_gate, w_up, w_down)  # [M*k, H]
    y.view(M * k, H).index_copy_(0, order, out)
    return y


def route(idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """idx [M, k] -> (order [M*k]: the (row, slot) pairs row*k + slot sorted by expert, stable; offs [E] int32: the
    end of each expert's group), on the device without a host read (bincount would sync)."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int32, device=idx.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, torch.cumsum(counts, 0, dtype=torch.int32)


def grouped_swiglu(x, offs, w_gate, w_up, w_down) -> torch.Tensor:
    """x [M*k, H] sorted by expert, offs [E] -> down(SiLU(gate) * up) [M*k, H]: three torch._grouped_mm."""
    gate = torch._grouped_mm(x, w_gate.transpose(1, 2), offs=offs)                   # [M*k, I]
    up = torch._grouped_mm(x, w_up.transpose(1, 2), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=offs)


moe_experts.serves = moe_experts_serve   # model.moe_block hands it to the expert provider as ``accept``


# ---------------------------------------------------------------------------------------------- attention

def flash_cache(k_cache: torch.Tensor) -> bool:
    """Whether FlashAttention-2 reads this cache [S, T, Hkv, D]: CUDA, bf16/fp16 (not fp8), contiguous, D a
    multiple of 8 up to 256, sm_80 or newer."""
    D = k_cache.shape[-1]
    return (k_cache.is_cuda and k_cache.dtype in (torch.bfloat16, torch.float16) and D % 8 == 0 and D <= 256
            and k_cache.is_contiguous() and _capability(k_cache.device)[0] >= 8
            and STATUS["flash"] in ("untried", "ok"))


def _flash(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """flash_cache, and q [M, Hq, D] in the cache's dtype and head size."""
    return q.dtype == k_cache.dtype and q.shape[-1] == k_cache.shape[-1] and flash_cache(k_cache)


def _varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, used_k=None) -> torch.Tensor:
    """FlashAttention-2 varlen: q [Mq, Hq, D], k, v [Tk, Hkv, D] -> [Mq, Hq, D]; sequence b is q rows
    cu_q[b]..cu_q[b+1]-1 over keys from cu_k[b] (used_k[b] of them, else up to cu_k[b+1]); causal bottom-right."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                   seqused_k=used_k)[0]


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Row m over keys 0..positions[m] of slot slots[m] -> [M, Hq, D]: one flash varlen launch, every index read
    on the device (module docstring); elsewhere attention.attention_fast_decode."""
    if not _flash(q, k_cache):
        return _attention.attention_fast_decode(q, k_cache, v_cache, slots, positions)
    return _first("flash", lambda: _decode(q, k_cache, v_cache, slots, positions),
                  lambda: _attention.attention_fast_decode(q, k_cache, v_cache, slots, positions))


def _decode(q, k_cache, v_cache, slots, positions) -> torch.Tensor:
    M = q.shape[0]
    if M == 0:
        return torch.empty_like(q)
    S, T = k_cache.shape[:2]
    kf, vf = (c.view(S * T, *c.shape[2:]) for c in (k_cache, v_cache))             # [S*T, Hkv, D]
    cu_q, cu_k, used = run_compiled(_decode_index, slots, positions, T, rows=(0, 1))
    return _varlen(q.contiguous(), kf, vf, cu_q, cu_k, 1, T, False, used)


def _decode_index(slots: torch.Tensor, positions: torch.Tensor, T: int):
    """flash varlen's indices for one query row per sequence: cu_q [M+1], cu_k [M+1] (each row's slot's first key,
    then the end of the last slot) and the key count of each row [M], int32."""
    M = slots.shape[0]
    cu_q = torch.arange(M + 1, dtype=torch.int32, device=slots.device)
    start = slots.to(torch.int32) * T                                                # [M] first key of each row's slot
    return cu_q, torch.cat([start, start[-1:] + T]), (positions + 1).to(torch.int32)


# graphs.py asks a decode attention kernel's ``captures(k_cache, rows)`` whether it reads slots and positions on
# the device with a launch that depends on neither (then a CUDA graph holds it): flash does, over any slots and rows.
attention_decode.captures = lambda k_cache, rows: flash_cache(k_cache)


# A prompt call of at most this many rows (a drafted verify, an MTP head's catch-up) runs attention_decode's form,
# one sequence per row: no host read and a launch fixed by the row count, so a CUDA graph holds it, as an engine's
# speculative-decoding verify runs its decode kernel.
DECODE_FORM_ROWS = 16


def attention_prompt(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Causal attention of a prompt chunk -> [M, Hq, D]: per slot, its rows (consecutive positions p0..p0+m-1,
    ascending) over keys 0..p0+m-1 in one flash launch; a slot whose rows are not consecutive, and caches flash
    does not take, go to attention.attention_fast_prompt. One host read per slot (its first and last position).
    Up to DECODE_FORM_ROWS rows: attention_decode (row m over keys 0..positions[m]: the same rows, no host read)."""
    if not _flash(q, k_cache):
        return _attention.attention_fast_prompt(q, k_cache, v_cache, slots, positions)
    if q.shape[0] <= DECODE_FORM_ROWS:
        return attention_decode(q, k_cache, v_cache, slots, positions)
    return _first("flash", lambda: _prompt(q, k_cache, v_cache, slots, positions),
                  lambda: _attention.attention_fast_prompt(q, k_cache, v_cache, slots, positions))


def _prompt(q, k_cache, v_cache, slots, positions) -> torch.Tensor:
    groups = list(_attention._groups(slots))
    out = q if len(groups) == 1 else torch.empty_like(q)
    for s, rows in groups:
        pos = positions if len(groups) == 1 else positions[rows]                    # [m]
        m = pos.numel()
        p0, last, steps = torch.stack([pos[0], pos[-1], (pos.diff() == 1).sum()]).tolist()
        if last - p0 + 1 != m or steps != m - 1:                                     # not p0..p0+m-1 in order
            return _attention.attention_fast_prompt(q, k_cache, v_cache, slots, positions)
        qs = q if len(groups) == 1 else q.index_select(0, rows)
        dev, T = q.device, last + 1
        cu_q = torch.tensor([0, m], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, T], dtype=torch.int32, device=dev)
        o = _varlen(qs.contiguous(), k_cache[s], v_cache[s], cu_q, cu_k, m, T, True)  # [m, Hq, D]
        if len(groups) == 1:
            return o
        out.index_copy_(0, rows, o)
    return out


attention_prompt.captures = lambda k_cache, rows: rows <= DECODE_FORM_ROWS and flash_cache(k_cache)


def attention_prompt_serve(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether attention_prompt and attention_decode run flash for q [M, Hq, D] over this cache."""
    return _flash(q, k_cache)


# ---------------------------------------------------------------------------------------------- the deep plan

def whole_calls(x: torch.Tensor) -> bool:
    """The fast set's ``tiles_in_kernels`` option: on CUDA the deep plan hands cuBLAS and the grouped GEMMs whole
    calls, as an engine would (no host row tiles); on the CPU it keeps its row tiles (the CPU rows stay as they
    were)."""
    return x.is_cuda
