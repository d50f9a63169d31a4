"""Views of the ``contract`` section (analysis/contract/check.py) as display blocks (blocks.py: the notebook shows
them, ``render_md`` prints them as GitHub markdown): intro and verdict, the summary, per-class, coverage,
first-mismatch and offload tables, the mismatch heatmap; and the markdown of the contract on recorded calls
(calls.py: render_calls_md)."""
from __future__ import annotations

from tabulate import tabulate

from ...blocks import Block, heading, plot, table, text, to_markdown
from ...kernels import KERNEL_CLASSES
from ...tables import DASH, Table

INTRO = ("Every kernel class has a decode kernel (one row per call: the serial oracle runs on it) and a prompt "
         "kernel that claims to replace it. For each such pair the same rows go through both, the prompt kernel "
         "in blocks of M rows under many segmentations, tile positions and batch mates, and the outputs are "
         "compared as bytes. A pair keeps its contract only when no row differs in any byte; the `invariant` set "
         "claims this for every pair, `fast` claims nothing and is the control.")
_MISMATCH_DASH = ("not applicable: T (KV length) exists only for attention, a ULP distance only for "
                  "floating-point outputs, a site only for classes the forward calls with several operand shapes")

# ------------------------------------------------------------------------------------------------------ helpers

def _md(rows: list[list], headers: list[str]) -> str:
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True, floatfmt=".4g")


def _fmt(r: dict) -> str:
    return r.get("weights_format") or "bf16"


def summary(rows: list[dict]) -> list[dict]:
    """Per (set, device, dtype, weights format): pairs checked, cases, mismatching pairs and rows."""
    out: dict[tuple, dict] = {}
    for r in rows:
        s = out.setdefault((r["set"], r["device"], r["dtype"], _fmt(r)), {"set": r["set"], "device": r["device"],
                           "dtype": r["dtype"], "weights_format": _fmt(r), "pairs": 0, "cases": 0,
                           "mismatching_pairs": 0, "mismatching_rows": 0})
        s["pairs"] += 1
        s["cases"] += r["cases"]
        s["mismatching_pairs"] += bool(r["mismatches"])
        s["mismatching_rows"] += r["mismatches"]
    return [out[k] for k in sorted(out)]


def verdict_md(section) -> str:
    """Markdown, one line per kernel set: pairs without a byte mismatch (offloaded expert pairs included) and the
    rows that differ. Accepts the section dict or its ``rows`` list."""
    rows = section["rows"] if isinstance(section, dict) else list(section)
    rows = rows + (section.get("offload_rows", []) if isinstance(section, dict) else [])
    lines = []
    for ks in dict.fromkeys(r["set"] for r in rows):
        rs = [r for r in rows if r["set"] == ks]
        exact = sum(1 for r in rs if not r["mismatches"])
        lines.append(f"- **{ks}**: {exact} of {len(rs)} pairs byte-exact; {sum(r['mismatches'] for r in rs):,} of "
                     f"{sum(r['cases'] for r in rs):,} rows differ.")
    return "**Verdict.**\n\n" + "\n".join(lines) if lines else "_No pairs were checked._"


# ------------------------------------------------------------------------------------------- notebook tables

def summary_table(rows: list[dict]) -> Table:
    """:func:`summary` as a table: per set, device and dtype, pairs and rows checked, and how many differ."""
    return Table(summary(rows), {"set": "set", "device": "device", "dtype": "dtype", "weights_format": "weights",
                                 "pairs": "pairs checked",
                                 "cases": "rows compared", "mismatching_pairs": "pairs with a mismatch",
                                 "mismatching_rows": "rows that differ"},
                 formats={"cases": ",", "mismatching_rows": ","})


