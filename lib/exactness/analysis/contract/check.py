"""The kernel contract: does every prompt kernel produce its decode kernel's bytes for every row?

For each (prompt kernel, decode kernel) pair of a kernel set (``KernelSet.pairs()``), the checker computes the
*decode reference* of every tested row (the decode kernel called on that row alone, M = 1; for attention one query
row at its position against the cache; contract/refs.py, which on CUDA replays graphs of one-row calls) and compares
it, byte for byte (bf16/fp16 viewed as int16, fp32 as int32, integer outputs such as top-k indices and argmax ids
exactly), with the same row computed by the prompt kernel inside blocks of M rows fed under many segmentations, tile
offsets and batch mates (contract/cases.py: the pools and the plan). Inputs: seeded random rows and rows captured
from a forward of the preset over a real prompt; dtypes bf16 and fp32. Every case is checked at each call site of
the class (contract_inputs.sites: the q, k, v and o projections, query-head and kv-head rows, every norm, routed and
shared experts), so a kernel that misbehaves for one operand shape only is caught and the site named. Router outputs
(weights, indices, logits) are all compared. With offload the expert classes are checked once more with their
weights fetched per call as expert offload fetches them (prompt calls through the expert ring behind a decoy, decode
references by one synchronous copy per block of rows: contract/alternatives.py: offloaded), so "offload changes no
byte" is a contract claim too. Quantized weights (``contract_weights``: kernels/quant.py formats int4_g128, nvfp4)
check the classes whose weights a format replaces (kernels/registry.QUANT_CLASSES: dense, expert_gate_up,
expert_down) once more per format at every site, fed the site's weight quantized (random pools) or tapped from a
forward on quantized weights (captured pools); their rows carry ``weights_format``. Grouped routing (the preset's
n_groups > 1, or ``contract_router_groups``): the router is checked at sites ``topk`` and ``grouped`` (the groups
passed to the kernel). Every call the forward makes: attention is checked at sites ``bf16`` and ``fp8`` (the caches
as fp8 codes and scales, formats fp8_e4m3 and fp8_e4m3_block in turn); the expert kernels of a set whose options
name ``expert_id_aware`` get ``expert_id=`` and every routed expert's weights in turn (contract/alternatives.py), as
do offloaded experts, through one ring slot that holds another expert from call to call; the decode kernel is fed
blocks of M > 1 rows too (contract_cases.decode_plan: batched decode, concurrent streams, serve's decode steps). The
quick sweep feeds the fp8 and grouped sites and offloaded experts the cases within cases.QUICK_BOUNDS only.
Rendering: contract/report.py; coverage and merging of sections: contract/combine.py.

Results: one :class:`PairResult` per pair x set x device x dtype, a coverage table listing every class of
KERNEL_CLASSES (a class the checker cannot feed is shown as uncovered, never left out), and the first mismatch of
each pair (site, M, segmentation, call size, row, element, ULP distance).
"""
from __future__ import annotations

import functools
import random
import time
from dataclasses import asdict, dataclass, field

import torch

from ...exact import INT_VIEW, differing_rows, first_differing_row, ulp_distance
from ...progress import bar as progress_bar
from ...kernels import KERNEL_CLASSES, KERNEL_SETS, KernelSpec, get_set
from ...params import ContractParams
from .alternatives import alternatives, offloaded, sharing_host_copies
from .cases import (ADAPTED, KV_BOUNDARIES, N_MATES, N_REAL, OFFLOAD_CLASSES, SOURCES, Case, bucket, check_sweep,
                    class_sites, decode_plan, fed, plan, ranges)
from .combine import coverage
from .refs import DecodeRefs, outputs
from ...kernels.registry import QUANT_CLASSES
from .validate import validate_sets
from ...checkpoint import resolve_device, resolve_dtype
from ...weights import sharing_synthetic_weights

OUTPUT_NAMES = {"router": ("weights", "idx", "logits")}
# (site, source) pairs left out: attention's fp8 caches are fed random rows only (the captured ones are the bf16
# run's keys, quantized: no call the random rows do not make), which keeps the fp8 formats' cost at half the bf16's.
RANDOM_ONLY = {("fp8", "captured")}


