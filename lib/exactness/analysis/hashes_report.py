"""Views of the ``hashes`` section (analysis/hashes.py computes it): the intro and verdict, its tables
(tables.Table), the plot of prompt-logit differences, and the display blocks the notebook and receipt.md both show
(:func:`blocks`; a section run on engines: engines_md.py).
"""
from __future__ import annotations

import textwrap
from collections import Counter

import numpy as np

from ..blocks import Block, heading, plot, table, text, to_markdown
from ..tables import Table, md_escape, render_extra

INTRO = ("Each prompt runs through every path (batched and deep prefill at each step size, and with offloaded "
         "experts where asked) and is compared with the serial-decode oracle of the same kernel set: the generated "
         "tokens by hash, every prompt row's logits and the KV cache byte for byte. A run equals the oracle only "
         "when the bytes are identical, never within a tolerance; the `invariant` set claims this for every path, "
         "`fast` claims nothing and is shown for contrast.")
_EQUAL = ("equal", "differs")


def _col(path: str, step, offload: bool = False) -> str:
    return (path if step is None else f"{path}@{step}") + ("+offload" if offload else "")


def _runs(rows: list[dict]) -> list[dict]:
    """The runs compared with an oracle: every row but the resident decode run (the oracle itself)."""
    return [r for r in rows if not (r["path"] == "decode" and not r.get("offload"))]


def differs_in(r: dict) -> list[str]:
    """What of a run differs from its oracle: "tokens", "prompt logits", "KV" (a quantity not recorded is not
    listed)."""
    out = [] if r.get("equals_oracle", True) else ["tokens"]
    out += [] if r.get("prompt_logits_equal", True) is not False else ["prompt logits"]
    return out + ([] if r.get("kv_equal", True) is not False else ["KV"])


def first_difference(r: dict) -> str | None:
    """``token i / prompt row j / KV position p (layer l)`` for the parts that differ; None when nothing does.
    The KV position and layer come from ``kv_first_position`` and ``kv_first_layer`` when the row records them."""
    parts = []
    if r.get("first_divergence") is not None:
        parts.append(f"token {r['first_divergence']}")
    if r.get("first_differing_prompt_row") is not None:
        parts.append(f"prompt row {r['first_differing_prompt_row']}")
    if r.get("kv_equal") is False:
        pos, layer = r.get("kv_first_position"), r.get("kv_first_layer")
        parts.append("KV" + ("" if pos is None else f" position {pos}") + ("" if layer is None else f" layer {layer}")
                     + ("" if pos is not None or layer is not None else " (position not recorded)"))
    return " / ".join(parts) or None


def _of(rows, pred) -> str:
    return f"{sum(1 for r in rows if pred(r))} of {len(rows)}"


def verdict_md(rows: list[dict]) -> str:
    """Markdown, one line per kernel set: runs with the oracle's tokens, and with its prompt-logit and KV bytes."""
    runs = _runs(rows)
    out = []
    for ks in dict.fromkeys(r["kernels"] for r in runs):
        rs = [r for r in runs if r["kernels"] == ks]
        out.append(f"- **{ks}**: {_of(rs, lambda r: r['equals_oracle'])} runs give the oracle's tokens; "
                   f"{_of(rs, lambda r: r.get('prompt_logits_equal') and r.get('kv_equal'))} also its prompt-logit "
                   f"and KV-cache bytes.")
    return "**Verdict.**\n\n" + "\n".join(out) if out else "_No runs besides the oracles._"


def prompts_table(rows: list[dict]) -> Table:
    """The prompts: tokens, the first 12 hex digits of their text's SHA-256 and whether it matches the pin."""
    first = rows[0]["kernels"] if rows else None
    recs = [r for r in rows if r["path"] == "decode" and not r.get("offload") and r["kernels"] == first]
    return Table([{**r, "sha": (r.get("prompt_sha256") or "")[:12] or None} for r in recs],
                 {"prompt": "prompt", "prompt_tokens": "tokens", "sha": "text SHA-256 (first 12 hex)",
                  "prompt_pin_ok": "text as pinned"}, words={"prompt_pin_ok": ("yes", "MISMATCH")},
                 dash="not recorded")


