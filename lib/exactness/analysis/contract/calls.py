"""The kernel contract on recorded calls (a source of kernel calls, analysis/calls.py: a dump set of any engine, ours
included): does every prompt-role row carry the bytes of the decode-role row of the same (sequence, position)?

Rows pair by (class, call site, sequence, position): a prompt-role row of class C at site S is compared with the
decode-role row of C at S for the same sequence and position. All outputs the two calls share are compared as bytes
(exact.py; fp8 as its bytes, with its scale: per row when the scale is per row, else whole). For every pair that
differs the checker also asks whether the two rows had byte-equal inputs (the per-row inputs, the same weight names,
and of a ``by_position`` fixed input the entries 0..pos): a mismatch with equal inputs is the kernel's own (its
*origin*); one with differing inputs may be carried in from an earlier call.
The calls are visited in the prompt role's call order (the engine's order), so the first mismatch is the earliest
place where the two roles part.

Output: :func:`contract_of_calls` returns a JSON-ready section-like dict; report.render_calls_md renders it. The
synthetic-case contract of our kernel sets (check.py) is the other source of the same claim.
"""
from __future__ import annotations

from ...dumps.format import comparable
from ...dumps.reader import Call, DumpSet
from ...exact import INT_VIEW, bytes_equal, differing_rows, first_differing_row, ulp_distance
from ...kernels.registry import KERNEL_CLASSES
from ...progress import bar as progress_bar
from ..calls import open_calls
from .cases import ranges

CACHE_CALLS = 256  # decode-role calls whose tensors are kept loaded (a decode call pairs with nearby prompt rows)


class _Loader:
    """Tensors of a call's part, loaded on demand, the most recent CACHE_CALLS calls kept."""

    def __init__(self, ds: DumpSet):
        self.ds, self.cache = ds, {}

    def get(self, call: Call, part: str) -> dict:
        key = (call.id, part)
        if key not in self.cache:
            if len(self.cache) >= CACHE_CALLS:
                self.cache.pop(next(iter(self.cache)))
            self.cache[key] = self.ds.tensors(call, part, scales=part == "outputs")
        return self.cache[key]


