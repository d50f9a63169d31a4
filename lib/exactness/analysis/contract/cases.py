"""What the kernel-contract checker feeds each kernel class: row pools (random and captured inputs) and the sweep plan.

A *pool* holds the inputs of one class as row tensors sharing a leading row dim plus fixed arguments (weights,
eps, ...). Rows 0..N_REAL-1 are the rows under test; after them come N_MATES *lead mates* and N_MATES *tail mates*:
other rows placed in front of (shifting the tested rows inside a 64-row tile) or behind the tested rows in a call.
For attention a row is one query (q [Hq, D], slot, position) against a fixed two-slot KV cache: the tested rows sit in
slot 0 at positions 0..N_REAL-1 (so rows T-M..T-1 are a prompt block whose cache holds T keys), lead mates are other
slot-0 queries and tail mates are slot-1 queries (another stream's rows in the same call).

The *plan* lists the cases in checking order (M ascending, then KV length T, then variant). A case feeds M tested
rows under one *variant*: a segmentation (segment lengths summing to M; every segment is one prompt-kernel call)
with, per call, a number of lead and tail mates. The *decode plan* (decode_plan) feeds the decode kernel itself
blocks of DECODE_M rows, as batched decode and concurrent streams call it.

Attention's sites are KV cache formats (inputs.KV_SITES): at site ``fp8`` make_pool stores the caches as fp8 codes
and scales (``kv_dtype``). Pools of other routed experts, and offloaded ones: contract/alternatives.py.
"""
from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass

import torch

from ...cache import FP8_MAX, quantize as kv_quantize
from ...config import get_preset
from ...kernels.registry import QUANT_CLASSES, ClassNames, class_record, resolve
from ...weights import synthetic_weights
from ...kernels.quant import WEIGHT_FORMATS, QuantWeight
from .inputs import KV_SITES, SITE_WEIGHTS, RandomInputs, sites_of

FULL_M: tuple[int, ...] = tuple(range(1, 131)) + (255, 256, 257, 511, 512, 513, 1024, 4097)
SWEEPS = ("full", "quick")
SOURCES = ("random", "captured")
N_REAL = 4162     # tested rows per pool: the largest M (4097) plus room for KV lengths just past 4096
N_MATES = 64      # lead mates and tail mates each
TILE_OFFSETS = (1, 17, 37, 63)    # lead-mate counts of the "offset" variant (row position inside a 64-row tile)
KV_BOUNDARIES = tuple(range(64, 257, 64)) + tuple(range(512, 4097, 256))  # tile and KV_BLOCK multiples
BUCKETS = ((1, 1), (2, 6), (7, 63), (64, 64), (65, 127), (128, 130), (131, 257), (258, 513), (514, 1024),
           (1025, 4097))
CAPTURE_PROMPT = "docs"
QUICK_MAX_KV = 1026   # quick sweep, attention: largest M and KV length T
# The quick sweep feeds the sites that repeat another site's calls with one operand changed (attention's fp8 caches,
# routing in groups) and offloaded experts only the cases up to a bound: site -> (Case field, largest value). The
# fp8 bound still crosses the first 256-key KV block; the full sweep feeds every case everywhere.
QUICK_BOUNDS = {"fp8": ("kv_len", 258), "grouped": ("M", 130), "offloaded": ("M", 130)}
# Rows of one decode-kernel call besides M = 1: batched decode holds up to batch.BATCH_LIMIT (4) streams, the serve
# scheduler up to engines/serve.py's MAX_BATCH (8) slots (tests/test_user_faults.py checks both fit; importing
# them here would pull the paths and the HTTP server into the contract).
DECODE_M = tuple(range(2, 9))


@dataclass(frozen=True)
class Variant:
    """One way to feed M rows: ``segments`` (lengths, one prompt call each) and per call ``leads``/``tails`` mates."""

    name: str
    segments: tuple[int, ...]
    leads: tuple[int, ...]
    tails: tuple[int, ...]

    def label(self) -> str:
        """e.g. ``"63+65"`` or ``"130 lead 17"``, ``"40+90 lead 5,0 tail 3,9"``."""
        s = "+".join(map(str, self.segments))
        if any(self.leads):
            s += " lead " + ",".join(map(str, self.leads))
        if any(self.tails):
            s += " tail " + ",".join(map(str, self.tails))
        return s