def coverage_table(section: dict) -> Table:
    """Every class and weights format, one row per distinct coverage: rows M, KV lengths T and call sites covered,
    checked / uncovered, and the sets and dtypes it holds for (their rows compared: :func:`class_table`)."""
    groups: dict[tuple, list] = {}
    for c in section["coverage"]:
        key = (c["class"], _fmt(c), *((c.get(k) or "").replace(",", ", ") or None
                                      for k in ("m_ranges", "kv_lengths", "sites")), c["status"])
        groups.setdefault(key, []).append(f"{c['set']} {c['dtype']}")
    order = {c: i for i, c in enumerate(KERNEL_CLASSES)}
    recs = sorted(({"class": k[0], "weights_format": k[1], "m": k[2], "t": k[3], "s": k[4], "status": k[5],
                    "where": ", ".join(w)} for k, w in groups.items()), key=lambda r: order.get(r["class"], len(order)))
    return Table(recs, {"class": "class", "weights_format": "weights", "m": "rows per call M", "t": "KV lengths T",
                        "s": "call sites", "status": "status", "where": "sets and dtypes"},
                 dash="not applicable: only attention reads a KV cache, a class called with one operand shape has no "
                      "named sites, and an uncovered class has no rows")


def mismatch_table(section: dict, offload: bool = True) -> Table:
    """The first mismatch of every pair that has one (checking order: M ascending, then T, then segmentation): M,
    T, segmentation, row, output, element, ULPs and the two values; pairs without a mismatch are counted in a
    note. With ``offload``, the pairs checked with offloaded expert weights are included."""
    rows = section["rows"] + (section.get("offload_rows", []) if offload else [])
    bad = [r for r in rows if r["first_mismatch"]]
    recs = [{**r["first_mismatch"], "set": r["set"], "dtype": r["dtype"], "weights_format": _fmt(r),
             "class": r["class"] + (" (offloaded)" if r.get("weights") == "offloaded" else ""),
             "differ": f"{r['mismatches']:,} of {r['cases']:,}"} for r in bad]
    for rec in recs:
        rec["site"] = rec.get("site") or None
        for k in ("prompt", "decode"):  # 9 significant digits tell fp32 neighbours apart
            rec[k] = None if rec.get(k) is None else format(rec[k], ".9g")
    return Table(recs, {"set": "set", "dtype": "dtype", "weights_format": "weights", "class": "class",
                        "site": "site", "differ": "rows that differ", "M": "M", "kv_len": "T",
                        "segmentation": "segmentation",
                        "call_rows": "call rows", "row": "row", "output": "output",
                        "element": "element", "ulp": "ULPs", "prompt": "prompt kernel", "decode": "decode kernel"},
                 dash=_MISMATCH_DASH,
                 notes=[f"{len(rows) - len(bad)} of {len(rows)} pairs have no mismatch and are not listed."])


def offload_table(section: dict) -> Table:
    """The expert pairs checked with offloaded weights: rows that differ of rows compared."""
    recs = [{**r, "differ": f"{r['mismatches']:,} of {r['cases']:,}"} for r in section.get("offload_rows", [])]
    return Table(recs, {"set": "set", "dtype": "dtype", "class": "class", "differ": "rows that differ"})


# ------------------------------------------------------------------------------------------- notebook views

