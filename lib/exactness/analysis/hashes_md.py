"""The ``hashes`` section as GitHub markdown (run on engines: engines_md.py): the hash matrix (one row per prompt and kernel set, one column per
path@step, ``✗`` where a hash differs from that kernel set's decode oracle), the runs that differ from the oracle,
the rerun control and what each path actually served.
"""
from __future__ import annotations

from ..tables import Code, md_escape, render_extra, table
from .hashes_report import INTRO, control_table, differs_in, first_difference, graphs_summary, verdict_md

DIFF_MARK = "✗"


def render_md(section: dict) -> str:
    """receipt.md's block of a ``hashes`` section object (``{"section": "hashes", "rows": [...], ...}``): the
    engines' tables (engines_md.render_md) where it ran on engines; else the tables of :func:`render_hashes`, then
    the section's further scalar values (plot data stays in receipt.json)."""
    if isinstance(section.get("engines"), list):
        from .engines_md import render_md as engines_md
        return engines_md(section)
    extra = {k: v for k, v in section.items() if k not in ("section", "rows")}
    return "\n\n".join(p for p in (render_hashes(section.get("rows") or []), render_extra("hashes_extra", extra)) if p)


def _col(row: dict) -> str:
    step = row.get("step")
    col = str(row.get("path")) if step is None else f"{row.get('path')}@{step}"
    return col + ("+offload" if row.get("offload") else "")


def _differs(row: dict, oracle: dict[tuple, str]) -> bool:
    if row.get("equals_oracle") is not None:
        return not row["equals_oracle"]
    ref = oracle.get((row.get("prompt"), row.get("kernels")))
    return ref is not None and row.get("hash") != ref


def _served(served) -> str | None:
    if not isinstance(served, dict):
        return None if served is None else str(served)
    parts = []
    for path, s in served.items():
        s = s if isinstance(s, dict) else {"rows": s}
        if s.get("rows") == 0:
            continue  # a path that served nothing is left out
        seg = f"{s['segments']} seg / " if "segments" in s and path != "decode" else ""
        parts.append(f"{path} {seg}{s.get('rows', '?')} rows")
    return "; ".join(parts) or "nothing"


def _col_key(row: dict) -> tuple:
    step = row.get("step")
    order = {"decode": 0, "batched": 1, "deep": 2}.get(row.get("path"), 9)
    return (bool(row.get("offload")), order, str(row.get("path")),
            step is not None, step if isinstance(step, (int, float)) else 0, str(step))


def _hash_matrix(rows: list[dict]) -> str:
    rows = [r for r in rows if not r.get("control")]   # control runs: their own table
    cols = [_col(r) for r in sorted(rows, key=_col_key)]
    cols = list(dict.fromkeys(cols))
    oracle = {(r.get("prompt"), r.get("kernels")): r.get("hash") for r in rows
              if r.get("path") == "decode" and not r.get("offload")}
    grid: dict[tuple, dict] = {}
    for r in rows:
        key = (r.get("prompt"), r.get("kernels"))
        sha = (r.get("prompt_sha256") or "")[:12] + (" ⚠ unpinned" if r.get("prompt_pin_ok") is False else "")
        g = grid.setdefault(key, {"tokens": r.get("prompt_tokens"), "sha": sha})
        g[_col(r)] = Code(r.get("hash"), f" {DIFF_MARK}" if _differs(r, oracle) else "")
    body = [[p, g["tokens"], g["sha"] or None, k, *[g.get(c, "") for c in cols]] for (p, k), g in grid.items()]
    return table(body, ["prompt", "tokens", "prompt sha256", "kernels", *cols])


def render_hashes(rows: list[dict]) -> str:
    """The ``hashes`` section: the hash matrix (one row per prompt and kernel set, one column per path@step,
    ``✗`` where a hash differs from that kernel set's decode oracle), the runs that differ from the oracle, and what
    each path actually served."""
    if not rows:
        return "## Token hashes\n\n_No hash rows._"
    legend = ("Hash: first 12 hex digits of SHA-256 over the generated ids (int32 LE). "
              f"`{DIFF_MARK}`: differs from the decode (oracle) hash of the same prompt and kernels.")
    parts = ["## Token hashes", "", INTRO, "", verdict_md(rows), "", legend, "", _hash_matrix(rows)]
    oracle = {(r.get("prompt"), r.get("kernels")): r.get("hash") for r in rows
              if r.get("path") == "decode" and not r.get("offload")}
    diff = [r for r in rows if _differs(r, oracle) or differs_in(r)]
    parts += ["", "### Runs that differ from the oracle", "",
              "Tokens, prompt-logit bytes or KV-cache bytes: a run that keeps the oracle's tokens but not its bytes "
              "is listed too.", ""]
    if diff:
        parts.append(table([[r.get("prompt"), r.get("kernels"), _col(r),
                             ", ".join(differs_in(r) or ["tokens"]), first_difference(r),
                             r.get("oracle_margin"), _served(r.get("served"))] for r in diff],
                           ["prompt", "kernels", "run", "differs in",
                            "first difference: token / prompt row / KV position (layer)", "oracle margin (logit)",
                            "served"], dash="not recorded (or no token differs: no margin)"))
    else:
        parts.append("_Every run equals its oracle._")
    controls = control_table(rows)
    if controls.rows:
        parts += ["", "### Control runs", "", "A step sweep at tile and block boundaries, an fp32 control and the "
                  "engine features, each on a cut prompt against its own decode oracle.", "",
                  controls.to_markdown()]
    reruns = [r for r in rows if "rerun_equal" in r]
    if reruns:
        parts += ["", "Rerun control (each set's first batched run repeated identically; tokens and every prompt-logit "
                  "byte compared): " + "; ".join(f"{md_escape(str(r.get('prompt')))} {r.get('kernels')} "
                                                  f"{'identical' if r['rerun_equal'] else 'NOT identical'}"
                                                  for r in reruns)
                  + ". A set whose reruns differ is not run-to-run deterministic: its other differences (offload "
                    "included) cannot be told from noise."]
    graphs = _graphs_line(rows)
    parts += ["", graphs] if graphs else []
    idle = _deep_unserved(rows)
    tail = ["", f"_Every run's row ({len(rows)}: timings, plans served, byte verdicts) is in receipt.json and in the "
                  "notebook's run tables._"]
    return "\n".join(parts + (["", idle] if idle else []) + tail)


def _graphs_line(rows: list[dict]) -> str:
    """One line: per kernel set, how its runs' decode steps (the oracle's prompt rows too) ran with CUDA
    graphs, and why a graph did not serve; "" when no run tried graphs."""
    sets = {}
    for r in rows:
        sets.setdefault(r.get("kernels"), []).append(r)
    parts = [f"{ks}: {text}" for ks, rs in sets.items() if (text := graphs_summary(rs))]
    if not parts:
        return ""
    return "CUDA graphs (decode steps, the oracle's prompt rows included): " + " | ".join(parts)


def _deep_unserved(rows: list[dict]) -> str:
    """A warning line naming the deep runs whose deep plan served no row (every segment under the threshold), or ""."""
    idle = [f"{md_escape(str(r.get('prompt')))} {r.get('kernels')} {_col(r)}" for r in rows
            if r.get("path") == "deep" and isinstance(r.get("served"), dict)
            and not (r["served"].get("deep") or {}).get("rows")]
    if not idle:
        return ""
    return (f"⚠ deep path served nothing in {len(idle)} deep run(s) (every segment shorter than deep_threshold: "
            f"they ran the batched plan): " + "; ".join(idle[:12]) + (" ..." if len(idle) > 12 else ""))