@dataclass(frozen=True)
class Case:
    """M tested rows starting at pool row ``start`` fed as ``variant``; ``kv_len`` = T for attention, else None."""

    M: int
    start: int
    variant: Variant
    kv_len: int | None = None


def _v(name: str, segs, leads=None, tails=None) -> Variant:
    segs = tuple(int(s) for s in segs)
    zero = (0,) * len(segs)
    return Variant(name, segs, tuple(leads) if leads else zero, tuple(tails) if tails else zero)


def _random_split(M: int, rng: random.Random, parts: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, M), min(parts - 1, M - 1)))
    return [b - a for a, b in zip([0] + cuts, cuts + [M])]


def variants(M: int, sweep: str) -> list[Variant]:
    """The variants of M rows, deterministic in (M, sweep).

    ``full`` with M <= 130: whole block; 1+rest; rest+1; a random 2-4 way split; 63+rest, the 64-row grid (64+64+1
    ...) and 65+rest where they fit; the whole block behind 1/17/37/63 lead mates (by M mod 4); the whole block
    between random lead and tail mates; a random split with random mates per call. ``full`` with larger M: whole,
    rest+1, random split with mates. ``quick``: whole and random split with mates.
    """
    rng = random.Random(f"variants/{M}")
    out = [_v("whole", [M])]
    if sweep == "full" and M <= 130:
        if M >= 2:
            out += [_v("1+rest", [1, M - 1]), _v("rest+1", [M - 1, 1])]
        if M >= 3:
            out.append(_v("random", _random_split(M, rng, rng.randint(2, 4))))
        if M > 64:
            out += [_v("63+rest", [63, M - 63]), _v("grid64", [64] * (M // 64) + ([M % 64] if M % 64 else []))]
        if M > 65:
            out.append(_v("65+rest", [65, M - 65]))
        out.append(_v("offset", [M], [TILE_OFFSETS[M % 4]]))
        out.append(_v("mates", [M], [rng.randint(1, 63)], [rng.randint(1, N_MATES)]))
    elif sweep == "full" and M >= 2:
        out.append(_v("rest+1", [M - 1, 1]))
    if M >= 2 or sweep == "quick":
        segs = _random_split(M, rng, rng.randint(2, 4)) if M >= 2 else [1]
        out.append(_v("random+mates", segs, [rng.randint(0, 63) for _ in segs],
                      [rng.randint(0, N_MATES) for _ in segs]))
    return out


def check_sweep(sweep: str) -> None:
    """Raises ValueError unless ``sweep`` is one of SWEEPS."""
    if sweep not in SWEEPS:
        raise ValueError(f"unknown sweep {sweep!r}; known: {', '.join(SWEEPS)}")


def _kv_lengths(M: int, sweep: str) -> list[int]:
    """KV lengths T >= M for a prompt block of M rows (attention): T = M (prefill from position 0) and, in the full
    sweep or for odd M, one more that moves the block across 64-row tiles and 256-key blocks (plan() adds the
    lengths around every block boundary)."""
    extra = (1, 64, 129, 256, 257)[M % 5] if M <= 130 else 1
    ts = [M, M + extra] if sweep == "full" or M % 2 else [M]
    return [t for t in ts if t <= N_REAL]


def plan(cls: str, sweep: str) -> list[Case]:
    """Cases of class ``cls`` in checking order: M ascending (FULL_M), then T, then variant.

    Attention adds, for every T in {b-1, b, b+1, b+2} around each 64-row tile boundary up to 256 and each
    256-key KV-block boundary up to 4096, blocks of M in {1, 2, 65} rows ending at T. ``quick`` attention keeps
    M in {1, 65} there and caps M and T at QUICK_MAX_KV (every decode reference of a row at position p walks
    p/256 blocks of a 64-row tile, which makes T ~ 4097 the costly part of the sweep on CPU).
    Raises ValueError on an unknown sweep.
    """
    check_sweep(sweep)
    cap = QUICK_MAX_KV if (sweep == "quick" and cls == "attention") else N_REAL
    cases = []
    for M in (m for m in FULL_M if m <= cap):
        vs = variants(M, sweep)
        if cls != "attention":
            start = (M * 2654435761) % (N_REAL - M + 1)   # spread: different M test different rows
            cases += [Case(M, start, v) for v in vs]
            continue
        for T in (t for t in _kv_lengths(M, sweep) if t <= cap):
            cases += [Case(M, T - M, v, T) for v in vs]
    if cls == "attention":
        ms = (1, 2, 65) if sweep == "full" else (1, 65)
        for b in (b for b in KV_BOUNDARIES if b + 2 <= cap):
            for T in (b - 1, b, b + 1, b + 2):
                for M in (m for m in ms if m <= T):
                    vs = variants(M, "quick")
                    cases += [Case(M, T - M, v, T) for v in vs]
        cases = sorted(dict.fromkeys(cases), key=lambda c: (c.M, c.kv_len))   # stable: variants keep their order
    return cases


def fed(case: Case, site: str, sweep: str, offload: bool = False) -> bool:
    """Whether ``case`` is fed at ``site`` (offloaded weights with ``offload``): always in the full sweep, within
    QUICK_BOUNDS in the quick one."""
    keys = [site] + (["offloaded"] if offload else [])
    bounds = [QUICK_BOUNDS[k] for k in keys if k in QUICK_BOUNDS] if sweep == "quick" else []
    return all((getattr(case, field) or 0) <= top for field, top in bounds)


def decode_plan(cls: str, sweep: str) -> list[Case]:
    """Cases feeding the decode kernel blocks of M in DECODE_M rows (batched decode, concurrent streams, serve's
    decode steps): the plan's cases of those M, in its order. Raises ValueError on an unknown sweep."""
    return [c for c in plan(cls, sweep) if c.M in DECODE_M]


def bucket(M: int) -> str:
    """Label of the BUCKETS range holding M (``"other"`` if none)."""
    for a, b in BUCKETS:
        if a <= M <= b:
            return str(a) if a == b else f"{a}-{b}"
    return "other"


def ranges(values) -> str:
    """Sorted unique ints as ranges: [1,2,3,7] -> ``"1-3,7"``."""
    vs = sorted(set(int(v) for v in values))
    out, i = [], 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == vs[j] + 1:
            j += 1
        out.append(str(vs[i]) if i == j else f"{vs[i]}-{vs[j]}")
        i = j + 1
    return ",".join(out)


# ------------------------------------------------------------------------------------------------------- pools

@dataclass
class Pool:
    """Inputs of one class: ``rows`` (tensors [N_REAL + 2*N_MATES, ...]), ``fixed`` args, and ``arrange(rows,
    fixed) -> args`` giving the kernel's positional arguments for a gathered subset of rows."""

    cls: str
    source: str
    rows: tuple
    fixed: tuple
    arrange: object
    stage: object = None   # None, or stage(route) -> the fixed args fetched per call (ring.StagedWeights.fetch)
    note: dict = dataclasses.field(default_factory=dict)   # the alternative: expert_id, kv_dtype (first mismatch)

    def fetch(self, route: str = "sync") -> tuple:
        """The fixed args, with ``stage`` fetched by ``route``: "ring" for prompt calls, "sync" for decode."""
        return self.fixed if self.stage is None else self.stage(route)

    def args(self, idx: torch.Tensor, route: str = "sync", fixed: tuple | None = None) -> tuple:
        """Kernel arguments for pool rows ``idx`` [n] int64 (on the pool's device), in that order; the fixed args
        ``fixed`` (one fetch serving several calls) or fetched for this call by ``route``."""
        return self.arrange(tuple(r.index_select(0, idx) for r in self.rows),
                            self.fetch(route) if fixed is None else fixed)


def _plain(rows, fixed):
    return (*rows, *fixed)


def _pool_rows() -> int:
    return N_REAL + 2 * N_MATES


class _Recorder:
    """Tap recorder (model.tapping): keeps every kernel call's args and output, per class, in call order."""

    def __init__(self):
        self.calls: dict[str, list] = {}

    def record(self, cls, role, plan, kernels, layer, positions, args, out):
        self.calls.setdefault(cls, []).append((layer, args, out))


def preset_config(preset: str, groups: tuple[int, int] | None = None):
    """The ModelConfig of ``preset``, routing in ``groups`` = (n_groups, topk_groups) when given (else the
    preset's own routing).

    Raises:
        ValueError: unknown preset, or groups that do not fit it (config.ModelConfig names the rule).
    """
    cfg = get_preset(preset)
    return cfg if groups is None else cfg.replace(n_groups=int(groups[0]), topk_groups=int(groups[1]))


@functools.lru_cache(maxsize=8)
def _captured(dtype: torch.dtype, device: str, preset: str, weights: str = "bf16",
              groups: tuple[int, int] | None = None) -> tuple[dict, object]:
    """Kernel calls of one forward of ``preset`` (routing in ``groups`` when given) on its synthetic weights in
    format ``weights`` (fast set, batched plan) over the first N_REAL + 2*N_MATES tokens of the ``docs`` prompt;
    returns (class -> [(layer, args, out)], weights)."""
    from ...cache import KVCache
    from ...model import BATCHED, forward, tapping
    from ...prompts import build_prompt

    cfg = preset_config(preset, groups)
    w = synthetic_weights(cfg, dtype, device, weights=weights)
    ids = build_prompt(CAPTURE_PROMPT, _pool_rows()).ids.to(device)           # [P] int64
    cache = KVCache(cfg, ids.numel(), 1, dtype, device)
    rec = _Recorder()
    with tapping(rec), torch.no_grad():
        forward(w, ids, torch.arange(ids.numel(), device=device), cache, "fast", BATCHED)
    return rec.calls, w


def _largest(calls: list, layer: int = 0) -> tuple:
    """Args of the first call with the most rows at ``layer``."""
    at = [c for c in calls if c[0] == layer]
    return max(at, key=lambda c: c[1][0].shape[0])[1]


def _rows_of(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first n rows of t [R, ...], repeating t's rows cyclically when R < n (a routed expert's few members)."""
    return t[:n] if t.shape[0] >= n else t[torch.arange(n, device=t.device) % t.shape[0]]


def _storage(t) -> int:
    """Address of the storage holding ``t`` (a QuantWeight: its codes'), shared by views such as one expert."""
    return (t.codes if isinstance(t, QuantWeight) else t).untyped_storage().data_ptr()


def _site_args(cls: str, site: str, calls: list, w, preset: str, groups=None) -> tuple:
    """Args of the largest tapped call of ``cls`` at ``site``: the calls passing the site's weight (a routed
    expert's weights are views of the stacked tensors: matched by storage), or for a site without a weight the
    site's place among the class's calls in layer 0 (RoPE: q then k).

    Raises:
        ValueError: no tapped call of the site (the forward does not call it: a preset without a shared expert).
    """
    pick = SITE_WEIGHTS.get((cls, site))
    ref = None if pick is None else pick(w)
    if ref is not None:
        at = [c for c in calls if _storage(c[1][1]) == _storage(ref)]
    else:
        names = class_sites(cls, preset, groups)
        at = [c for c in calls if c[0] == 0][names.index(site)::len(names)]
    if not at:
        raise ValueError(f"the forward of preset {preset!r} makes no {cls} call at site {site!r}")
    return max(at, key=lambda c: c[1][0].shape[0])[1]


def _router_args(calls: list, site: str, cfg) -> tuple:
    """The largest layer-0 router call's args with the site's routing: groups appended at ``grouped``, dropped
    at ``topk`` and for a preset without groups."""
    x, wr, top_k, norm, *_ = _largest(calls)
    return (x, wr, top_k, norm, cfg.router_groups) if site == "grouped" else (x, wr, top_k, norm)


def _captured_pool(cls: str, dtype: torch.dtype, device: str, preset: str, site: str = "",
                   weights: str = "bf16", groups=None) -> Pool:
    calls, w = _captured(dtype, device, preset, weights if cls in QUANT_CLASSES else "bf16", groups)
    n = _pool_rows()
    if cls == "attention":
        (q0, kc0, vc0, _, _), (q1, kc1, vc1, _, _) = calls["attention"][0][1], calls["attention"][1][1]
        kc, vc = torch.cat([kc0, kc1]), torch.cat([vc0, vc1])                  # [2, P, Hkv, D]
        g = torch.Generator().manual_seed(11)
        tail_pos = torch.randint(0, n, (N_MATES,), generator=g).to(device)
        q = torch.cat([q0[:N_REAL + N_MATES], q1[tail_pos]])                    # [n, Hq, D]
        pos = torch.cat([torch.arange(N_REAL + N_MATES, device=device), tail_pos])
        slots = torch.cat([torch.zeros(N_REAL + N_MATES, dtype=torch.int64, device=device),
                           torch.ones(N_MATES, dtype=torch.int64, device=device)])
        return Pool(cls, "captured", (q, slots, pos), (kc, vc), class_record(cls).arrange)
    if cls == "argmax":
        logits = calls["lm_head"][0][2]                                         # [P, V] fp32
        return Pool(cls, "captured", (logits.to(dtype),), (), _plain)
    if cls == "router":
        args = _router_args(calls[cls], site, preset_config(preset, groups))
    elif site:
        args = _site_args(cls, site, calls[cls], w, preset, groups)
    else:
        args = _largest(calls[cls], -1 if cls == "lm_head" else 0)
    rows = len(class_record(cls).row_args)   # leading per-row arguments (attention and argmax are built above)
    if cls == "moe_combine" and args[2] is None:   # no shared expert (e.g. the small preset): shared stays fixed
        rows = 2
    return Pool(cls, "captured", tuple(_rows_of(a, n) for a in args[:rows]), tuple(args[rows:]), _plain)


@functools.lru_cache(maxsize=2)
def _weights32(preset: str):
    return synthetic_weights(get_preset(preset), torch.float32)


def _random_pool(cls: str, dtype: torch.dtype, device: str, preset: str, site: str = "", weights: str = "bf16",
                 groups=None) -> Pool:
    """The class record's builder (contract/inputs.py) for ``site`` on a generator seeded by the class's place in
    ADAPTED and the site's place among the class's sites (the first site keeps the class's seed); the weights
    format changes the weights fed, never the draws."""
    rec = class_record(cls)
    k = class_sites(cls, preset, groups).index(site) if site else 0
    g = torch.Generator().manual_seed(1000 + ADAPTED.index(cls) + 100 * k)
    inp = RandomInputs(preset_config(preset, groups), _weights32(preset), g, _pool_rows(), N_REAL, N_MATES, dtype,
                       device, site, weights)
    rows, fixed = resolve(rec.contract_inputs)(inp)
    return Pool(cls, "random", tuple(rows), tuple(fixed), rec.arrange)


def class_sites(cls: str, preset: str = "tiny", groups: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The call sites the contract feeds class ``cls`` for ``preset`` (routing in ``groups`` when given;
    contract_inputs.sites): e.g. dense -> ("q", "k", "v", "o"), a router routing in groups -> ("topk", "grouped");
    ``("",)`` for a class with one operand shape.

    Raises:
        ValueError: unknown class (no builder) or preset, groups that do not fit the preset.
    """
    if cls not in ADAPTED:
        raise ValueError(f"no input builder for kernel class {cls!r}; known: {', '.join(ADAPTED)}")
    return sites_of(resolve(class_record(cls).contract_inputs), preset_config(preset, groups))


ADAPTED = ClassNames(lambda r: r.contract_inputs is not None)   # the classes with an input builder, class order


OFFLOAD_CLASSES = ClassNames(lambda r: r.offloadable)   # the classes whose weights offload moves


def kv_store(t: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Cache rows t [..., D] stored in fp8 format ``kv_dtype`` (cache.KVFormat): codes and scales packed as uint8
    [..., D + 4], one scale for the whole tensor (amax / 448, as cache.calibrate) for ``fp8_e4m3``, one per row for
    ``fp8_e4m3_block``."""
    amax = float(t.float().abs().max())
    scale = float(torch.tensor(amax / FP8_MAX, dtype=torch.float32)) if amax > 0 else 1.0
    return kv_quantize(t, scale if kv_dtype == "fp8_e4m3" else None)


def kv_pool(pool: Pool, kv_dtype: str) -> Pool:
    """An attention pool whose two-slot caches (fixed args k, v [2, n, Hkv, D]) are stored in ``kv_dtype``
    (kv_store; ``bf16``: the pool itself)."""
    if kv_dtype == "bf16":
        return pool
    return dataclasses.replace(pool, fixed=tuple(kv_store(t, kv_dtype) for t in pool.fixed),
                               note={"kv_dtype": kv_dtype})


@functools.lru_cache(maxsize=512)
def make_pool(cls: str, source: str, dtype: torch.dtype, device: str, preset: str = "tiny", site: str = "",
              weights: str = "bf16", groups: tuple[int, int] | None = None, kv_dtype: str | None = None) -> Pool:
    """The row pool of ``cls`` at call site ``site`` (class_sites; "" = the class's first site) from ``source``
    ("random" or "captured") in ``dtype`` on ``device``, shapes of ``preset`` (config.PRESETS; the CPU checks use
    "tiny"), projection weights in format ``weights`` (kernels.quant.WEIGHT_FORMATS; QUANT_CLASSES only) and the
    router routing in ``groups`` = (n_groups, topk_groups) when given (default: the preset's routing).

    Captured rows come from a forward of the preset (on weights of that format) over the ``docs`` prompt
    (model.tapping): the calls at the site; random rows are seeded. Attention: the caches stored in ``kv_dtype``
    (one of the site's KV_SITES; None: the site's first; ``note`` names it), the rows and values those of site
    ``bf16``. Other routed experts than expert 0: contract/alternatives.py.
    Raises:
        ValueError: unknown class (no builder), source, preset, site (listing the class's sites), weights format,
            a quantized format for a class outside QUANT_CLASSES, groups that do not fit the preset, a KV format
            not of the site or for another class than attention.
    """
    names = class_sites(cls, preset, groups)
    if source not in SOURCES:
        raise ValueError(f"unknown input source {source!r}; known: {', '.join(SOURCES)}")
    if weights not in WEIGHT_FORMATS or (weights != "bf16" and cls not in QUANT_CLASSES):
        raise ValueError(f"weights format {weights!r} is not allowed for class {cls!r}; allowed: "
                         + (", ".join(WEIGHT_FORMATS) if cls in QUANT_CLASSES else "bf16 (its weights stay "
                            f"unquantized; quantized formats apply to {', '.join(QUANT_CLASSES)})"))
    site = site or names[0]
    if site not in names:
        raise ValueError(f"unknown call site {site!r} of kernel class {cls!r}; known: {', '.join(names)}")
    if cls == "attention":
        return _kv_site_pool(source, dtype, device, preset, site, weights, groups, kv_dtype)
    if kv_dtype is not None:
        raise ValueError(f"kv_dtype={kv_dtype!r} is not allowed for class {cls!r}; allowed: None (attention only "
                         "reads a KV cache)")
    if source == "captured":
        return _captured_pool(cls, dtype, device, preset, site, weights, groups)
    return _random_pool(cls, dtype, device, preset, site, weights, groups)


def _kv_site_pool(source, dtype, device, preset, site, weights, groups, kv_dtype) -> Pool:
    kv_dtype = kv_dtype or KV_SITES[site][0]
    if kv_dtype not in KV_SITES[site]:
        raise ValueError(f"KV format {kv_dtype!r} is not of attention site {site!r}; allowed: "
                         f"{', '.join(KV_SITES[site])}")
    if site != "bf16":   # the bf16 site's rows and caches, stored in the KV format
        return kv_pool(make_pool("attention", source, dtype, device, preset, "bf16", weights, groups), kv_dtype)
    make = _captured_pool if source == "captured" else _random_pool
    return dataclasses.replace(make("attention", dtype, device, preset, site, weights, groups),
                               note={"kv_dtype": "bf16"})