def _rows_equal(a, b) -> bool:
    """Whether row tensors a, b [1, ...] hold the same bytes (a dtype or shape difference is a difference)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return not bool(differing_rows(comparable(a), comparable(b)).any())


def _row(t, k: int, n_rows: int):
    """Row k of a per-row tensor [n_rows, ...] as [1, ...]; a tensor not laid out per row (a per-tensor fp8
    scale) whole."""
    return t[k:k + 1] if t.dim() and t.shape[0] == n_rows else t


def _outputs_equal(po: dict, k: int, n_p: int, do: dict, j: int, n_d: int, common: list) -> bool:
    return all(_rows_equal(_row(po[n], k, n_p), _row(do[n], j, n_d)) for n in common)


def _inputs_equal(ld: _Loader, p: Call, k: int, d: Call, j: int, pos: int) -> bool | None:
    """Whether prompt row k of p and decode row j of d had byte-equal inputs; None when they cannot be compared
    (no inputs dumped, or different input names)."""
    if not p.refs["inputs"] or set(p.refs["inputs"]) != set(d.refs["inputs"]) or \
            set(p.refs["fixed"]) != set(d.refs["fixed"]):
        return None
    if p.weights != d.weights:
        return False
    pi, di = ld.get(p, "inputs"), ld.get(d, "inputs")
    if not all(_rows_equal(pi[n][k:k + 1], di[n][j:j + 1]) for n in pi):
        return False
    pf, df = ld.get(p, "fixed"), ld.get(d, "fixed")
    for n, ref in p.refs["fixed"].items():
        a, b = (pf[n][:pos + 1], df[n][:pos + 1]) if ref.get("by_position") else (pf[n], df[n])
        if not bytes_equal(a, b):
            return False
    return True


def _locate(p: Call, k: int, d: Call, j: int, po: dict, do: dict, same_in) -> dict:
    """The first differing output element of a mismatching pair, with its ULP distance."""
    row, seq, pos, tok = p.rows[k]
    rec = {"class": p.cls, "site": p.site, "prompt_kernel": p.kernel, "replaces": p.replaces,
           "decode_kernel": d.kernel, "prompt_call": p.id, "decode_call": d.id, "call_rows": p.call_rows,
           "row": row, "seq": seq, "pos": pos, "token": tok, "inputs_equal": same_in, "output": None,
           "element": None, "ulp": None, "prompt": None, "decode": None}
    for name in (n for n in po if n in do):
        a, b = _row(po[name], k, len(p.rows)).reshape(-1), _row(do[name], j, len(d.rows)).reshape(-1)
        if a.dtype != b.dtype or a.shape != b.shape:
            return {**rec, "output": name, "prompt": f"{a.dtype}{tuple(a.shape)}",
                    "decode": f"{b.dtype}{tuple(b.shape)}"}
        e = first_differing_row(comparable(a), comparable(b))
        if e is not None:
            ulp = int(ulp_distance(a[e], b[e])) if a.dtype in INT_VIEW and a[e] == a[e] and b[e] == b[e] else None
            val = (lambda t: t.float().item()) if a.is_floating_point() else (lambda t: t.item())
            return {**rec, "output": name, "element": e, "ulp": ulp, "prompt": val(a[e]), "decode": val(b[e])}
    return rec   # no output name in common: the pair is counted as differing, with nothing to point at


class _Tally:
    """Counts per class, per site, per kernel pair and per call size, and the first mismatches."""

    def __init__(self):
        self.cls = {}
        for c in KERNEL_CLASSES:
            self.add_class(c)

    def add_class(self, c: str) -> None:
        """A class's counters (this suite's classes first, then an engine's own classes as they appear)."""
        self.cls.setdefault(c, {"class": c, "prompt_rows": 0, "decode_rows": 0, "paired": 0, "mismatches": 0,
                                "origin_mismatches": 0, "unpaired_prompt": 0, "unpaired_decode": 0, "sizes": {},
                                "kernel_pairs": [], "first_mismatch": None})
        self.sites: dict = {}
        self.first = {"first_mismatch": None, "first_origin": None}

    def counters(self, p: Call, d: Call) -> list[dict]:
        """The counters one pair of rows of p and d adds to: class, site, kernel pair; the size bucket is a list."""
        st = self.cls[p.cls]
        site = self.sites.setdefault((p.cls, p.site), {"class": p.cls, "site": p.site, "paired": 0, "mismatches": 0,
                                                       "origin_mismatches": 0, "positions": [],
                                                       "origin_positions": []})
        key = (p.kernel, p.replaces, d.kernel)
        pair = next((q for q in st["kernel_pairs"] if (q["prompt"], q["replaces"], q["decode"]) == key), None)
        if pair is None:
            pair = {"prompt": p.kernel, "replaces": p.replaces, "decode": d.kernel,
                    "claim_names_decode": p.replaces == d.kernel, "paired": 0, "mismatches": 0}
            st["kernel_pairs"].append(pair)
        return [st, site, pair]

    def pair(self, p: Call, d: Call, differ: bool, same_in, pos: int, locate) -> None:
        """Count one compared pair; ``locate()`` builds its mismatch record when one is still wanted."""
        counters = self.counters(p, d)
        size = self.cls[p.cls]["sizes"].setdefault(str(p.call_rows), [0, 0])
        size[0] += 1
        for c in counters:
            c["paired"] += 1
        if not differ:
            return
        size[1] += 1
        for c in counters:
            c["mismatches"] += 1
        counters[0]["origin_mismatches"] += bool(same_in)
        counters[1]["origin_mismatches"] += bool(same_in)
        counters[1]["positions"].append(pos)
        if same_in:
            counters[1]["origin_positions"].append(pos)
        st, f = counters[0], self.first
        if st["first_mismatch"] is None or f["first_mismatch"] is None or (same_in and f["first_origin"] is None):
            loc = locate()
            st["first_mismatch"] = st["first_mismatch"] or loc
            f["first_mismatch"] = f["first_mismatch"] or loc
            if same_in and f["first_origin"] is None:
                f["first_origin"] = loc