def control_groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows of the control runs (those with a ``control`` label: step sweep, fp32 control, engine features) by
    (control, prompt, kernel set), in run order."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("control"):
            out.setdefault((r["control"], r["prompt"], r["kernels"]), []).append(r)
    return out


def control_table(rows: list[dict]) -> Table:
    """One row per control run group (control, prompt, kernel set): its runs against that group's own decode oracle
    (tokens; tokens and every prompt-logit and KV byte) and the first run that differs, with its first difference."""
    recs = []
    for (ctrl, prompt, ks), grp in control_groups(rows).items():
        runs = [r for r in grp if r["path"] != "decode"]
        bad = next((r for r in runs if differs_in(r) or not r["equals_oracle"]), None)
        recs.append({"control": ctrl, "prompt": prompt, "kernels": ks,
                     "runs": ", ".join(_col(r["path"], r["step"]) for r in runs),
                     "tokens": _of(runs, lambda r: r["equals_oracle"]),
                     "bytes": _of(runs, lambda r: r["equals_oracle"] and not differs_in(r)),
                     "first": f"{_col(bad['path'], bad['step'])}: {first_difference(bad) or 'tokens'}" if bad else None})
    return Table(recs, {"control": "control run", "prompt": "prompt", "kernels": "kernel set", "runs": "runs",
                        "tokens": "runs with the oracle's tokens", "bytes": "runs with the oracle's tokens and bytes",
                        "first": "first run that differs: first difference"},
                 dash="every run equals its oracle",
                 notes=["Each control group has its own decode oracle (same prompt, weights, cache and kernel set)."])


def hash_table(rows: list[dict]) -> Table:
    """The hash matrix as a receipt table: one row per prompt, kernel set and expert placement (resident or
    offloaded), one column per path@step; a cell is the token hash, ``≠`` where it differs from the oracle. Control
    runs have their own table (control_table)."""
    rows = [r for r in rows if not r.get("control")]
    grid: dict[tuple, dict] = {}
    cols: list[str] = []
    offload = any(r.get("offload") for r in rows)
    for r in rows:
        key = (r["prompt"], r["kernels"], bool(r.get("offload")))
        g = grid.setdefault(key, {"prompt": r["prompt"], "tokens": r["prompt_tokens"], "kernels": r["kernels"],
                                  "experts": "offloaded" if r.get("offload") else "resident"})
        col = _col(r["path"], r["step"])
        cols += [col] if col not in cols else []
        g[col] = r["hash"] + ("" if r["equals_oracle"] else " ≠")
    head = {"prompt": "prompt", "tokens": "prompt tokens", "kernels": "kernel set"}
    head.update({"experts": "experts"} if offload else {})
    return Table(list(grid.values()), {**head, **{c: c for c in cols}},
                 dash="path not repeated with offloaded experts (hash_offload_paths)",
                 notes=["Hash: first 12 hex digits of SHA-256 over the generated token ids (int32, little-endian); "
                        "`decode` is the oracle; ≠: the tokens differ from it."])


def _served(served: dict) -> str:
    return ", ".join(f"{k}: {v['rows']} rows" + (f" in {v['segments']} segment{'s' * (v['segments'] != 1)}"
                                                 if "segments" in v else "")
                     for k, v in served.items() if v.get("rows"))