def value_ulps(a: float, b: float, dtype: torch.dtype) -> int | None:
    """exact.ulp_distance between two Python floats exact in the storage format ``dtype``, for a mismatch record.

    None for non-float dtypes and for NaN (neither has an ULP order): the record then still shows both values.
    """
    if dtype not in INT_VIEW or a != a or b != b:
        return None
    t = torch.tensor([a, b], dtype=torch.float64).to(dtype)
    return int(ulp_distance(t[0], t[1]))


@dataclass
class PairResult:
    """Outcome of checking one (prompt kernel, decode kernel) pair in one dtype on one device.

    Attributes:
        cls, prompt_kernel, decode_kernel, set, device, dtype: what was checked.
        cases: row comparisons run (one per tested row per case per input source; all outputs of a row together).
        m_ranges: row counts M covered, as ranges ("1-130,255-257,..."); kv_lengths: KV lengths T (attention).
        inputs: input sources ("random,captured"); preset: model preset of the input shapes.
        mismatches: rows whose bytes differ in at least one output element.
        sites: the call sites checked, comma-separated ("q,k,v,o"; "" for a class with one operand shape);
            by_site: site -> [cases, mismatches].
        first_mismatch: None, or the first mismatching row in checking order: site, M, kv_len, segmentation, variant,
            segment, call_rows, lead, row (0..M-1), position (attention), source, output, element (flat index in
            the row), ulp and ulp_format (ULPs of the storage dtype, or of the output's dtype when it is not a
            widened storage value; None for integer outputs), prompt and decode values.
        buckets: M bucket -> [cases, mismatches]; seconds: wall time of the check.
        weights: "resident", or "offloaded" (contract/alternatives.py offloaded: prompt calls take the weights from the
            expert ring, decode references from a synchronous fetch).
        weights_format: the projection weights fed: "bf16" (plain tensors of the run's dtype) or a quantized
            format (kernels/quant.py), also named in first_mismatch.
        router_groups: [n_groups, topk_groups] the router's ``grouped`` site passed, None without groups.
        decode_m: row counts M (ranges) at which the decode kernel itself was fed blocks of rows (cases.decode_plan:
            batched decode, concurrent streams), each row compared with its M = 1 reference; counted in cases,
            mismatches, buckets and by_site, and apart in decode_rows ([rows, mismatching rows]); a first mismatch
            there has role "decode".
    """

    cls: str
    prompt_kernel: str
    decode_kernel: str
    set: str
    device: str
    dtype: str
    cases: int = 0
    m_ranges: str = ""
    kv_lengths: str = ""
    inputs: str = ""
    preset: str = "tiny"
    mismatches: int = 0
    first_mismatch: dict | None = None
    buckets: dict = field(default_factory=dict)
    seconds: float = 0.0
    weights: str = "resident"
    sites: str = ""
    by_site: dict = field(default_factory=dict)
    weights_format: str = "bf16"
    router_groups: list | None = None
    decode_m: str = ""
    decode_rows: list = field(default_factory=lambda: [0, 0])

    def to_row(self) -> dict:
        """JSON row of the receipt's ``contract`` list (key ``class`` for cls)."""
        d = asdict(self)
        return {"class": d.pop("cls"), **d}


def call_layout(case: Case, segment: int) -> tuple[list[int], list[int], list[int]]:
    """Pool rows of one prompt call of ``case``: (lead mates, tested rows, tail mates), deterministic in the case."""
    v = case.variant
    first = case.start + sum(v.segments[:segment])
    rng = random.Random(f"{case.M}/{case.kv_len}/{v.label()}/{segment}")
    lead = rng.sample(range(N_REAL, N_REAL + N_MATES), v.leads[segment])
    tail = rng.sample(range(N_REAL + N_MATES, N_REAL + 2 * N_MATES), v.tails[segment])
    return lead, list(range(first, first + v.segments[segment])), tail


@functools.lru_cache(maxsize=1 << 16)
def _layout(case: Case, segment: int, device: torch.device) -> tuple[int, int, torch.Tensor]:
    """call_layout as (lead mates, tested rows, the call's pool rows [n] int64 on ``device``), made once for every
    site, source and set that feeds the case."""
    lead, real, tail = call_layout(case, segment)
    return len(lead), len(real), torch.tensor(lead + real + tail, dtype=torch.int64).to(device)


