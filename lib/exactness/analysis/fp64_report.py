"""Markdown tables and plots of the ``fp64`` section (analysis/fp64.py computes it).

``render_md`` gives two GitHub tables: captured activations, one line per (class, path, kernel set); synthetic
input sets, one line per (class, input set, dtype, K, kernel set) with the paths side by side. Plots (matplotlib,
for notebooks/30_fp64_per_class.ipynb): ULP histograms per class and path, eta against the reduction length K with
the gamma_K line (log-log), and max error per layer.
"""
from __future__ import annotations

from tabulate import tabulate

PATH_ABBR = {"decode": "d", "batched": "b", "deep": "D"}
GEMM_CLASSES = ("dense", "router", "expert_down", "lm_head")
VERDICT_ABBR = {"exact": "=", "within bound": "ok", "outside bound": "OUT", "uncertified": "UNCERT"}


def _g(v, fmt: str = ".3g") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return format(v, fmt)
    return str(v)


def _table(rows, headers) -> str:
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True, floatfmt=".3g")


def _flips(rs) -> str:
    if all(r.get("flips") is None for r in rs):
        return "–"
    margin = min(r["min_margin"] for r in rs if r.get("min_margin") is not None)
    return _paths(str(r["flips"]) for r in rs) + f" ({_g(margin)})"


def _paths(vals) -> str:
    """Per-path values joined with '/', or one value when all paths agree."""
    vals = list(vals)
    return vals[0] if vals and all(v == vals[0] for v in vals) else "/".join(vals)


def _grouped(rows, keys) -> dict:
    groups: dict = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), {})[r["path"]] = r
    return {k: [v[p] for p in ("decode", "batched", "deep") if p in v] for k, v in groups.items()}


def _eq(rs) -> tuple[str, str]:
    rest = [r for r in rs if r["bitwise_equal_share"] is not None]
    if not rest:
        return "–", "–"
    return (_paths(f"{100 * r['bitwise_equal_share']:.1f}" for r in rest),
            _paths(str(r["max_ulp_vs_decode"]) for r in rest))


def _verdicts(rs) -> str:
    return "/".join(VERDICT_ABBR.get(r["verdict"], r["verdict"]) for r in rs)


def _cert(rs) -> str:
    return _g(max(r["ref_cert_ulps"] for r in rs), ".2g") + ("" if all(r["ref_certified"] for r in rs) else " FAIL")


def _captured(rows) -> str:
    heads = ["class", "set", "K", "cert ulps", "η max u", "η p99 u (d)", "pre/γ_K", "pre/β", "bias u (d)",
             "κ med/max (d)", "ULP 0%/1%/max (d)", "RMSE (d)", "=dec % (b/D)", "max ULP vs d (b/D)",
             "flips vs fp64 (min margin)", "verdict"]
    body = []
    for (cls, ks, K), rs in _grouped(rows, ("class", "set", "K")).items():
        d = rs[0]
        eq, mx = _eq(rs)
        body.append([cls, ks, K, _cert(rs), _paths(_g(r["eta_max_u"]) for r in rs), _g(d["eta_p99_u"]),
                     _g(max(r["eta_over_gamma"] for r in rs)), _paths(_g(r["bound_use"]) for r in rs),
                     _g(d["bias_u"]), f"{_g(d['kappa_median'])}/{_g(d['kappa_max'])}",
                     f"{d['ulp0_pct']:.1f}/{d['ulp1_pct']:.1f}/{d['ulp_max']}", _g(d["rmse"]), eq, mx, _flips(rs),
                     _verdicts(rs)])
    return _table(body, heads)


def _synthetic(rows) -> str:
    heads = ["class", "input", "dtype", "K", "cert ulps", "η max u fast", "η max u inv.", "pre/γ_K max",
             "pre/β max", "bias u (d)", "ULP 0% (d)", "=dec % fast (b/D)", "verdict fast", "verdict inv."]
    body = []
    for (cls, iset, dt, K), rs in _by_case(rows).items():
        by = {ks: [r for r in rs if r["set"] == ks] for ks in ("fast", "invariant")}
        f, i = by["fast"], by["invariant"]
        body.append([cls, iset, dt, K, _cert(rs), _paths(_g(r["eta_max_u"]) for r in f) or "–",
                     _paths(_g(r["eta_max_u"]) for r in i) or "–", _g(max(r["eta_over_gamma"] for r in rs)),
                     _g(max(r["bound_use"] for r in rs)), _g(rs[0]["bias_u"]), f"{rs[0]['ulp0_pct']:.1f}",
                     _eq(f)[0] if f else "–", _verdicts(f) or "–", _verdicts(i) or "–"])
    return _table(body, heads)


def _by_case(rows) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault((r["class"], r["input_set"], r["dtype"], r["K"]), []).append(r)
    order = {"decode": 0, "batched": 1, "deep": 2}
    return {k: sorted(v, key=lambda r: (r["set"], order[r["path"]])) for k, v in out.items()}