def differ_table(rows: list[dict]) -> Table:
    """The runs that differ from their oracle in tokens, prompt-logit bytes or KV bytes (a run that keeps the
    oracle's tokens but not its bytes included): what differs, the first difference, the oracle's top-1/top-2 margin
    at the first differing token and the rows each plan served."""
    recs = [{**r, "run": _col(r["path"], r["step"], r.get("offload", False)),
             "what": ", ".join(differs_in(r) or ["tokens"]), "first_text": first_difference(r),
             "rows_differing": None if r.get("prompt_rows_differing") is None
             else f"{r['prompt_rows_differing']} of {r.get('prompt_tokens')}",
             "served_text": _served(r.get("served") or {})} for r in _runs(rows)
            if differs_in(r) or not r.get("equals_oracle", True)]
    return Table(recs, {"prompt": "prompt", "kernels": "kernel set", "run": "run", "what": "differs in",
                        "first_text": "first difference: token / prompt row / KV position (layer)",
                        "oracle_margin": "oracle margin (logit)", "rows_differing": "prompt rows with differing logits",
                        "max_prompt_logit_diff": "max |Δlogit|", "served_text": "served"},
                 formats={"max_prompt_logit_diff": ".3g"},
                 dash="not recorded (or no token differs: no margin)")


def graphs_summary(rows: list[dict]) -> str | None:
    """How the runs' decode steps ran (the rows' ``graphs``): ``replayed in n of m runs`` (from CUDA graphs) and, per
    reason, the runs no graph served; None when no run tried graphs (hash_graphs off, a CPU device)."""
    tried = [r["graphs"] for r in rows if r.get("graphs")]
    if not tried:
        return None
    why = Counter(g.get("reason") or "no step to replay" for g in tried if not g.get("served"))
    prompt = Counter(g["prompt"] for g in tried if g.get("served") and g.get("prompt", "replayed") != "replayed")
    return (f"replayed in {len(tried) - sum(why.values())} of {len(tried)} runs"
            + "".join(f"; not in {n}: {reason}" for reason, n in why.items())
            + "".join(f"; oracle prompt rows {text} ({n} runs)" for text, n in prompt.items()))


def summary_table(rows: list[dict]) -> Table:
    """Per kernel set: runs compared, how many equal the oracle in tokens, prompt-logit bytes and KV bytes,
    (when the section has it) whether the rerun control repeated the set's first batched run identically, and
    (when runs tried them) how many of the set's runs, its oracle included, replayed from CUDA graphs."""
    runs = _runs(rows)
    recs = []
    for ks in dict.fromkeys(r["kernels"] for r in runs):
        rs = [r for r in runs if r["kernels"] == ks]
        rerun = [r["rerun_equal"] for r in rs if "rerun_equal" in r]
        recs.append({"set": ks, "runs": len(rs), "tok": _of(rs, lambda r: r["equals_oracle"]),
                     "logits": _of(rs, lambda r: r.get("prompt_logits_equal")),
                     "kv": _of(rs, lambda r: r.get("kv_equal")), "rerun": all(rerun) if rerun else None,
                     "graphs": graphs_summary([r for r in rows if r["kernels"] == ks])})
    cols = {"set": "kernel set", "runs": "runs (oracle excluded)", "tok": "tokens equal",
            "logits": "prompt-logit bytes equal", "kv": "KV-cache bytes equal"}
    if any("rerun_equal" in r for r in rows):
        cols["rerun"] = "rerun identical (run-to-run deterministic)"
    if graphs_summary(rows):
        cols["graphs"] = "CUDA graphs (decode steps, the oracle's prompt rows included)"
    return Table(recs, cols, words={"rerun": ("yes", "NO")}, dash="no rerun control for this set")


# ------------------------------------------------------------------------------------------------------ lines

def graphs_line(rows: list[dict]) -> str:
    """One line: per kernel set, how its runs' decode steps (the oracle's prompt rows too) ran with CUDA graphs, and
    why a graph did not serve; "" when no run tried graphs."""
    sets: dict = {}
    for r in rows:
        sets.setdefault(r.get("kernels"), []).append(r)
    parts = [f"{ks}: {text}" for ks, rs in sets.items() if (text := graphs_summary(rs))]
    return "CUDA graphs (decode steps, the oracle's prompt rows included): " + " | ".join(parts) if parts else ""


