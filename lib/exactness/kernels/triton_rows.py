"""Row-wise Triton kernels for CUDA: RMSNorm, RoPE; the jit helpers and the launch every Triton module shares
(triton_moe_rows has the MoE block's row kernels).

Invariance device: every kernel computes each row with one fixed block shape chosen from the row width only (never
from the number of rows), one compiled binary for any row count (``do_not_specialize``), and reductions only along
the row, whose order is fixed by the block layout, so a row's bytes do not depend on its neighbours or on M.
Floating-point contraction (mul + add -> fma) is disabled (``enable_fp_fusion=False``) so each product and sum is
rounded as in the PyTorch expressions the CPU kernels use; division and square root are IEEE (``div_rn``,
``sqrt_rn``); exp is Triton's (ex2-based).

Semantics (rounding points) follow the CPU invariant kernels in norm.py and rope.py; see each wrapper's docstring.
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

# Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) truncates fp32 -> bf16 casts and mis-reads bf16 dot operands;
# under it the kernels round bf16 by integer arithmetic (round to nearest even) and widen dot operands to fp32.
# Compiled GPU code never takes those branches.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NO_FMA = {} if INTERPRET else {"enable_fp_fusion": False}
# Fast launch: after a kernel's first launch for a specialization key, later launches call the compiled kernel's
# launcher directly (Triton's per-call binding costs tens of microseconds of host time, which a decode step pays
# per kernel). EXACTNESS_FAST_LAUNCH=0 turns it off, and so does any installed launch hook (a profiler's: it must
# see every launch). It never changes which binary runs (see launch()).
FAST_LAUNCH = os.environ.get("EXACTNESS_FAST_LAUNCH", "1") == "1" and not INTERPRET
_COMPILED: dict = {}
# Programmatic dependent launch (sm_90+): every kernel is launched with ``launch_pdl`` and begins with pdl_start, so
# in a stream or a CUDA graph the next kernel's programs are placed while the previous kernel finishes, then wait
# (griddepcontrol.wait: the previous grid complete and its writes visible) before any load or store. Nothing is read
# before the wait, so no byte changes; what it saves is the launch gap between dependent kernels. PDL = False
# launches as before (benchmarks time both).
PDL = not INTERPRET


_CAPS: dict[int, tuple[int, int]] = {}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (plain Python: triton.cdiv is a constexpr function, slow to call from host code)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); plain Python, as cdiv."""
    return 1 << (max(1, n) - 1).bit_length()


def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device (cached); (0, 0) for the CPU (the interpreter)."""
    if device.type != "cuda":
        return (0, 0)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def _capability(idx: int) -> tuple[int, int]:
    if idx not in _CAPS:
        _CAPS[idx] = torch.cuda.get_device_capability(idx)
    return _CAPS[idx]


def _spec(a) -> tuple:
    """What Triton specializes a runtime argument on (a superset: dtype, 16-byte alignment, ==1, %16, int width)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return ("i", a == 1, a % 16 == 0, -2 ** 31 <= a < 2 ** 31)
    if isinstance(a, float):
        return ("f",)
    if type(a).__name__ == "TensorDescriptor":
        return ("d", a.base.dtype, tuple(a.block_shape), a.padding)
    return (type(a).__name__, a)


def launch(kernel, grid: tuple, args: tuple, consts: dict, key: tuple | None = None, **opts) -> None:
    """``kernel[grid](*args, **consts, PDL=..., **opts)``; with FAST_LAUNCH, repeat launches skip Triton's argument
    binding. Every kernel's last constexpr is ``PDL`` (set here, with the ``launch_pdl`` option: see PDL above).

    The first launch of a key goes through Triton (compiling if needed) and its compiled kernel's launcher is kept
    under a key holding the kernel, every constexpr and option, and the specialization-relevant properties of each
    runtime argument (a superset of what Triton keys its own cache on), so a repeat launch runs the binary Triton
    would have picked. ``args`` are the runtime parameters in declaration order, all before the constexpr ones.

    Args:
        key: a caller-built key that already determines all of the above (a wrapper that caches its per-shape
            state builds it once, which saves building it per call); None = built here from the arguments.
    """
    dev = -1 if INTERPRET else torch.cuda.current_device()
    pdl = _pdl(dev)
    if not FAST_LAUNCH or _hooked(_knobs().runtime):
        kernel[grid](*args, **consts, PDL=pdl, **opts, **_PDL_OPT[pdl])
        return
    if key is None:
        key = (kernel, tuple(consts.items()), tuple(opts.items()), tuple(_spec(a) for a in args))
    hit = _COMPILED.get((key, dev, pdl))
    if hit is None:
        _first_launch(kernel, grid, args, {**consts, "PDL": pdl}, {**opts, **_PDL_OPT[pdl]}, (key, dev, pdl))
        return
    run, fn, meta, const_vals = hit
    g = grid + (1,) * (3 - len(grid)) if len(grid) < 3 else grid
    run(g[0], g[1], g[2], _raw_stream(dev), fn, meta, None, None, None, *args, *const_vals)