def _notes(section) -> list[str]:
    rows = section.get("rows", [])
    notes = []
    bad = [r for r in rows if r["verdict"] in ("outside bound", "uncertified")]
    for cls in sorted({r["class"] for r in bad}):
        rs = [r for r in bad if r["class"] == cls]
        where = sorted({f"{r['set']}/{r['path']}/{r['input_set']}" for r in rs})
        line = f"- **{cls}** outside bound or uncertified in {len(rs)} rows ({', '.join(where[:6])}" + \
            (", ..." if len(where) > 6 else "") + ")."
        if cls == "attention" and all(r.get("bound_use_p_stored") is not None for r in rs):
            worst = max(r["bound_use_p_stored"] for r in rs)
            line += (f" Charging one storage rounding (u_s) of each unnormalised softmax weight, the same rows use "
                     f"at most {worst:.3g} of the bound: consistent with the kernel storing the softmax weights in "
                     f"the storage dtype before the P·V product, a rounding the class's fp32-softmax semantics "
                     f"(kernels/attention.py) do not include.")
        elif cls in GEMM_CLASSES:
            worst = max(r["eta_over_gamma"] for r in rs)
            line += (f" pre/γ_K reaches {worst:.3g}: no fp32 round-to-nearest accumulation, in any order, gives "
                     f"these outputs; part of the sum was rounded more coarsely (for example a split-K reduction "
                     f"in the storage dtype, or an accumulator that truncates).")
        notes.append(line)
    return notes


def render_md(section: dict) -> str:
    """GitHub markdown for the ``fp64`` section (``{"section": "fp64", "rows": [...], "meta": {...}}``, or the
    receipt's list of rows). Raises ValueError when there are no rows."""
    rows = section if isinstance(section, list) else section.get("rows", [])
    meta = {} if isinstance(section, list) else section.get("meta", {})
    if not rows:
        raise ValueError("fp64 section has no rows")
    cap = [r for r in rows if r["input_set"] == "captured"]
    syn = [r for r in rows if r["input_set"] != "captured"]
    out = ["### FP64 per-class accumulation receipt", ""]
    if meta:
        out.append(f"Captured: prompt `{meta.get('prompt')}`, {meta.get('tokens')} tokens, step "
                   f"{meta.get('step')}, {meta.get('positions')} sampled positions per class; "
                   f"{meta.get('cert_per_row')} outputs certified per row (fail above "
                   f"{_g(meta.get('cert_max_ulps'))} fp64 ulps of the normaliser).")
    out.append("η in units of u_acc = 2^-24; pre = error before the final rounding to the stored dtype; "
               "β = class bound (fp64_ref.py); verdict: exact (bytes = decode) / within bound (pre ≤ β) / "
               "outside bound. pre/γ_K ≤ 1 is Higham's accumulation bound for the GEMM classes; composite "
               "classes (gate_up, combine, attention, rmsnorm, rope) also carry their intermediate roundings.")
    out.append("Paths are listed decode/batched/deep (d/b/D); verdict: `=` exact, `ok` within bound, `OUT` outside "
               "bound, `UNCERT` reference not certified.")
    if cap:
        out += ["", "#### Captured activations", "", _captured(cap)]
    if syn:
        out += ["", "#### Synthetic input sets (one kernel call per row = d, whole block = b, 64-row tiles = D)",
                "", _synthetic(syn)]
    notes = _notes({"rows": rows})
    if notes:
        out += ["", "#### Rows outside bound", ""] + notes
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------------- plots

def plot_ulp_hist(section: dict, input_set: str = "captured"):
    """One panel per class: ULP-vs-RN(y) histograms (share of outputs per bin) for each path and kernel set."""
    import matplotlib.pyplot as plt
    import numpy as np

    edges = section["meta"]["hist_edges"]
    labels = [f"{a}" if b - a == 1 else f"{a}-{b - 1}" for a, b in zip(edges, edges[1:])] + [f"{edges[-1]}+"]
    hists = {k: v for k, v in section["hist"].items() if k.split("|")[3] == input_set}
    classes = sorted({k.split("|")[0] for k in hists})
    fig, axes = plt.subplots((len(classes) + 2) // 3, 3, figsize=(15, 3.2 * ((len(classes) + 2) // 3)),
                             squeeze=False)
    for ax, cls in zip(axes.flat, classes):
        series = [(k, v) for k, v in hists.items() if k.split("|")[0] == cls]
        w = 0.8 / max(len(series), 1)
        for i, (k, v) in enumerate(series):
            tot = max(sum(v), 1)
            ax.bar(np.arange(len(v)) + i * w, [c / tot for c in v], w, label="/".join(k.split("|")[1:3]))
        ax.set_xticks(np.arange(len(labels)) + 0.4, labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(cls, fontsize=9)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(classes):]:
        ax.axis("off")
    fig.suptitle(f"ULPs from RN(y) in the stored dtype ({input_set})")
    fig.tight_layout()
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
    fig, axes = plt.subplots((len(classes) + 4) // 5, 5, figsize=(16, 3 * ((len(classes) + 4) // 5)),
                             squeeze=False)
    for ax, cls in zip(axes.flat, classes):
        for key in sorted({(p["path"], p["set"]) for p in pl if p["class"] == cls}):
            ps = sorted((p for p in pl if p["class"] == cls and (p["path"], p["set"]) == key),
                        key=lambda p: p["layer"])
            ax.plot([p["layer"] for p in ps], [p["eta_max_u"] for p in ps], marker="o", label="/".join(key))
        ax.set_title(cls, fontsize=9)
        ax.set_xlabel("layer (-1 = head)", fontsize=7)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(classes):]:
        ax.axis("off")
    fig.suptitle("max η per layer (units of u_acc)")
    fig.tight_layout()
    return fig