def _decode_index(ds: DumpSet) -> dict:
    """(class, site, seq, pos) -> (decode call, row index in its dumped rows)."""
    return {(c.cls, c.site, seq, pos): (c, j) for c in ds.calls if c.role == "decode"
            for j, (_, seq, pos, _) in enumerate(c.rows)}


def _check_call(ld: _Loader, p: Call, index: dict, used: set, tally: _Tally) -> None:
    """Compare every dumped row of prompt call ``p`` with its decode row."""
    po = ld.get(p, "outputs")
    for k, (_, seq, pos, _) in enumerate(p.rows):
        hit = index.get((p.cls, p.site, seq, pos))
        if hit is None:
            tally.cls[p.cls]["unpaired_prompt"] += 1
            continue
        d, j = hit
        used.add((d.id, j))
        do = ld.get(d, "outputs")
        common = [n for n in po if n in do]
        differ = not (common and _outputs_equal(po, k, len(p.rows), do, j, len(d.rows), common))
        same_in = _inputs_equal(ld, p, k, d, j, pos) if differ else True
        tally.pair(p, d, differ, same_in, pos, lambda: _locate(p, k, d, j, po, do, same_in))


def contract_of_calls(source, progress: bool = True) -> dict:
    """Check the kernel contract on the calls of ``source`` (a dump folder or a DumpSet: calls.open_calls; see the
    module docstring).

    Returns:
        {"section": "dump_contract", "folder", "engine", "version", "classes": one entry per class of
        KERNEL_CLASSES (rows dumped per role, paired, mismatches, origin_mismatches (inputs byte-equal),
        unpaired rows, sizes: call rows M -> [paired, mismatching], kernel_pairs: {prompt, replaces, decode,
        claim_names_decode (the prompt kernel's ``replaces`` is the decode kernel it was paired with), paired,
        mismatches}, first_mismatch, status), "sites": per (class, site) paired / mismatching / origin rows and
        the mismatching positions (``positions``; ``origin_positions``: those with byte-equal inputs),
        "first_mismatch" (earliest in prompt call order), "first_origin" (earliest with byte-equal inputs),
        "totals"}. A first-mismatch record names class, site, kernels, call_rows (M), row, seq,
        pos, token, output, element (flat index in the row), ulp (exact.ulp_distance; None for integer or fp8
        outputs), the prompt and decode values, and whether the inputs were equal.
    Raises:
        DumpError: an invalid dump set (dumps.reader.read_dump). TypeError: not a source of kernel calls.
    """
    ds = open_calls(source)
    ld, index, used, tally = _Loader(ds), _decode_index(ds), set(), _Tally()
    for c in ds.calls:
        tally.add_class(c.cls)
        tally.cls[c.cls][f"{c.role}_rows"] += len(c.rows)
    prompt = [c for c in ds.calls if c.role == "prompt"]
    bar = progress_bar(len(prompt), "dump contract", "call") if progress else None
    for p in prompt:
        _check_call(ld, p, index, used, tally)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    for d, j in index.values():
        tally.cls[d.cls]["unpaired_decode"] += (d.id, j) not in used
    classes = list(tally.cls.values())
    for st in classes:
        st["status"] = "not dumped" if not (st["prompt_rows"] or st["decode_rows"]) else \
            "no pairs" if not st["paired"] else "mismatch" if st["mismatches"] else "byte-exact"
    sites = list(tally.sites.values())
    for s in sites:
        s["positions"] = ranges(s["positions"])
        s["origin_positions"] = ranges(s["origin_positions"])
    totals = {k: sum(st[k] for st in classes) for k in ("paired", "mismatches", "origin_mismatches",
                                                         "unpaired_prompt", "unpaired_decode")}
    return {"section": "dump_contract", "folder": ds.folder, "engine": ds.engine, "version": ds.manifest["version"],
            "meta": ds.manifest.get("meta", {}), "classes": classes, "sites": sites, "totals": totals,
            **tally.first}
