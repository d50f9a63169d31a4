"""Views of the ``fp64`` section (analysis/fp64/section.py computes it) as display blocks (blocks.py: the notebook
shows them, ``render_md`` prints them as GitHub markdown): intro and verdict; two tables cut to the columns a reviewer
needs (every statistic stays in receipt.json): captured activations, one line per (class, kernel set, K) with the
paths side by side, and synthetic input sets, one line per (class, input set, dtype, K) with the kernel sets side by
side; plots (matplotlib): ULP histograms per class, eta against K with the gamma_K line (log-log), max error per
layer. ``render_calls_md``: the FP64 of recorded calls (calls.py).
"""
from __future__ import annotations

from tabulate import tabulate

from ...blocks import Block, heading, plot, table, text, to_markdown
from ...kernels.registry import ClassNames
from ...tables import DASH, Table, md_escape

GEMM_CLASSES = ClassNames(lambda r: r.gemm)   # one dot product per output element: bound γ_K
VERDICT_WORD = {"exact": "exact", "within bound": "within", "outside bound": "OUTSIDE", "uncertified": "UNCERTIFIED"}
INTRO = ("For every kernel class, path and kernel set, sampled outputs are compared with an FP64 reference computed "
         "from the exact inputs the kernel saw; the reference is itself certified against exact arithmetic. A row is "
         "*exact* only when its bytes equal the decode path's; otherwise it is *within bound* when its error before "
         "the final rounding stays inside the class's worst-case bound β, and *outside bound* when it does not "
         "(arithmetic that no fp32 accumulation order explains).")
LEGEND = ("**Symbols.** u = 2⁻²⁴, the unit roundoff of fp32 accumulation. η = |ŷ − y| / A: the error of the stored "
          "output ŷ against the exact value y, relative to the output's scale A (Σ|x·w| for a product), in units "
          "of u. *pre*: the smallest error ŷ can have had before its final rounding to the stored dtype; β: the "
          "class's bound on it, so *pre/β* ≤ 1 is within bound. γ_K = K·u / (1 − K·u): the worst-case error of any "
          "fp32 sum of K terms (Higham). κ = A / |y|: the condition number (large κ: cancellation). K: the "
          "reduction length. Verdicts are listed per path, decode / batched / deep (one word when all agree).")
_DASH = ("not applicable: no flips for classes that make no top-k or argmax choice, no byte comparison for the "
         "decode path (it is the reference), no row of that kernel set")


def _g(v, fmt: str = ".3g") -> str:
    return "–" if v is None else format(v, fmt) if isinstance(v, float) else str(v)


def _flips(rs) -> str | None:
    if all(r.get("flips") is None for r in rs):
        return None
    margin = min(r["min_margin"] for r in rs if r.get("min_margin") is not None)
    return _paths(str(r["flips"]) for r in rs) + f" ({_g(margin)})"


def _paths(vals) -> str:
    """Per-path values joined with ' / ', or one value when all paths agree."""
    vals = list(vals)
    return vals[0] if vals and all(v == vals[0] for v in vals) else " / ".join(vals)


def _grouped(rows, keys) -> dict:
    groups: dict = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), {})[r["path"]] = r
    return {k: [v[p] for p in ("decode", "batched", "deep") if p in v] for k, v in groups.items()}


def _eq(rs) -> str | None:
    """Share of sampled outputs whose bytes equal decode's, per non-decode path (percent)."""
    rest = [r for r in rs if r["bitwise_equal_share"] is not None]
    return _paths(f"{100 * r['bitwise_equal_share']:.1f}" for r in rest) if rest else None


def _verdicts(rs) -> str | None:
    return _paths(VERDICT_WORD.get(r["verdict"], r["verdict"]) for r in rs) if rs else None


def _uncertified(rs) -> str:
    return "" if all(r["ref_certified"] for r in rs) else " (reference NOT certified)"


