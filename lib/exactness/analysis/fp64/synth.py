"""Synthetic input sets for the FP64 receipt: the kernels called directly on drawn inputs.

Input sets: ``normal`` N(0,1); ``outliers`` N(0,1) with 0.1% of the entries replaced
by N(0, 10^2) (the FlashAttention-3 paper's test distribution); ``same_sign`` |N(0,1)| (every product positive, so
a round-toward-zero accumulation shows as a negative bias instead of cancelling).

Paths on synthetic inputs (M rows): ``decode`` = the set's decode kernel called on one row at a time; ``batched`` =
its prompt kernel on the whole [M, ...] block; ``deep`` = the prompt kernel on consecutive 64-row tiles, only for
the classes the deep plan tiles (dense, expert_gate_up, expert_down; model.Ops). Weight matrices are drawn from the
same set and scaled by 1/sqrt(K) so that SiLU and softmax see O(1) arguments. With ``weights`` a quantized format
(kernels/quant.py; the ``fp64_weights`` parameter) the weight matrices of QUANT_CLASSES are quantized after the
draw (the draws do not change), and the references use their dequantized values (fp64/ref.py). With ``kv_dtype``
an fp8 format (cache.KV_DTYPES) attention's drawn caches are stored in it as the kernel contract stores them
(contract/cases.kv_store: uint8 codes and scales), and the reference reads their dequantized values (fp64/ref.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...cache import KVFormat
from ...config import ModelConfig
from ...kernels import get_set
from ...kernels.quant import WEIGHT_FORMATS, quantize
from ...kernels.registry import QUANT_CLASSES, ClassNames, class_record
from ..contract.cases import kv_store
from ..taps import Sample

INPUT_SETS = ("normal", "outliers", "same_sign")
TILED = ClassNames(lambda r: r.deep_tiles)
SYNTH_CLASSES = ("dense", "expert_gate_up", "expert_down", "moe_combine", "attention", "rmsnorm", "rope")
TILE = 64


@dataclass
class Case:
    """One synthetic problem: ``args`` of class ``cls`` (rows first), its weights by (layer, tag), and kv."""

    cls: str
    input_set: str
    K: int
    args: tuple
    params: dict
    kv: dict
    positions: list
    weights: str = "bf16"
    kv_dtype: str = "bf16"


def draw(gen: torch.Generator, shape, input_set: str, dtype, device, scale: float = 1.0) -> torch.Tensor:
    """Inputs of ``shape`` from ``input_set`` (see module docstring), times ``scale``, rounded to ``dtype``.

    Raises:
        ValueError: unknown input set (lists the known ones).
    """
    if input_set not in INPUT_SETS:
        raise ValueError(f"unknown input set {input_set!r}; known: {', '.join(INPUT_SETS)}")
    z = torch.randn(shape, generator=gen)                                           # fp32 on cpu
    if input_set == "outliers":
        z = torch.where(torch.rand(shape, generator=gen) < 1e-3, 10 * torch.randn(shape, generator=gen), z)
    elif input_set == "same_sign":
        z = z.abs()
    return (z * scale).to(dtype).to(device)


def make_case(cls: str, input_set: str, cfg: ModelConfig, dtype, device, M: int = 128, K: int | None = None,
              T: int = 320, seed: int = 0, weights: str = "bf16", kv_dtype: str = "bf16") -> Case:
    """Inputs for one synthetic case; K (dense only) overrides the reduction length (default cfg.hidden);
    ``weights`` quantizes the weight matrices of QUANT_CLASSES (``"bf16"``: none); ``kv_dtype`` stores attention's
    caches in that KV format (uint8 [1, T, Hkv, D + 4] for fp8; the draws do not change).

    Shapes follow ``cfg``: H, I, k, Hq, Hkv, D; attention reads T cached keys, queries at positions T-M..T-1
    (M <= T); rope uses random positions below 16384.
    Raises:
        ValueError: unknown class, input set, weights format or kv_dtype, a quantized format for a class outside
            QUANT_CLASSES, an fp8 kv_dtype for another class than attention, or M > T for attention.
    """
    if weights not in WEIGHT_FORMATS or (weights != "bf16" and cls not in QUANT_CLASSES):
        raise ValueError(f"weights {weights!r} not allowed for synthetic class {cls!r}; allowed: "
                         + (", ".join(WEIGHT_FORMATS) if cls in QUANT_CLASSES else "bf16"))
    if KVFormat.of(kv_dtype).quantized and cls != "attention":
        raise ValueError(f"kv_dtype {kv_dtype!r} not allowed for synthetic class {cls!r}; allowed: bf16 (only "
                         "attention reads a KV cache)")
    case = _draw_case(cls, input_set, cfg, dtype, device, M, K, T, seed)
    if weights != "bf16":
        case.params = {k: quantize(w, weights) for k, w in case.params.items()}
        case.weights = weights
    if kv_dtype != "bf16":
        q, kc, vc, slots, pos = case.args
        kc, vc = kv_store(kc, kv_dtype), kv_store(vc, kv_dtype)
        case.args, case.kv, case.kv_dtype = (q, kc, vc, slots, pos), {0: (kc[0].cpu(), vc[0].cpu())}, kv_dtype
    return case


def _draw_case(cls, input_set, cfg, dtype, device, M, K, T, seed) -> Case:
    g = torch.Generator().manual_seed(seed)
    d = lambda shape, scale=1.0: draw(g, shape, input_set, dtype, device, scale)  # noqa: E731
    H, I, k = cfg.hidden, cfg.expert_inter, cfg.top_k
    if cls == "dense":
        K = K or H
        return Case(cls, input_set, K, (d((M, K)), None), {(0, "syn"): d((64, K), 1 / math.sqrt(K))}, {}, [])
    if cls == "expert_gate_up":
        p = {(0, "syn.gate"): d((I, H), 1 / math.sqrt(H)), (0, "syn.up"): d((I, H), 1 / math.sqrt(H))}
        return Case(cls, input_set, H, (d((M, H)),), p, {}, [])
    if cls == "expert_down":
        return Case(cls, input_set, I, (d((M, I)),), {(0, "syn.down"): d((H, I), 1 / math.sqrt(I))}, {}, [])
    if cls == "moe_combine":
        gl = torch.softmax(torch.randn(M, k, generator=g), -1).to(dtype).to(device)   # routing weights [M, k]
        return Case(cls, input_set, k + 1, (d((M, k, H)), gl, d((M, H))), {}, {}, [])
    if cls == "attention":
        if M > T:
            raise ValueError(f"attention case needs M <= T, got M={M}, T={T}")
        kc, vc = d((1, T, cfg.n_kv_heads, cfg.head_dim)), d((1, T, cfg.n_kv_heads, cfg.head_dim))
        pos = torch.arange(T - M, T, device=device)
        args = (d((M, cfg.n_heads, cfg.head_dim)), kc, vc, torch.zeros_like(pos), pos)
        return Case(cls, input_set, T, args, {}, {0: (kc[0].cpu(), vc[0].cpu())}, pos.tolist())
    if cls == "rmsnorm":
        w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(device)
        return Case(cls, input_set, H, (d((M, H)), w, cfg.rms_eps), {(0, "syn"): w}, {}, [])
    if cls == "rope":
        pos = torch.randint(0, 16384, (M,), generator=g).to(device)
        return Case(cls, input_set, 2, (d((M, cfg.n_heads, cfg.head_dim)), pos, cfg.rope_theta), {}, {},
                    pos.tolist())
    raise ValueError(f"no synthetic case for class {cls!r}; known: {', '.join(SYNTH_CLASSES)}")


def _full_args(case: Case) -> tuple:
    if case.cls == "dense":
        return (case.args[0], case.params[(0, "syn")])
    if case.cls == "expert_gate_up":
        return (case.args[0], case.params[(0, "syn.gate")], case.params[(0, "syn.up")])
    if case.cls == "expert_down":
        return (case.args[0], case.params[(0, "syn.down")])
    return case.args


def _call(fn, cls, args, a, b):
    rows = class_record(cls).row_args   # slice the per-row arguments, pass the fixed ones whole
    return fn(*[x[a:b] if i in rows else x for i, x in enumerate(args)])


def run_case(case: Case, kernels: str, path: str) -> torch.Tensor:
    """The kernel output [M, ...] of ``case`` on ``path`` (decode / batched / deep) with kernel set ``kernels``.

    Raises:
        ValueError: unknown path, or deep for a class the deep plan does not tile.
    """
    ks, args = get_set(kernels), _full_args(case)
    M = args[0].shape[0]
    if path == "decode":
        fn = ks.fn(case.cls, "decode")
        return torch.cat([_call(fn, case.cls, args, m, m + 1) for m in range(M)])
    if path == "batched":
        return ks.fn(case.cls, "prompt")(*args)
    if path == "deep" and case.cls in TILED:
        fn = ks.fn(case.cls, "prompt")
        return torch.cat([_call(fn, case.cls, args, a, a + TILE) for a in range(0, M, TILE)])
    raise ValueError(f"path {path!r} not defined for synthetic class {case.cls!r} (deep tiles only {TILED})")


def case_samples(case: Case, out: torch.Tensor, path: str) -> list[Sample]:
    """One taps.Sample per row of ``out`` (the same structure the tap recorder produces)."""
    a, cls, res = case.args, case.cls, []
    for m in range(out.shape[0]):
        pos = case.positions[m] if case.positions else m
        if cls in ("dense", "expert_gate_up", "expert_down"):
            data, meta = {"x": a[0][m].cpu(), "y": out[m].cpu()}, {}
        elif cls == "moe_combine":
            data, meta = {"y": a[0][m].cpu(), "g": a[1][m].cpu(), "shared": a[2][m].cpu(), "out": out[m].cpu()}, {}
        elif cls == "attention":
            data, meta = {"q": a[0][m].cpu(), "o": out[m].cpu()}, {"slot": 0}
        elif cls == "rmsnorm":
            data, meta = {"x": a[0][m].cpu(), "y": out[m].cpu()}, {"eps": float(a[2])}
        else:
            data, meta = {"x": a[0][m].cpu(), "y": out[m].cpu()}, {"theta": float(a[2])}
        res.append(Sample(cls, 0, "syn", int(pos), path, data, meta))
    return res


def default_cases(cfg: ModelConfig, k_max: int = 16384) -> list[tuple[str, str, int | None]]:
    """(class, input set, K) of the synthetic sweep: dense at several K (same-sign up to ``k_max``), every other
    class at its model shape for each input set."""
    out = []
    for s in INPUT_SETS:
        ks = (1024, 4096, 16384) if s == "same_sign" else (cfg.hidden, 4096)
        out += [("dense", s, K) for K in sorted(set(ks)) if K <= k_max]
        out += [(c, s, None) for c in ("expert_gate_up", "expert_down", "moe_combine", "attention", "rmsnorm",
                                       "rope")]
    return out