_PDL_OPT = {False: {}, True: {"launch_pdl": True}}


@contextlib.contextmanager
def launch_settings(fast_launch: bool | None = None, pdl: bool | None = None):
    """FAST_LAUNCH and PDL set for the block (None: as they are), both restored when it exits, on error too; the
    block may change them further (benchmarks that time both ways)."""
    global FAST_LAUNCH, PDL
    saved = FAST_LAUNCH, PDL
    FAST_LAUNCH = saved[0] if fast_launch is None else fast_launch
    PDL = saved[1] if pdl is None else pdl
    try:
        yield
    finally:
        FAST_LAUNCH, PDL = saved


def pdl_arch(capability: tuple[int, int]) -> bool:
    """Whether an NVIDIA GPU of this (major, minor) capability has programmatic dependent launch (sm_90+)."""
    return capability[0] >= 9


def _pdl(dev: int) -> bool:
    """Whether launches on CUDA device ``dev`` (-1: the interpreter) use programmatic dependent launch (PDL): PDL
    on, and an NVIDIA GPU (a ROCm build reports its own capabilities) that has it."""
    return PDL and dev >= 0 and torch.version.hip is None and pdl_arch(_capability(dev))


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Every kernel's first statement: with PDL, wait for the previous grid (complete, writes visible), then let
    the next one be placed."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


_KNOBS: list = []


def _hooked(rt) -> bool:
    """Whether a launch hook is installed (Triton 3.6 keeps them in HookChain objects that are never None)."""
    e, x = rt.launch_enter_hook, rt.launch_exit_hook
    return bool((e is not None and getattr(e, "calls", True)) or (x is not None and getattr(x, "calls", True)))


def _knobs():
    if not _KNOBS:
        from triton import knobs
        _KNOBS.append(knobs)
    return _KNOBS[0]


_KEY_IDS: dict[tuple, int] = {}


def intern_key(key: tuple) -> int:
    """A small int standing for a launch key (hashing a nested key tuple per launch costs host time)."""
    i = _KEY_IDS.get(key)
    if i is None:
        i = _KEY_IDS[key] = len(_KEY_IDS)
    return i


def _raw_stream(dev: int) -> int:
    return torch._C._cuda_getCurrentRawStream(dev)


def _first_launch(kernel, grid, args, consts, opts, key) -> None:
    """Launch through Triton (compiling if needed) and keep the compiled kernel's launcher under ``key``."""
    ck = kernel[grid](*args, **consts, **opts)
    if hasattr(ck, "result"):
        ck = ck.result()
    names = kernel.arg_names[len(args):]
    if sorted(names) != sorted(consts):            # runtime args must all precede the constexprs
        return
    if len(_COMPILED) > 4096:
        _COMPILED.clear()
    _COMPILED[key] = (ck.run, ck.function, ck.packed_metadata, tuple(consts[n] for n in names))


@triton.jit
def round_to(x, dt: tl.constexpr, EMULATE: tl.constexpr):
    """Round fp32 ``x`` to ``dt`` to nearest even (integer emulation for bf16 under the interpreter)."""
    if EMULATE and dt == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        r = x.to(dt)
    return r


@triton.jit
def dot_operand(x, EMULATE: tl.constexpr):
    """``x`` as given to tl.dot (widened to fp32 under the interpreter only)."""
    if EMULATE:
        x = x.to(tl.float32)
    return x


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} must be one of {DTYPES}, got {t.dtype}")


def _row_block(width: int) -> tuple[int, int, int]:
    """(rows per program, block width, warps) for rows of ``width`` elements: a function of the width only."""
    bw = next_pow2(width)
    rows = max(1, min(16, 2048 // bw))
    warps = 4 if rows * bw <= 2048 else 8
    return rows, bw, warps


@triton.jit
def rms_scale(x, H, eps):
    """1 / sqrt(mean(x^2) + eps) per row of fp32 x [BR, BH] (zeros past H), IEEE division and root: [BR, 1]. The
    row sum's order is x's layout's: kernels that claim rmsnorm's bytes call it on a load of rmsnorm's block."""
    var = tl.math.div_rn(tl.sum(x * x, axis=1), H * 1.0)                              # [BR] mean sq
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))[:, None]                           # rsqrt


@triton.jit
def scale_rows(x, r, w, dt: tl.constexpr, EMULATE: tl.constexpr):
    """rmsnorm's rounding points: w * (x * r).to(dt), rounded to dt; fp32 x, r [BR, 1], w [1, BH]."""
    return round_to(w * round_to(x * r, dt, EMULATE).to(tl.float32), dt, EMULATE)


@triton.jit
def rotate_half(x1, x2, c1, c2, s1, s2, dt: tl.constexpr, EMULATE: tl.constexpr):
    """RoPE of halves x1, x2 (fp32 of dt values) by cos/sin halves: x*cos + rotate_half(x)*sin, each product and
    the sum rounded to dt (fp32 results of the sums, not yet rounded)."""
    o1 = round_to(x1 * c1, dt, EMULATE).to(tl.float32) + round_to(-x2 * s1, dt, EMULATE).to(tl.float32)
    o2 = round_to(x2 * c2, dt, EMULATE).to(tl.float32) + round_to(x1 * s2, dt, EMULATE).to(tl.float32)
    return o1, o2