def plot_heatmap(section: dict, set_name: str = "fast"):
    """Heatmap per dtype: share of mismatching rows, class (y) x M bucket (x), for ``set_name``; returns the figure.

    Raises:
        ValueError: the section holds no rows of ``set_name``.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    from .cases import BUCKETS, bucket

    rows = [r for r in section["rows"] if r["set"] == set_name and _fmt(r) == "bf16"]   # one cell per class
    if not rows:
        have = sorted({r["set"] for r in section["rows"]})
        raise ValueError(f"no contract rows for set {set_name!r}; sets here: {have}")
    dtypes = sorted({r["dtype"] for r in rows})
    cols = [bucket(a) for a, _ in BUCKETS]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 4.2), squeeze=False)
    for ax, d in zip(axes[0], dtypes):
        share = np.full((len(KERNEL_CLASSES), len(cols)), np.nan)
        for r in (r for r in rows if r["dtype"] == d):
            for b, (n, bad) in r["buckets"].items():
                if b in cols and n:
                    share[KERNEL_CLASSES.index(r["class"]), cols.index(b)] = bad / n
        im = ax.imshow(share, vmin=0, vmax=1, cmap="magma_r", aspect="auto")
        ax.set(title=f"{set_name}, {d}: share of rows differing", xlabel="rows M", xticks=range(len(cols)),
               yticks=range(len(KERNEL_CLASSES)))
        ax.set_xticklabels(cols, rotation=45, ha="right")
        ax.set_yticklabels(KERNEL_CLASSES)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    return fig


# ------------------------------------------------------------------------------------------------- the view

ROWS_CHOSEN = ("Each row goes alone through the decode kernel, and in blocks of M rows (1–130, 255–257, 511–513, "
               "1024, 4097) through the prompt kernel, under many segmentations (split points anywhere), at different "
               "positions inside a 64-row tile and beside different batch mates; attention additionally at many KV "
               "lengths, including lengths just past every 256-key block boundary. Outputs are compared as bytes "
               "(bf16 as int16, fp32 as int32, indices exactly). Inputs are seeded random rows and rows captured from "
               "a forward over a real prompt.")


def _sweep_md(sec: dict) -> str:
    sweep = sec.get("sweep", "?")
    control = sec.get("control_sweep", sweep)
    return (f"Sweep `{sweep}`" + (f" (sets that claim no exactness: `{control}`)" if control != sweep else "")
            + f", shapes of preset `{sec.get('preset', 'tiny')}`; a case is one row compared (all its outputs); inputs "
            "random and captured (tapped from a forward over a real prompt).")


def class_table(rows: list[dict]) -> Table:
    """Mismatching rows / rows checked per kernel class (one row each) and (set, dtype) column, bf16 weights;
    a pair not checked shows ``uncovered``."""
    rows = [r for r in rows if _fmt(r) == "bf16"]
    cols = [f"{s} {d}" for s, d in sorted({(r["set"], r["dtype"]) for r in rows})]
    cell = {(r["class"], f"{r['set']} {r['dtype']}"): f"{r['mismatches']}/{r['cases']}" for r in rows}
    recs = [{"class": c, **{k: cell.get((c, k), "uncovered") for k in cols}} for c in KERNEL_CLASSES]
    return Table(recs, {"class": "class", **{k: k for k in cols}})


def _by_site_md(rows: list[dict]) -> str:
    parts = [f"{r['class']} ({r['set']} {r['dtype']}): " + ", ".join(f"{k} {n[1]}/{n[0]}"
                                                                    for k, n in r["by_site"].items())
             for r in rows if _fmt(r) == "bf16" and r["mismatches"] and len(r.get("by_site") or {}) > 1]
    return ("Mismatching rows / rows checked per call site, for pairs with a mismatch: " + "; ".join(parts)
            if parts else "")


def quant_table(rows: list[dict]) -> Table:
    """The pairs checked on quantized weights: mismatching rows / rows checked per call site and in all."""
    recs = [{"set": r["set"], "dtype": r["dtype"], "weights": _fmt(r), "class": r["class"], "sites": r["sites"] or None,
             "per site": ", ".join(f"{k or DASH} {n[1]}/{n[0]}" for k, n in r["by_site"].items()),
             "all sites": f"{r['mismatches']}/{r['cases']}"} for r in rows if _fmt(r) != "bf16"]
    return Table(recs, {k: k for k in ("set", "dtype", "weights", "class", "sites", "per site", "all sites")},
                 dash="no named sites: the forward calls the class with one operand shape")


def _uncovered_md(unc: list[dict]) -> str:
    groups: dict[tuple, list] = {}
    for u in unc:
        fmt = "" if _fmt(u) == "bf16" else f" {_fmt(u)}"
        groups.setdefault((u["class"], u["reason"]), []).append(f"{u['set']} {u['dtype']}{fmt}")
    return "Uncovered: " + "; ".join(f"{c} ({', '.join(w)}: {why})" for (c, why), w in groups.items()) if unc else ""


def _mismatch_blocks(sec: dict) -> list[Block]:
    pairs = sec["rows"] + sec.get("offload_rows", [])
    if not pairs:
        return []
    if not any(r["first_mismatch"] for r in pairs):
        return [heading("First mismatch of each pair", 3), text(f"_No mismatch: all {len(pairs)} pairs are byte-exact._")]
    return [heading("First mismatch of each pair", 3),
            text("In checking order (M ascending, then KV length T, then segmentation): the row within the block, "
                 "the output (router: weights / idx / logits), the element (flat index within the row), its distance "
                 "in ULPs of the storage format, and the two values. A segmentation lists the prompt calls' segment "
                 "lengths joined by +; `lead a tail b` gives the other rows placed before and after the tested rows "
                 "in each call; site: the forward's call site whose operand shapes were fed; call rows: rows in the "
                 "prompt call holding the row, mates included."),
            table(mismatch_table(sec))]


def _offload_blocks(sec: dict) -> list[Block]:
    out = [heading("Expert weights offloaded", 3)]
    if not sec.get("offload_rows"):
        return out + [text("_Not checked in this run (contract_offload is off)._")]
    return out + [text("The expert pairs once more with their weights fetched the way expert offload fetches them: "
                       "through the expert ring (behind a decoy staged in the same slot) for every prompt call, by a "
                       "synchronous host-to-device copy for every decode reference."), table(offload_table(sec))]


def _heatmap_blocks(sec: dict) -> list[Block]:
    out = [heading("Where the fast set's rows differ", 3)]
    if not any(r["set"] == "fast" and _fmt(r) == "bf16" for r in sec["rows"]):
        return out + [text("_The fast set was not checked in this run._")]
    return out + [plot(lambda: plot_heatmap(sec, "fast"), "share of the fast set's rows whose bytes differ from the "
                       "decode kernel's, per class and M bucket; blank: no rows of that bucket")]


def blocks(section) -> list[Block]:
    """The section's view (blocks.py; accepts the section dict or its ``rows`` list): intro, verdict and sweep,
    summary per set, mismatches per class, quantized weights, coverage, first mismatches, offloaded experts, the
    fast set's heatmap, how the rows were chosen."""
    sec = section if isinstance(section, dict) else {"rows": list(section), "preset": "?"}
    rows = sec["rows"]
    out = [heading("Kernel contract: prompt-kernel rows vs decode-kernel rows, compared as bytes"),
           text(INTRO, verdict_md(sec), _sweep_md(sec))]
    if rows:
        out += [heading("Summary per set", 3),
                text("A pair *mismatches* when at least one of its rows differs from the decode kernel's row in at "
                     "least one byte."), table(summary_table(rows)),
                heading("Mismatches per class", 3),
                text("Mismatching rows / rows checked, per class and (set, dtype), bf16 weights (uncovered: not "
                     "checked)."), table(class_table(rows)), text(_by_site_md(rows))]
    if any(_fmt(r) != "bf16" for r in rows):
        out += [heading("Quantized weights", 3),
                text("The site's weight quantized (kernels/quant.py), or tapped from a forward on quantized weights: "
                     "mismatching rows / rows checked per call site."), table(quant_table(rows))]
    if sec.get("coverage"):
        out += [heading("Coverage", 3),
                text("Every kernel class appears, with the sets and dtypes of each coverage; a class the checker did "
                     "not check is listed as *uncovered*."), table(coverage_table(sec))]
    out += [text(_uncovered_md(sec.get("uncovered", [])))]
    out += _mismatch_blocks(sec) + _offload_blocks(sec) + _heatmap_blocks(sec)
    return out + [heading("How the rows were chosen", 3), text(ROWS_CHOSEN)]