def _label(r: dict) -> str:
    """The class with its quantized formats named: ``dense (nvfp4 weights)``, an attention row judged over an fp8
    cache ``attention (fp8_e4m3_block KV cache)``; the class alone for bf16 weights and KV cache."""
    fmts = [f"{r['weights']} weights"] if r.get("weights", "bf16") != "bf16" else []
    fmts += [f"{r['kv_dtype']} KV cache"] if r.get("kv_dtype", "bf16") != "bf16" else []
    return f"{r['class']} ({', '.join(fmts)})" if fmts else r["class"]


def _labelled(rows: list[dict]) -> list[dict]:
    """Rows with their quantized formats named in the class label (_label), so that the tables keep rows of
    different weights or KV formats on separate lines."""
    return [r if _label(r) == r["class"] else {**r, "class": _label(r)} for r in rows]


def captured_table(rows: list[dict]) -> Table:
    """Captured activations: one line per (class, weights, kernel set, K), the paths decode / batched / deep side
    by side: verdict, the largest share of the bound used (pre/β), the largest η (units of u), the share of outputs
    whose bytes equal decode's, and top-k / argmax flips against the FP64 choice (with the smallest margin)."""
    rows = _labelled(rows)
    recs = [{"class": cls + _uncertified(rs), "set": ks, "K": K, "verdict": _verdicts(rs),
             "bound": max(r["bound_use"] for r in rs), "eta": max(r["eta_max_u"] for r in rs), "eq": _eq(rs),
             "flips": _flips(rs)} for (cls, ks, K), rs in _grouped(rows, ("class", "set", "K")).items()]
    return Table(recs, {"class": "class", "set": "kernel set", "K": "K", "verdict": "verdict (decode / batched / deep)",
                        "bound": "bound used, max (pre/β)", "eta": "largest η (u)",
                        "eq": "bytes equal to decode, batched / deep (%)",
                        "flips": "choices flipped vs FP64 (smallest margin)"},
                 formats={"bound": ".3g", "eta": ".3g"}, dash=_DASH)


def synthetic_table(rows: list[dict]) -> Table:
    """Synthetic input sets: one line per (class, input set, dtype, K), the kernel sets side by side: verdicts per
    path, the largest share of the bound used, and the fast set's share of outputs equal to decode; quantized
    weights on lines of their own."""
    rows = _labelled(rows)
    recs = []
    for (cls, iset, dt, K), rs in _by_case(rows).items():
        f, i = ([r for r in rs if r["set"] == ks] for ks in ("fast", "invariant"))
        recs.append({"class": cls + _uncertified(rs), "input": iset, "dtype": dt, "K": K, "vf": _verdicts(f),
                     "vi": _verdicts(i), "bound": max(r["bound_use"] for r in rs), "eq": _eq(f)})
    return Table(recs, {"class": "class", "input": "input set", "dtype": "dtype", "K": "K",
                        "vf": "verdict fast (decode / batched / deep)", "vi": "verdict invariant",
                        "bound": "bound used, max (pre/β)", "eq": "fast: bytes equal to decode, batched / deep (%)"},
                 formats={"bound": ".3g"}, dash=_DASH)


def judged_md(rows: list[dict]) -> str | None:
    """One line naming the prompt positions the captured rows were judged at (the extra ones, e.g. rows the kernel
    contract flagged, named apart); None when no captured row records them."""
    cap = [r["sampled"] for r in rows if r.get("input_set") == "captured" and "position_list" in (r.get("sampled")
                                                                                                   or {})]
    if not cap:
        return None
    pos = sorted({p for s in cap for p in s["position_list"]})
    extra = sorted({p for s in cap for p in s.get("extra_positions") or []})
    return (f"Captured rows are judged at prompt positions {', '.join(map(str, pos))} only ({len(pos)} positions"
            + (f"; extra positions asked for: {', '.join(map(str, extra))}" if extra else "")
            + "): `exact` says those rows' bytes equal decode's, nothing about the others.")