def deep_unserved_line(rows: list[dict]) -> str:
    """A warning naming the deep runs whose deep plan served no row (every segment under the threshold), or ""."""
    idle = [f"{md_escape(str(r.get('prompt')))} {r.get('kernels')} {_col(r['path'], r['step'], r.get('offload'))}"
            for r in rows if r.get("path") == "deep" and isinstance(r.get("served"), dict)
            and not (r["served"].get("deep") or {}).get("rows")]
    if not idle:
        return ""
    return (f"⚠ deep path served nothing in {len(idle)} deep run(s) (every segment shorter than deep_threshold: "
            f"they ran the batched plan): " + "; ".join(idle[:12]) + (" ..." if len(idle) > 12 else ""))


def rerun_line(rows: list[dict]) -> str:
    """The rerun control in one line (each set's first batched run repeated identically), or ""."""
    reruns = [r for r in rows if "rerun_equal" in r]
    if not reruns:
        return ""
    return ("Rerun control (each set's first batched run repeated identically; tokens and every prompt-logit byte "
            "compared): " + "; ".join(f"{md_escape(str(r.get('prompt')))} {r.get('kernels')} "
                                      f"{'identical' if r['rerun_equal'] else 'NOT identical'}" for r in reruns)
            + ". A set whose reruns differ is not run-to-run deterministic: its other differences (offload "
              "included) cannot be told from noise.")


# ------------------------------------------------------------------------------------------------------ view

def blocks(section: dict) -> list[Block]:
    """The section's view (blocks.py): the engines' (engines_md.blocks) where it ran on engines; else our engine's
    verdict, summary, prompts, hash matrix, the runs that differ, the control runs, the reruns and CUDA graphs, and
    the plot of prompt-logit differences."""
    if isinstance(section.get("engines"), list):
        from .engines_md import blocks as engine_blocks
        return engine_blocks(section)
    rows = section.get("rows") or []
    if not rows:
        return [heading("Token hashes"), text("_No hash rows._")]
    differ, controls = differ_table(rows), control_table(rows)
    return [heading("Token hashes"), text(INTRO, verdict_md(rows)), table(summary_table(rows)),
            table(prompts_table(rows)), heading("Hash matrix", 3),
            text("One row per prompt, kernel set and expert placement, one column per path and step size."),
            table(hash_table(rows)), heading("Runs that differ from the oracle", 3),
            text("Tokens, prompt-logit bytes or KV-cache bytes: a run that keeps the oracle's tokens but not its "
                 "bytes is listed too. Where the tokens differ, the oracle's top-1/top-2 logit margin there (a small "
                 "margin is a near-tie that a rounding difference can flip)."),
            table(differ) if differ.rows else text("_Every run equals its oracle._"),
            *([heading("Control runs", 3), text("A step sweep at tile and block boundaries, an fp32 control and the "
                                                "engine features, each on a cut prompt against its own decode "
                                                "oracle."), table(controls)] if controls.rows else []),
            text(rerun_line(rows), graphs_line(rows), deep_unserved_line(rows)),
            plot(lambda: plot_curves(section), "per prompt, the largest |logit − oracle logit| per bin of prompt "
                 "positions (log scale), one panel per distinct curve"),
            text(f"_Every run's row ({len(rows)}: timings, plans served, byte verdicts) is in receipt.json._",
                 render_extra("hashes_extra", {k: v for k, v in section.items() if k not in ("section", "rows")}))]


def render_md(section: dict) -> str:
    """receipt.md's block of a ``hashes`` section object: its :func:`blocks` as markdown."""
    return to_markdown(blocks(section))


# ------------------------------------------------------------------------------------------------------- plot

def _describe(runs: list[tuple], every: dict[str, int]) -> list[str]:
    """Short names for runs (kernels, path@step, offloaded): a set all of whose ``every[set]`` runs are listed is
    "set: all N runs"; a run listed resident and offloaded is named once with "(resident and offloaded)"."""
    out = []
    for ks in dict.fromkeys(r[0] for r in runs):
        mine = [r for r in runs if r[0] == ks]
        if len(mine) == every.get(ks):
            out.append(f"{ks}: all {len(mine)} runs")
            continue
        names = list(dict.fromkeys(r[1] for r in mine))
        both = {n for n in names if {r[2] for r in mine if r[1] == n} == {False, True}}
        out.append(f"{ks} " + ", ".join(n + (" (resident and offloaded)" if n in both else
                                            " (offloaded)" if any(r[2] for r in mine if r[1] == n) else "")
                                        for n in names))
    return out