def render_md(section) -> str:
    """receipt.md's block of the section: its :func:`blocks` as markdown."""
    return to_markdown(blocks(section)) + "\n"


# ------------------------------------------------------------------------------------------- recorded calls

CALLS_INTRO = ("Each kernel call of the engine was dumped with its role: `prompt` (many prompt rows per call) or "
               "`decode` (the serial path, one row per stream per step). Every prompt-role row is paired with the "
               "decode-role row of the same class, call site, sequence and position, and their outputs are compared "
               "as bytes. A mismatch whose two rows had byte-equal inputs is the kernel's own (*origin*); others may "
               "be carried in from an earlier call.")


def _v(x) -> str:
    if x is None:
        return DASH
    return format(x, ".9g") if isinstance(x, float) else str(x)


def _first(title: str, f: dict | None) -> list[str]:
    if not f:
        return [f"{title}: none."]
    hdr = ["class", "site", "prompt kernel", "replaces", "decode kernel", "M", "row", "seq", "pos", "token",
           "output", "element", "ULP", "prompt", "decode", "inputs equal"]
    keys = ["class", "site", "prompt_kernel", "replaces", "decode_kernel", "call_rows", "row", "seq", "pos",
            "token", "output", "element", "ulp", "prompt", "decode", "inputs_equal"]
    return [f"{title}:", "", _md([[_v(f.get(k)) for k in keys]], hdr)]


