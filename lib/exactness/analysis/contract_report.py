"""Rendering of the ``contract`` section (analysis/contract.py): the receipt's markdown and the notebook's views
(coverage and first-mismatch frames, the mismatch heatmap). Re-exported by contract.py."""
from __future__ import annotations

from tabulate import tabulate

from ..kernels import KERNEL_CLASSES

# ------------------------------------------------------------------------------------------------------- render

def _md(rows: list[list], headers: list[str]) -> str:
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True, floatfmt=".4g")


def summary(rows: list[dict]) -> list[dict]:
    """Per (set, device, dtype): pairs checked, cases, mismatching pairs and rows."""
    out: dict[tuple, dict] = {}
    for r in rows:
        s = out.setdefault((r["set"], r["device"], r["dtype"]), {"set": r["set"], "device": r["device"],
                           "dtype": r["dtype"], "pairs": 0, "cases": 0, "mismatching_pairs": 0,
                           "mismatching_rows": 0})
        s["pairs"] += 1
        s["cases"] += r["cases"]
        s["mismatching_pairs"] += bool(r["mismatches"])
        s["mismatching_rows"] += r["mismatches"]
    return [out[k] for k in sorted(out)]


def render_md(section) -> str:
    """Markdown: coverage summary per set, a class x (set, dtype) matrix of mismatching/checked rows, uncovered
    classes, and the first mismatch of every mismatching pair. Accepts the section dict or its ``rows`` list."""
    rows = section["rows"] if isinstance(section, dict) else list(section)
    unc = section.get("uncovered", []) if isinstance(section, dict) else []
    sweep = section.get("sweep", "?") if isinstance(section, dict) else "?"
    control = section.get("control_sweep", sweep) if isinstance(section, dict) else sweep
    preset = section.get("preset", "tiny") if isinstance(section, dict) else "?"
    out = ["## Kernel contract: prompt-kernel rows vs decode-kernel rows, compared as bytes", "",
           f"Sweep `{sweep}`" + (f" (sets that claim no exactness: `{control}`)" if control != sweep else "")
           + f", shapes of preset `{preset}`; a case is one row compared (all its outputs); inputs "
           f"random and captured (tapped from a forward over a real prompt).", "",
           _md([[s["set"], s["device"], s["dtype"], s["pairs"], s["cases"], s["mismatching_pairs"],
                 s["mismatching_rows"]] for s in summary(rows)],
               ["set", "device", "dtype", "pairs checked", "cases", "mismatching pairs", "mismatching rows"])]
    cols = sorted({(r["set"], r["dtype"]) for r in rows})
    cell = {(r["class"], r["set"], r["dtype"]): f"{r['mismatches']}/{r['cases']}" for r in rows}
    out += ["", "Mismatching rows / rows checked, per class (uncovered: not checked):", "",
            _md([[c] + [cell.get((c, s, d), "uncovered") for s, d in cols] for c in KERNEL_CLASSES],
                ["class"] + [f"{s} {d}" for s, d in cols])]
    if unc:
        groups: dict[tuple, list] = {}
        for u in unc:
            groups.setdefault((u["class"], u["reason"]), []).append(f"{u['set']} {u['dtype']}")
        out += ["", "Uncovered: " + "; ".join(f"{c} ({', '.join(w)}: {why})" for (c, why), w in groups.items())]
    off = section.get("offload_rows", []) if isinstance(section, dict) else []
    if off:
        out += ["", "Expert weights offloaded (each prompt call takes them from the expert ring, staged behind a decoy "
                "in the same slot; each decode reference from a synchronous copy out of host memory):", "",
                _md([[r["set"], r["dtype"], r["class"], f"{r['mismatches']}/{r['cases']}"] for r in off],
                    ["set", "dtype", "class", "mismatching rows / rows checked"])]
    bad = [r for r in rows + off if r["first_mismatch"]]
    if bad:
        hdr = ["set", "dtype", "class", "M", "T", "segmentation", "row", "output", "element", "ULP", "prompt",
               "decode"]
        body = []
        for r in bad:
            f = r["first_mismatch"]
            cls = r["class"] + (" (offloaded)" if r.get("weights") == "offloaded" else "")
            body.append([r["set"], r["dtype"], cls, f["M"], f.get("kv_len") or "–", f["segmentation"],
                         f["row"], f["output"], f["element"], "–" if f["ulp"] is None else f["ulp"],
                         format(f["prompt"], ".9g"), format(f["decode"], ".9g")])
        out += ["", "First mismatch per pair (checking order: M ascending, then T, then segmentation; a "
                "segmentation lists the prompt calls' segment lengths joined by +, and `lead a tail b` the other rows "
                "placed before and after the tested rows in each call):", "",
                _md(body, hdr)]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- notebook views

def coverage_frame(section: dict):
    """pandas DataFrame of the coverage table (class x set x dtype x device: kernels, M ranges, cases, status)."""
    import pandas as pd

    return pd.DataFrame(section["coverage"])


def mismatch_frame(section: dict):
    """pandas DataFrame, one row per pair: set, dtype, class, cases, mismatches and the first mismatch's fields."""
    import pandas as pd

    keep = ("M", "kv_len", "segmentation", "row", "source", "output", "element", "ulp", "prompt", "decode")
    rows = []
    for r in section["rows"]:
        fm = r["first_mismatch"] or {}
        vals = {k: fm.get(k) for k in keep}
        for k in ("prompt", "decode"):   # 9 significant digits tell fp32 neighbours apart
            vals[k] = None if vals[k] is None else format(vals[k], ".9g")
        rows.append({"set": r["set"], "device": r["device"], "dtype": r["dtype"], "class": r["class"],
                     "cases": r["cases"], "mismatches": r["mismatches"], **vals})
    df = pd.DataFrame(rows)
    for k in ("M", "kv_len", "row", "element", "ulp"):
        df[k] = df[k].astype("Int64")     # nullable ints: pairs without a mismatch show <NA>, not NaN floats
    return df


def plot_heatmap(section: dict, set_name: str = "fast"):
    """Heatmap per dtype: share of mismatching rows, class (y) x M bucket (x), for ``set_name``; returns the figure.

    Raises:
        ValueError: the section holds no rows of ``set_name``.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    from .contract_cases import BUCKETS, bucket

    rows = [r for r in section["rows"] if r["set"] == set_name]
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