def prompt_rows(fn, pool, case: Case, kw: dict | None = None, route: str = "ring") -> list[torch.Tensor]:
    """The prompt kernel's outputs (or the decode kernel's, fetching offloaded weights by ``route`` "sync") for the
    case's M tested rows (segment calls concatenated), one per output; ``kw``: the kernel's keyword arguments."""
    dev = pool.rows[0].device
    parts = []
    for j in range(len(case.variant.segments)):
        lead, real, idx = _layout(case, j, dev)
        outs = outputs(fn(*pool.args(idx, route), **(kw or {})))
        parts.append([o[lead:lead + real] for o in outs])
    return [torch.cat(p) for p in zip(*parts)]


def _locate(case: Case, source: str, got, ref, bad: torch.Tensor, cls: str, dtype, site: str = "") -> dict:
    """First-mismatch record of a case whose rows ``bad`` [M] bool differ."""
    row = int(bad.nonzero()[0])
    seg, acc = 0, 0
    while acc + case.variant.segments[seg] <= row:
        acc += case.variant.segments[seg]
        seg += 1
    names = OUTPUT_NAMES.get(cls, ("out",) * len(got))
    for name, g, r in zip(names, got, ref):
        a, b = g[row].reshape(-1), r[row].reshape(-1)
        e = first_differing_row(a, b)  # of the flattened row: the first differing element
        if e is not None:
            pv, dv = a[e].item(), b[e].item()
            fmt = _ulp_format(a.dtype, dtype, pv, dv)
            lead = case.variant.leads[seg]
            return {"site": site, "M": case.M, "kv_len": case.kv_len, "segmentation": case.variant.label(),
                    "variant": case.variant.name, "segment": seg, "lead": lead,
                    "call_rows": lead + case.variant.segments[seg] + case.variant.tails[seg], "row": row,
                    "position": case.start + row if cls == "attention" else None, "source": source,
                    "output": name, "element": e, "ulp": None if fmt is None else value_ulps(pv, dv, fmt),
                    "ulp_format": None if fmt is None else str(fmt).replace("torch.", ""), "prompt": pv, "decode": dv}
    raise AssertionError("rows flagged as differing compare equal")  # unreachable: bad came from these tensors


def _ulp_format(out_dtype: torch.dtype, run_dtype: torch.dtype, a: float, b: float) -> torch.dtype | None:
    """Format to count ULPs in: the run's storage dtype when the output is a widened copy of it (lm_head's fp32
    logits of bf16 rows: both values exact in bf16), else the output's own dtype; None for integer outputs."""
    if not out_dtype.is_floating_point:
        return None
    if out_dtype != run_dtype and all(torch.tensor(v).to(run_dtype).item() == v for v in (a, b)):
        return run_dtype
    return out_dtype


def _kw(pool, expert_ids: bool) -> dict:
    """The kernel's keyword arguments for ``pool``: ``expert_id`` (pool.note) for an expert-id-aware set."""
    return {"expert_id": pool.note["expert_id"]} if expert_ids and "expert_id" in pool.note else {}


FLUSH_ROWS = 8192   # compared rows whose mismatch counts are read back to the host together


class _Tally:
    """A pair's row comparisons, counted on the device and read back FLUSH_ROWS rows at a time (one host read per
    batch, not per case, so the host does not wait for the device after every case); ``rows=1`` reads each case
    back at once (stop_at_first). Cases are tallied in the order they ran, so the first mismatch is the same."""

    def __init__(self, res: PairResult, dtype, rows: int = FLUSH_ROWS):
        self.res, self.dtype, self.limit = res, dtype, rows
        self.pending: list = []
        self.rows = 0

    def add(self, case: Case, source: str, site: str, role: str, note: dict, got, ref, bad: torch.Tensor) -> None:
        self.pending.append((case, source, site, role, note, got, ref, bad))
        self.rows += case.M
        if self.rows >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        res = self.res
        counts = torch.stack([p[-1].sum() for p in self.pending]).tolist()
        for (case, source, site, role, note, got, ref, bad), n_bad in zip(self.pending, counts):
            b = res.buckets.setdefault(bucket(case.M), [0, 0])
            b[0] += case.M
            b[1] += n_bad
            res.cases += case.M
            res.mismatches += n_bad
            for s in [res.by_site.setdefault(site, [0, 0])] + ([res.decode_rows] if role == "decode" else []):
                s[0] += case.M
                s[1] += n_bad
            if n_bad and res.first_mismatch is None:
                res.first_mismatch = _locate(case, source, got, ref, bad, res.cls, self.dtype, site)
                res.first_mismatch.update(weights_format=res.weights_format, role=role, **note)
        self.pending.clear()
        self.rows = 0