def calls_verdict_md(obj: dict) -> str:
    """One line: rows paired, rows that differ, of them with byte-equal inputs; the first class that parts."""
    t = obj["totals"]
    line = (f"**Verdict.** {t['mismatches']:,} of {t['paired']:,} paired rows differ in at least one output byte; "
            f"{t['origin_mismatches']:,} of them had byte-equal inputs.")
    f, o = obj.get("first_mismatch"), obj.get("first_origin")
    if f:
        line += f" The roles first differ at class `{f['class']}`" + (f", site `{f['site']}`" if f.get("site") else "")
        line += f" (M = {f.get('call_rows')}, position {f.get('pos')})."
    if o and o is not f and o != f:
        line += f" The first mismatch with equal inputs is at `{o['class']}`" + \
            (f", site `{o['site']}`" if o.get("site") else "") + "."
    return line


def render_calls_md(obj: dict) -> str:
    """Markdown of a recorded-calls contract (calls.contract_of_calls): intro, verdict, coverage per class,
    mismatching/paired rows per class and call size M, the first mismatch and the first with equal inputs, and the
    sites that differ."""
    eng = obj["engine"]
    out = [f"## Dump contract: {eng['name']}" + (f" ({eng['build']})" if eng.get("build") else "")
           + ", prompt-role rows vs decode-role rows, compared as bytes", "", CALLS_INTRO, "", calls_verdict_md(obj),
           ""]
    cls_rows = [[c["class"], c["prompt_rows"], c["decode_rows"], c["paired"], c["mismatches"],
                 c["origin_mismatches"], c["unpaired_prompt"], c["unpaired_decode"], c["status"]]
                for c in obj["classes"]]
    out += [_md(cls_rows, ["class", "prompt rows", "decode rows", "paired", "differ", "differ, equal inputs",
                           "unpaired prompt", "unpaired decode", "status"]), ""]
    sizes = sorted({int(m) for c in obj["classes"] for m in c["sizes"]})
    if sizes:
        body = [[c["class"]] + [("/".join(map(str, c["sizes"][str(m)][::-1])) if str(m) in c["sizes"] else DASH)
                                for m in sizes] for c in obj["classes"] if c["sizes"]]
        out += ["Differing / paired rows per class and prompt call size M:", "",
                _md(body, ["class"] + [f"M={m}" for m in sizes]), ""]
    pairs = [[c["class"], q["prompt"], q["replaces"], q["decode"], "yes" if q["claim_names_decode"] else "NO",
              f"{q['mismatches']}/{q['paired']}"] for c in obj["classes"] for q in c["kernel_pairs"]]
    if pairs:
        out += ["Kernel pairs (a prompt kernel, the decode kernel it claims to replace, the decode kernel its rows "
                "were paired with):", "",
                _md(pairs, ["class", "prompt kernel", "replaces", "decode kernel", "claim names it",
                            "differ / paired"]), ""]
    out += _first("First mismatch (prompt call order)", obj.get("first_mismatch")) + [""]
    out += _first("First mismatch with byte-equal inputs", obj.get("first_origin")) + [""]
    bad = [s for s in obj["sites"] if s["mismatches"]]
    if bad:
        out += ["Sites with differing rows:", "",
                _md([[s["class"], _v(s["site"]), f"{s['mismatches']}/{s['paired']}", s["origin_mismatches"],
                      s["positions"], s.get("origin_positions") or DASH] for s in bad],
                    ["class", "site", "differ / paired", "equal inputs", "positions", "positions, equal inputs"]), ""]
    out.append(f"_{DASH} : not applicable (no site, no float ULP order, or no such call size)._")
    return "\n".join(out)