def verdict_md(rows: list[dict]) -> str:
    """Markdown, one line per kernel set: how many rows are exact, within bound, outside bound, uncertified; then
    the prompt positions the captured rows were judged at (judged_md)."""
    lines = []
    for ks in dict.fromkeys(r["set"] for r in rows):
        rs = [r for r in rows if r["set"] == ks]
        counts = {v: sum(1 for r in rs if r["verdict"] == v) for v in VERDICT_WORD}
        lines.append(f"- **{ks}**: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n) + f" (of {len(rs)} rows).")
    judged = judged_md(rows)
    lines += [f"- {judged}"] if judged else []
    return "**Verdict.**\n\n" + "\n".join(lines) if lines else "_No rows._"


def meta_md(meta: dict) -> str:
    """One line: which prompt the activations were captured from, how many positions and outputs were sampled, and
    the KV format when it is not bf16."""
    kv = meta.get("kv_dtype", "bf16")
    return (f"Captured from prompt {md_escape(str(meta.get('prompt')))}, {meta.get('tokens')} tokens, prefill step "
            f"{meta.get('step')}: {meta.get('positions')} sampled positions per class; {meta.get('cert_per_row')} "
            f"outputs per row certified against exact arithmetic (failing above {_g(meta.get('cert_max_ulps'))} FP64 "
            f"ulps of the normaliser)."
            + (f" KV cache: {kv} (attention judged on the values it stores)." if kv != "bf16" else ""))


def _by_case(rows) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault((r["class"], r["input_set"], r["dtype"], r["K"]), []).append(r)
    order = {"decode": 0, "batched": 1, "deep": 2}
    return {k: sorted(v, key=lambda r: (r["set"], order[r["path"]])) for k, v in out.items()}


def _attention_note(rs: list[dict]) -> str:
    """What attention rows outside bound say: the bound with stored softmax weights; over an fp8 KV cache, which
    values the reference read."""
    note = ""
    if all(r.get("bound_use_p_stored") is not None for r in rs):
        worst = max(r["bound_use_p_stored"] for r in rs)
        note += (f" Charging one storage rounding (u_s) of each unnormalised softmax weight, the same rows use "
                 f"at most {worst:.3g} of the bound: consistent with the kernel storing the softmax weights in "
                 f"the storage dtype before the P·V product, a rounding the class's fp32-softmax semantics "
                 f"(kernels/attention.py) do not include.")
    if any(r.get("kv_dtype", "bf16") != "bf16" for r in rs):
        note += (" Over an fp8 KV cache the reference reads the cache's dequantized fp32 values (code·scale): a "
                 "kernel that reads them rounded to the storage dtype shows that rounding here too.")
    return note


def notes_md(section) -> list[str]:
    """One markdown line per class (and weights or KV format) with rows outside bound or uncertified: where, and
    what the excess says about the kernel."""
    rows = section.get("rows", [])
    notes = []
    bad = [r for r in rows if r["verdict"] in ("outside bound", "uncertified")]
    for label in sorted({r["class"] for r in _labelled(bad)}):
        rs = [r for r, lr in zip(bad, _labelled(bad)) if lr["class"] == label]
        cls, quantized = rs[0]["class"], rs[0].get("weights", "bf16") != "bf16"
        where = sorted({f"{r['set']}/{r['path']}/{r['input_set']}" for r in rs})
        line = f"- **{label}** outside bound or uncertified in {len(rs)} rows ({', '.join(where[:6])}" + \
            (", ..." if len(where) > 6 else "") + ")."
        if cls == "attention":
            line += _attention_note(rs)
        elif cls in GEMM_CLASSES:
            worst = max(r["eta_over_gamma"] for r in rs)
            line += (f" pre/γ_K reaches {worst:.3g}: no fp32 round-to-nearest accumulation, in any order, gives "
                     f"these outputs; part of the sum was rounded more coarsely (for example a split-K reduction "
                     f"in the storage dtype, or an accumulator that truncates)"
                     + (", or the dequantized weights were rounded to the storage dtype before the GEMM (the "
                        "fast set's recipe on quantized weights, kernels/quant.py)." if quantized else "."))
        notes.append(line)
    return notes


CAPTURED = ("One line per class, kernel set and reduction length K, the paths decode / batched / deep side by side. "
            "The statistics left out here (η percentiles, bias, κ, RMSE, ULP distances, certification margins) are "
            "in receipt.json.")
SYNTHETIC = ("Decode: one kernel call per row; batched: the whole block in one call; deep: 64-row tiles. The kernel "
             "sets side by side.")
ULP_HIST = ("ULPs from the correctly rounded exact value RN(y) in the stored dtype, per class, for each path and "
            "kernel set (log scale: share of sampled outputs).")
ETA_VS_K = ("Filled: largest error before the final rounding (η_pre); hollow: largest total error. The dashed line is "
            "γ_K = K·u/(1 − K·u), the worst-case bound of any fp32 summation order; a GEMM point above it is outside "
            "the bound. bf16 outputs usually hide the accumulation (η_pre = 0, drawn at 1e-13); the float32 sweep "
            "shows it.")


def certified_md(rows: list[dict]) -> str:
    """One line: how many rows have a certified reference (an uncertified one fails the receipt)."""
    bad = sum(1 for r in rows if not r["ref_certified"])
    return (f"All {len(rows)} rows have a certified reference." if not bad else
            f"**{bad} of {len(rows)} rows have an uncertified reference: the receipt fails.**")


def _table_blocks(rows: list[dict]) -> list[Block]:
    cap = [r for r in rows if r["input_set"] == "captured"]
    syn = [r for r in rows if r["input_set"] != "captured"]
    notes = notes_md({"rows": rows})
    out = [heading("Captured activations", 3), text(CAPTURED), table(captured_table(cap))] if cap else []
    out += [heading("Synthetic input sets", 3), text(SYNTHETIC),
            table(synthetic_table(syn)) if syn else text("_No synthetic input sets in this run._")]
    return out + [heading("Rows outside bound", 3), text("\n".join(notes) or "_No row is outside its bound._")]


def _plot_blocks(section) -> list[Block]:
    """The plots the section's data holds (none for the receipt's list of rows)."""
    if isinstance(section, list):
        return []
    sets = {key.split("|")[3] for key in section.get("hist", {})}
    out = [heading("ULP histograms", 3), text(ULP_HIST)] if sets & {"captured", "outliers"} else []
    out += [plot(lambda: plot_ulp_hist(section, "captured"), "ULP histograms per class, captured activations")
            ] if "captured" in sets else []
    out += [plot(lambda: plot_ulp_hist(section, "outliers"), "ULP histograms per class, outlier inputs")
            ] if "outliers" in sets else []
    if any(p["class"] in GEMM_CLASSES for p in section.get("by_k", [])):
        out += [heading("η against the reduction length K", 3), text(ETA_VS_K),
                plot(lambda: plot_eta_vs_k(section), "η against K with the γ_K line, GEMM classes, log-log")]
    if section.get("per_layer"):
        out += [heading("Max error per layer (captured activations)", 3),
                plot(lambda: plot_per_layer(section), "max η per layer, per class, path and kernel set")]
    return out


def blocks(section) -> list[Block]:
    """The section's view (blocks.py; ``{"section": "fp64", "rows": [...], "meta": {...}, ...}`` or the receipt's
    list of rows): intro, verdict, symbols, the two tables, the rows outside bound, the plots and the
    certification gate.

    Raises:
        ValueError: there are no rows."""
    rows = section if isinstance(section, list) else section.get("rows", [])
    if not rows:
        raise ValueError("fp64 section has no rows")
    meta = {} if isinstance(section, list) else section.get("meta", {})
    return ([heading("FP64 per class: how far each kernel's arithmetic is from exact"),
             text(INTRO, verdict_md(rows), LEGEND, meta_md(meta) if meta else "")]
            + _table_blocks(rows) + _plot_blocks(section)
            + [heading("Certification gate", 3),
               text("A reference that failed its certification fails the receipt (the rows above are kept, marked "
                    "`uncertified`). " + certified_md(rows))])


def render_md(section) -> str:
    """receipt.md's block of the section: its :func:`blocks` as markdown.

    Raises:
        ValueError: there are no rows."""
    return to_markdown(blocks(section)) + "\n"


def render_calls_md(obj: dict) -> str:
    """Markdown of an FP64 of recorded calls (calls.fp64_of_calls): one row per class (errors, bound use, worst
    element) and the skipped classes with their reasons."""
    hdr = ["class", "rows", "elements", "eta max (u)", "bound use", "over bound", "ULP max vs RN", "worst at"]
    body = [[r["class"], r["rows"], r["elements"], f"{r['eta_max_u']:.4g}", f"{r['bound_use']:.3g}",
             r["over_bound"], r["ulp_max"], f"call {r['worst']['call']} ({r['worst']['role']} {r['worst']['site']}, "
             f"pos {r['worst']['pos']}, element {r['worst']['element']})"] for r in obj["rows"]]
    out = [f"## Dump FP64 errors: {obj['engine']['name']}", "",
           "Per class, the dumped outputs against an FP64 reference on the call's own inputs (analysis/fp64/ref.py): "
           "eta = |yhat - y| / A in units of u = 2^-24; bound use = the smallest pre-rounding error over the class "
           "bound (<= 1: within bound; the bound models this suite's documented kernel semantics).", "",
           tabulate(body, headers=hdr, tablefmt="github", disable_numparse=True)]
    if obj["skipped"]:
        out += ["", "Not evaluated: " + "; ".join(f"{s['class']} ({s['reason']})" for s in obj["skipped"])]
    return "\n".join(out) if obj["rows"] or obj["skipped"] else f"_{DASH} no class with an FP64 evaluator._"


# ---------------------------------------------------------------------------------------------------- plots

def _hist_series(section: dict, input_set: str) -> dict[str, dict[tuple, list[int]]]:
    """class -> {(path, kernel set): ULP-bin counts summed over K and dtype} for one input set."""
    out: dict[str, dict[tuple, list[int]]] = {}
    for key, counts in section["hist"].items():
        cls, path, ks, iset = key.split("|")[:4]
        if iset != input_set:
            continue
        acc = out.setdefault(cls, {}).setdefault((path, ks), [0] * len(counts))
        for b, n in enumerate(counts):
            acc[b] += n
    return out


def plot_ulp_hist(section: dict, input_set: str = "captured"):
    """One panel per class: the share of sampled outputs per ULP bin (distance from RN(y) in the stored dtype; K
    and dtypes pooled), one bar series per path and kernel set, with one legend for the figure above the panels."""
    import matplotlib.pyplot as plt
    import numpy as np

    edges = section["meta"]["hist_edges"]
    labels = [f"{a}" if b - a == 1 else f"{a}-{b - 1}" for a, b in zip(edges, edges[1:])] + [f"{edges[-1]}+"]
    series = _hist_series(section, input_set)
    classes = sorted(series)
    order = {"decode": 0, "batched": 1, "deep": 2}
    keys = sorted({k for cls in classes for k in series[cls]}, key=lambda k: (k[1], order.get(k[0], 9), k[0]))
    nrows = max((len(classes) + 2) // 3, 1)
    fig, axes = plt.subplots(nrows, 3, figsize=(12, 2.6 * nrows + 0.8), squeeze=False, layout="constrained")
    handles = {}
    w = 0.8 / max(len(keys), 1)
    for ax, cls in zip(axes.flat, classes):
        for i, k in enumerate(keys):
            v = series[cls].get(k)
            if v is None:
                continue
            tot = max(sum(v), 1)
            handles[k] = ax.bar(np.arange(len(v)) + i * w, [c / tot for c in v], w, color=f"C{i}")
        ax.set_xticks(np.arange(len(labels)) + 0.4, labels, fontsize=7)
        ax.set_yscale("log")
        ax.tick_params(axis="y", labelsize=7)
        ax.set_title(cls, fontsize=9)
    for ax in list(axes.flat)[len(classes):]:
        ax.axis("off")
    fig.legend([handles[k] for k in keys if k in handles], [f"{p} / {ks}" for p, ks in keys if (p, ks) in handles],
               loc="outside upper center", ncol=min(len(keys), 6), fontsize=8, title_fontsize=9,
               title=f"ULPs from RN(y) in the stored dtype, {input_set} inputs (share of sampled outputs, log scale); "
                     "path / kernel set:")
    return fig


def plot_eta_vs_k(section: dict, classes=GEMM_CLASSES):
    """log-log, GEMM classes: max eta before the final rounding (filled) and max total eta (hollow) against K, per
    dtype and input set, with gamma_K = K·u/(1-K·u) (the pass line) and sqrt(K)·u (informational)."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 5.5))
    pts = [p for p in section["by_k"] if p["class"] in classes]
    for key in sorted({(p["dtype"], p["input_set"]) for p in pts}):
        ps = [p for p in pts if (p["dtype"], p["input_set"]) == key]
        k = np.array([p["K"] for p in ps], dtype=float)
        sc = ax.scatter(k, [max(p["pre_max"], 1e-13) for p in ps], s=16, label=f"{key[0]} {key[1]}: before storage")
        ax.scatter(k, [max(p["eta_max"], 1e-13) for p in ps], s=16, facecolors="none",
                   edgecolors=sc.get_facecolor()[0])
    ks = np.logspace(0, np.log10(max([p["K"] for p in pts] + [2]) * 2), 50)
    ax.plot(ks, ks * 2.0 ** -24 / (1 - ks * 2.0 ** -24), "k--", label="γ_K (fp32 accumulation bound)")
    ax.plot(ks, np.sqrt(ks) * 2.0 ** -24, "k:", label="√K·u (probabilistic, for information)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("reduction length K")
    ax.set_ylabel("η = |ŷ − y| / Σ|x·w|  (0 drawn at 1e-13)")
    ax.set_title(f"GEMM classes ({', '.join(classes)}); hollow: total error incl. storage rounding", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def plot_per_layer(section: dict):
    """Max eta (units of u_acc) per layer for each class, one line per path and kernel set (captured set)."""
    import matplotlib.pyplot as plt

    pl = section["per_layer"]
    classes = sorted({p["class"] for p in pl})
    order = {"decode": 0, "batched": 1, "deep": 2}
    keys = sorted({(p["path"], p["set"]) for p in pl}, key=lambda k: (k[1], order.get(k[0], 9), k[0]))
    nrows = max((len(classes) + 4) // 5, 1)
    fig, axes = plt.subplots(nrows, 5, figsize=(14, 2.6 * nrows + 0.8), squeeze=False, layout="constrained")
    # Paths that agree draw on top of each other: hollow markers shrinking from decode to deep keep each visible.
    size = {"decode": 8, "batched": 5.5, "deep": 3}
    handles = {}
    for ax, cls in zip(axes.flat, classes):
        for i, key in enumerate(keys):
            ps = sorted((p for p in pl if p["class"] == cls and (p["path"], p["set"]) == key),
                        key=lambda p: p["layer"])
            if ps:
                handles[key], = ax.plot([p["layer"] for p in ps], [p["eta_max_u"] for p in ps], marker="o",
                                        ms=size.get(key[0], 4), mfc="none", mew=1.2, lw=1,
                                        ls="-" if key[1] == "fast" else "--", color=f"C{i}")
        ax.set_title(cls, fontsize=9)
        ax.set_xlabel("layer (-1 = head)", fontsize=7)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(classes):]:
        ax.axis("off")
    fig.legend([handles[k] for k in keys if k in handles], [" / ".join(k) for k in keys if k in handles],
               loc="outside upper center", ncol=min(len(keys), 6), fontsize=8, title_fontsize=9,
               title="max η per layer (units of u); path / kernel set:")
    return fig