def _check_case(tally: _Tally, prompt_fn, pool, refs: DecodeRefs, case: Case, source: str, site: str = "",
                role: str = "prompt") -> None:
    dev = pool.rows[0].device
    got = prompt_rows(prompt_fn, pool, case, refs.kw, "ring" if role == "prompt" else "sync")
    ref = refs.get(case.start, case.M)
    bad = torch.zeros(case.M, dtype=torch.bool, device=dev)
    for g, r in zip(got, ref):
        bad |= differing_rows(g, r)
    tally.add(case, source, site, role, pool.note, got, ref, bad)


def _set_of(spec: KernelSpec) -> str:
    for name, ks in KERNEL_SETS.items():
        if ks.prompt.get(spec.cls) is spec:
            return name
    return spec.name.split(".")[0]


def _kv_summary(cases: list[Case]) -> str:
    ts = sorted({c.kv_len for c in cases})
    bs = [b for b in KV_BOUNDARIES if b + 1 in ts]
    return f"{len(ts)} lengths in {ts[0]}-{ts[-1]}, incl. b-1..b+2 for b = {bs[0]},{bs[1]},...,{bs[-1]}"


def check_pair(prompt_spec: KernelSpec, decode_spec: KernelSpec, device: str = "cpu", dtype: str = "bfloat16",
               sweep: str = "full", set_name: str | None = None, sources=SOURCES,
               stop_at_first: bool = False, preset: str = "tiny", offload: bool = False,
               progress=None, weights: str = "bf16", groups=None, expert_ids: bool = False) -> PairResult:
    """Check one pair on every case of ``plan(cls, sweep)``, at every call site of the class (class_sites; with
    ``offload`` the routed experts only: offload does not move the shared expert) and every input source; then
    the decode kernel itself on the cases of ``decode_plan`` (blocks of M > 1 decode rows). Where a site has
    alternatives (contract/alternatives.py: attention's fp8 KV formats; with ``expert_ids`` or ``offload`` every
    routed expert, offloaded through one ring slot) a case of M rows and KV length T takes alternative
    (M + floor(T / 2)) mod their count (T = 0 outside attention: the cases of one M share an expert).

    Args:
        prompt_spec, decode_spec: a prompt kernel and the decode kernel it replaces (same class).
        device: "cpu" / "cuda[:N]"; dtype: "bfloat16" or "float32"; sweep: "full" or "quick".
        set_name: reported set (default: the registered set holding ``prompt_spec``).
        sources: input sources, checked in this order within each case and site.
        stop_at_first: stop after the case holding the first mismatch (cases and mismatches then count only
            the cases run; m_ranges still describes every case of the plan some site is fed).
        preset: model preset whose shapes (and weights) the inputs use.
        offload: fetch the weights per call as expert offload does (contract/alternatives.py: offloaded).
        progress: a tqdm bar advanced by one per case (all its input sources).
        weights: projection weights format (kernels.quant.WEIGHT_FORMATS; quantized ones for QUANT_CLASSES only).
        groups: (n_groups, topk_groups) for the router's grouped site; None = the preset's routing.
        expert_ids: pass each expert kernel call ``expert_id=`` (the routed expert's id, -1 for the shared
            expert), as the forward does for a set whose options name ``expert_id_aware``.
    Raises:
        ValueError: mismatched pair, a class with no input builder, unknown device/dtype/sweep/source, offload
            of a class whose weights offload does not move or of quantized weights, a weights format the class
            does not read, groups that do not fit the preset.
    """
    if prompt_spec.cls != decode_spec.cls or prompt_spec.replaces != decode_spec.name:
        raise ValueError(f"{prompt_spec.name!r} (replaces {prompt_spec.replaces!r}) is not a prompt kernel "
                         f"replacing {decode_spec.name!r}")
    check_sweep(sweep)
    if offload and weights != "bf16":
        raise ValueError(f"offload is checked on bf16 weights only, not weights={weights!r}")
    groups = None if groups is None else (int(groups[0]), int(groups[1]))   # hashable: the pools are cached
    dev, dt = str(resolve_device(device)), resolve_dtype(dtype)
    cls = prompt_spec.cls
    cases, dcases = plan(cls, sweep), decode_plan(cls, sweep)
    sites = class_sites(cls, preset, groups)
    sites = ("routed",) if offload and "routed" in sites else sites
    shown = [c for c in cases if any(fed(c, site, sweep, offload) for site in sites)]   # the sizes some site sees
    res = PairResult(cls, prompt_spec.name, decode_spec.name, set_name or _set_of(prompt_spec), dev, dtype,
                     m_ranges=ranges(c.M for c in shown),
                     kv_lengths=_kv_summary(shown) if cls == "attention" else "",
                     inputs=",".join(sources), preset=preset, weights="offloaded" if offload else "resident",
                     sites=",".join(sites), weights_format=weights,
                     router_groups=list(groups) if groups and "grouped" in sites else None,
                     decode_m=ranges(c.M for c in dcases))
    t0 = time.perf_counter()
    with torch.no_grad():
        keys = [(site, s) for site in sites for s in sources if (site, s) not in RANDOM_ONLY]
        pools = {k: alternatives(cls, k[1], dt, dev, preset, k[0], weights, groups, expert_ids or offload)
                 for k in keys}
        pools = {k: offloaded(p) for k, p in pools.items()} if offload else pools
        refs = {k: [DecodeRefs(decode_spec.fn, p, _kw(p, expert_ids)) for p in ps] for k, ps in pools.items()}
        runs = [(prompt_spec.fn, "prompt", cases), (decode_spec.fn, "decode", dcases)]
        tally = _Tally(res, dt, rows=1 if stop_at_first else FLUSH_ROWS)
        for fn, role, case in ((fn, role, c) for fn, role, cs in runs for c in cs):
            for k in (k for k in keys if fed(case, k[0], sweep, offload)):   # one M (and T): one alternative
                j = (case.M + (case.kv_len or 0) // 2) % len(pools[k])
                _check_case(tally, fn, pools[k][j], refs[k][j], case, k[1], k[0], role)
            if progress is not None and role == "prompt":
                progress.update(1)
            if stop_at_first and res.first_mismatch is not None:
                break
        tally.flush()
    res.seconds = round(time.perf_counter() - t0, 3)
    return res


def selected_pairs(set_name: str, classes=None, offload: bool = False, weights: str = "bf16") -> list:
    """The (prompt spec, decode spec) pairs of ``set_name`` that :func:`check_set` checks per dtype: those of
    ``classes`` (default every class) that have an input builder, with ``offload`` only the OFFLOAD_CLASSES, with
    a quantized ``weights`` format only the QUANT_CLASSES.

    Raises:
        ValueError: an unknown set or class (listing the known ones).
    """
    classes = list(KERNEL_CLASSES if classes is None else classes)
    unknown = [c for c in classes if c not in KERNEL_CLASSES]
    if unknown:
        raise ValueError(f"unknown kernel class(es) {unknown}; known: {', '.join(KERNEL_CLASSES)}")
    return [(p, dec) for p, dec in get_set(set_name).pairs()
            if p.cls in classes and p.cls in ADAPTED and (not offload or p.cls in OFFLOAD_CLASSES)
            and (weights == "bf16" or p.cls in QUANT_CLASSES)]


def check_set(set_name: str, device: str = "cpu", dtypes=("bfloat16", "float32"), sweep: str = "full",
              classes=None, progress=None, preset: str = "tiny", offload: bool = False, weights: str = "bf16",
              groups=None) -> list[PairResult]:
    """Check every pair of kernel set ``set_name`` (or only ``classes``) in each dtype; with ``offload`` only the
    OFFLOAD_CLASSES among them, their weights fetched as expert offload does; with a quantized ``weights`` format
    only the QUANT_CLASSES, fed weights of that format; ``groups`` as for :func:`check_pair`, for the router only
    (the other classes keep the preset's inputs).

    Classes of KERNEL_CLASSES without an input builder are skipped here and reported as uncovered by
    :func:`coverage`. Raises ValueError on an unknown set or class (listing the known ones) or a bad
    device/dtype/sweep.
    """
    ks = get_set(set_name)
    pairs = selected_pairs(set_name, classes, offload, weights)
    check_sweep(sweep)
    for d in dtypes:
        resolve_dtype(d)
    out = []
    for d in dtypes:
        for p, dec in pairs:
            if progress is not None:
                what = (" offloaded" if offload else "") + (f" {weights}" if weights != "bf16" else "")
                progress.set_postfix_str(f"{ks.name} {d} {p.cls}{what}", refresh=False)
            out.append(check_pair(p, dec, device, d, sweep, ks.name, preset=preset, offload=offload,
                                  progress=progress, weights=weights,
                                  groups=groups if p.cls == "router" else None,   # the router's variant
                                  expert_ids=ks.options.expert_id_aware))
    return out


def run_section(params: ContractParams | dict) -> dict:
    """The ``contract`` section from profile/notebook parameters.

    params (ContractParams, or a dict of its fields): kernel_sets (list of set names or package.module:ATTR
    references, kernels.get_set), device, preset (input
    shapes; default "tiny"), dtype (the profile's; checked first), optional
    contract_dtypes (default: the profile's dtype plus the other of bfloat16/float32), contract_sweep ("full" |
    "quick", default "full"), contract_control_sweep (the sweep of sets that claim no exactness, e.g. ``fast``:
    they are the negative control, whose mismatches any sweep shows; default contract_sweep), contract_classes
    (default: every class), contract_offload (default True: the OFFLOAD_CLASSES checked once more with their
    weights fetched as expert offload does, into ``offload_rows``), contract_weights (weights formats, default
    ["bf16"]; each quantized one checks the QUANT_CLASSES once more on weights of that format, rows with
    ``weights_format``), contract_router_groups
    ([n_groups, topk_groups]: the router also checked routing in groups; default the preset's routing); the KV
    formats are all checked whatever ``kv_dtype`` (attention's sites). Returns ``{"section": "contract", "sweep",
    "control_sweep", "preset", "weights_formats", "router_groups", "rows": [PairResult.to_row()...],
    "offload_rows": [...], "coverage": [...], "uncovered": [...]}``. Raises ValueError on an unknown set/device/dtype/sweep/class/weights format.
    """
    p = ContractParams.from_dict(params)
    validate_sets(p)
    sets = [get_set(s).name for s in (p.kernel_sets or list(KERNEL_SETS))]   # references resolved to set names
    device = p.device
    base = p.dtype
    dtypes = list(p.contract_dtypes or [base] + [d for d in ("bfloat16", "float32") if d != base])
    sweep = p.contract_sweep
    control = p.contract_control_sweep or sweep
    check_sweep(sweep)   # the sweeps are defined beside the cases (contract_cases), so checked here
    check_sweep(control)
    for s in sets:
        get_set(s)
    kw = {"preset": p.preset, "classes": p.contract_classes or None}
    if p.contract_router_groups:   # passed only when asked for: the preset's own routing needs no argument
        kw["groups"] = tuple(p.contract_router_groups)
    formats = list(p.contract_weights)
    runs = [(f, o) for f in formats for o in ([False, True] if p.contract_offload and f == "bf16" else [False])]
    sweeps = {s: sweep if get_set(s).claims_exact else control for s in sets}
    total = len(dtypes) * sum(len(plan(pr.cls, sweeps[s])) for s in sets for f, o in runs
                              for pr, _ in selected_pairs(s, kw["classes"], o, f))
    rows, off = [], []
    with progress_bar(total, "contract", "case") as bar, sharing_synthetic_weights(), sharing_host_copies():
        # one draw of the weights for captured and random inputs; one host copy of offloaded pools for every set
        for s in sets:
            for f, o in runs:
                fkw = {"weights": f} if f != "bf16" else {}
                (off if o else rows).extend(r.to_row() for r in check_set(s, device, dtypes, sweeps[s], offload=o,
                                                                          progress=bar, **kw, **fkw))
    cov, unc = coverage(rows, sets, str(resolve_device(device)), dtypes, formats)
    return {"section": "contract", "sweep": sweep, "control_sweep": control, "preset": kw["preset"],
            "weights_formats": formats, "router_groups": list(kw["groups"]) if "groups" in kw else None,
            "rows": rows, "offload_rows": off, "coverage": cov, "uncovered": unc}