@triton.jit(do_not_specialize=["R"])
def _rmsnorm_kernel(x_ptr, w_ptr, o_ptr, R, H, eps, BR: tl.constexpr, BH: tl.constexpr, EMULATE: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_start(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BH)
    mask = (rows[:, None] < R) & (cols[None, :] < H)
    dt = o_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)   # [BR, BH]
    r = rms_scale(x, H, eps)                                                                   # [BR, 1]
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(o_ptr + rows[:, None] * H + cols[None, :], scale_rows(x, r, w[None, :], dt, EMULATE), mask=mask)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as norm.rmsnorm_invariant: w * (x * 1/sqrt(mean(x^2) + eps)).to(dtype), stats in fp32.

    Args:
        x: [..., H] bf16/fp16/fp32; w: [H] same dtype and device; eps: float.
    Returns:
        [..., H] in x's dtype.
    Raises:
        ValueError: dtype mismatch or w not [H].
    """
    _check_float("x", x)
    if w.shape != (x.shape[-1],) or w.dtype != x.dtype:
        raise ValueError(f"w must be [{x.shape[-1]}] {x.dtype}, got {tuple(w.shape)} {w.dtype}")
    H = x.shape[-1]
    flat = x.reshape(-1, H).contiguous()                                                       # [R, H]
    out = torch.empty_like(flat)
    R = flat.shape[0]
    if R:
        br, bh, warps = _row_block(H)
        wc = w.contiguous()
        key = (_rmsnorm_kernel, x.dtype, H, flat.data_ptr() % 16 == 0, wc.data_ptr() % 16 == 0)   # R: any
        launch(_rmsnorm_kernel, (cdiv(R, br),), (flat, wc, out, R, H, float(eps)),
               dict(BR=br, BH=bh, EMULATE=INTERPRET), key=key, num_warps=warps, **_NO_FMA)
    return out.reshape(x.shape)


@triton.jit(do_not_specialize=["M"])
def _rope_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, o_ptr, M, L, NH, D, HALF,
                 BHN: tl.constexpr, BHALF: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    m = tl.program_id(0)
    p = tl.load(pos_ptr + m)
    ok = (p >= 0) & (p < L)
    p = tl.where(ok, p, 0)
    hh = tl.arange(0, BHN)
    d = tl.arange(0, BHALF)
    mask = (hh[:, None] < NH) & (d[None, :] < HALF)
    dt = o_ptr.dtype.element_ty
    base = m * NH * D + hh[:, None] * D + d[None, :]
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)                          # [NH, D/2]
    x2 = tl.load(x_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + p * D + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + p * D + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + p * D + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + p * D + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    o1, o2 = rotate_half(x1, x2, c1, c2, s1, s2, dt, EMULATE)
    nan = float("nan")
    o1 = tl.where(ok, o1, nan)
    o2 = tl.where(ok, o2, nan)
    tl.store(o_ptr + base, round_to(o1, dt, EMULATE), mask=mask)
    tl.store(o_ptr + base + HALF, round_to(o2, dt, EMULATE), mask=mask)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as rope.rope_invariant: x*cos + rotate_half(x)*sin, each product and the sum rounded to x's dtype.

    Args:
        x: [M, h, D] bf16/fp16/fp32 (D even); positions: [M] int64; cos, sin: [L, D] tables in x's dtype
            (rope._table); a position outside 0..L-1 yields NaN rows (no sync is spent checking it).
    Returns:
        [M, h, D] in x's dtype.
    Raises:
        ValueError: bad shapes or dtypes.
    """
    _check_float("x", x)
    if x.dim() != 3 or x.shape[-1] % 2 or positions.shape != (x.shape[0],):
        raise ValueError(f"expected x [M, h, D even] and positions [M]; got {tuple(x.shape)}, "
                         f"{tuple(positions.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != x.shape[-1] or cos.dtype != x.dtype:
        raise ValueError(f"cos/sin must be [L, {x.shape[-1]}] {x.dtype}; got {tuple(cos.shape)} {cos.dtype}")
    M, NH, D = x.shape
    xc = x.contiguous()
    out = torch.empty_like(xc)
    if M:
        pc, L = positions.contiguous(), cos.shape[0]
        key = (_rope_kernel, x.dtype, pc.dtype, NH, D, L % 16 == 0, L == 1) + tuple(
            t.data_ptr() % 16 == 0 for t in (xc, pc, cos, sin))                           # M: any
        launch(_rope_kernel, (M,), (xc, pc, cos, sin, out, M, L, NH, D, D // 2),
               dict(BHN=next_pow2(NH), BHALF=next_pow2(D // 2), EMULATE=INTERPRET), key=key,
               num_warps=4, **_NO_FMA)
    return out