def curve_groups(section: dict) -> dict[str, dict]:
    """Per prompt: ``drawn``, a list of (labels, x [bins] in tokens, y [bins] max |Δlogit|) with runs whose curves
    are identical joined under one entry, and ``exact``, the labels of runs whose every prompt row is
    byte-identical to the oracle (nothing to draw)."""
    out: dict[str, dict] = {}
    for c in section.get("curves", []):
        g = out.setdefault(c["prompt"], {"drawn": {}, "exact": [], "every": {}})
        run = (c["kernels"], _col(c["path"], c["step"]), bool(c.get("offload")))
        g["every"][run[0]] = g["every"].get(run[0], 0) + 1
        y = np.asarray(c["max_abs_diff"], dtype=float)
        if not np.any(y > 0):
            g["exact"].append(run)
            continue
        g["drawn"].setdefault((c["bin_width"], tuple(y)), []).append(run)
    return {p: {"drawn": [(_describe(runs, g["every"]), np.arange(len(key[1])) * key[0], np.asarray(key[1]))
                          for key, runs in g["drawn"].items()], "exact": _describe(g["exact"], g["every"])}
            for p, g in out.items()}


def _wrap(labels: list[str], width: int = 40) -> str:
    return "\n".join(line for label in labels for line in textwrap.wrap(label, width))


def plot_curves(section: dict, columns: int = 4):
    """Figure: per prompt, one small panel per distinct curve of per-position max |logit − oracle logit| (binned
    maxima over prompt positions, log scale), titled with the runs it belongs to (runs with identical curves share
    a panel), and a text panel naming the runs that are exact (every prompt row byte-identical: nothing drawn).
    Every titled curve is drawn with markers, so a curve of isolated positions stays visible. Returns the figure."""
    import matplotlib.pyplot as plt

    groups = curve_groups(section)
    ncols = min(columns, max([len(g["drawn"]) for g in groups.values()] + [1])) + 1
    layout = [(p, i) for p, g in groups.items() for i in range(0, max(len(g["drawn"]), 1), ncols - 1)]
    fig, axes = plt.subplots(len(layout) or 1, ncols, figsize=(3.1 * ncols, 2.5 * max(len(layout), 1)),
                             squeeze=False, gridspec_kw={"width_ratios": [1] * (ncols - 1) + [0.9]})
    for row, (p, start) in zip(axes, layout):
        g = groups[p]
        shown = g["drawn"][start:start + ncols - 1]
        top = max((float(np.max(y)) for _, _, y in g["drawn"]), default=1.0)
        for ax, (labels, x, y) in zip(row, shown):
            ax.plot(x, np.where(y > 0, y, np.nan), lw=1, color="C0", marker="o", ms=2.5,
                    markevery=None if np.count_nonzero(y) <= 40 else max(1, len(y) // 40))
            ax.set_yscale("log")
            ax.set_ylim(top=top * 1.5)
            ax.set_title(f"{p}: {_wrap(labels)}", fontsize=7.5, loc="left")
            ax.set_xlabel("prompt position (tokens)", fontsize=7)
            ax.tick_params(labelsize=7)
        if shown:
            row[0].set_ylabel("max |Δlogit|", fontsize=7)
        for ax in row[len(shown):]:
            ax.axis("off")
        if start == 0:
            text = (f"{p}, exact (every prompt row\nbyte-identical; nothing drawn):\n{_wrap(g['exact'], 32)}"
                    if g["exact"] else f"{p}: no run is exact")
            row[-1].text(0.0, 1.0, text, va="top", ha="left", fontsize=7.5, transform=row[-1].transAxes)
    fig.tight_layout()
    return fig
