"""Rendering a receipt: ``receipt.md`` (GitHub markdown tables); the header page.py opens ``receipt.html`` with.

Markdown: a header (status, summary, environment, errors, parameters), then one block per section object in
``receipt["sections"]``: a section of ``sections.SECTIONS`` is rendered by its entry's renderer
(``Section.renderer()(section)``), any other by ``RENDERERS[name](section) -> str`` when registered, else by
:func:`render_generic`. Each section block
opens with what was compared and what its verdict means. receipt.md stays under GitHub's comment limit
(``MD_LIMIT``) whatever the run: the header is kept and a section block over its share of the room is cut with a
note pointing to receipt.html and receipt.json (fit.py).
"""
from __future__ import annotations

import html as _html
import json
import re
from collections.abc import Callable


from .fit import fit_blocks, join
from .sections import SECTIONS
from ..tables import DASH, md_escape, parameter_text, table

MD_LIMIT = 65_536  # GitHub's cap on a comment


# ------------------------------------------------------------------------------------------------------ helpers

def compact_tables(text: str) -> str:
    """``text`` with the column padding of its markdown table lines (lines starting with ``|``) removed: runs of
    spaces become one and separator dashes become ``---``. GitHub renders the table the same; the raw text loses
    its alignment."""
    out = []
    for line in text.split("\n"):
        if line.startswith("|"):
            line = re.sub(r"-{3,}", "---", line) if set(line) <= set("|-: ") else re.sub(r" {2,}", " ", line)
        out.append(line)
    return "\n".join(out)


def truncate(text: str, limit: int = MD_LIMIT) -> str:
    """``text`` under ``limit`` characters: as is when it fits, else with its tables compacted (compact_tables)
    when that fits, else compacted and cut at a line boundary with a closing note."""
    if len(text) < limit:
        return text
    text = compact_tables(text)
    if len(text) < limit:
        return text
    note = "\n\n_Receipt truncated to stay under GitHub's 65,536-character limit; see receipt.json._\n"
    cut = text.rfind("\n", 0, limit - len(note) - 1)
    return text[:max(cut, 0)] + note


# ------------------------------------------------------------------------------------------------------ header

def git_text(git: dict) -> str:
    """The git row: commit and always the working tree's state ("clean", "dirty: uncommitted changes", or
    "state unknown"), and who stated the commit when git did not (``source``)."""
    sha = git.get("sha") or f"unknown ({git.get('error', 'no git repository')})"
    state = {True: "dirty: uncommitted changes", False: "clean"}.get(git.get("dirty"), "state unknown")
    source = f"; stated by {git['source']}" if git.get("source") else ""
    return f"{sha} ({state}{source})"


def kernel_set_text(rec: dict) -> str:
    """One kernel set's provenance (kernels.provenance) as one line: claim, description and, for a set imported
    by reference, its module file, SHA-256, package version and its own kernels (callables no built-in set has)."""
    claim = "claims prompt == decode bytes" if rec.get("claims_exact") else "kept for comparison (claims no bytes)"
    out = md_escape(f"{claim}; {rec.get('description') or 'no description'}")
    if rec.get("file") or rec.get("sha256"):
        pkg = f", package {rec['package']} {rec.get('package_version')}" if rec.get("package") else ""
        own = ", ".join(rec.get("kernels_own") or []) or "none (every kernel is a built-in one)"
        out += md_escape(f"; from {rec.get('reference')}: {rec.get('file')}, SHA-256 {rec.get('sha256')}{pkg}; "
                         f"its own kernels: {own}")
    return out


def _env_rows(receipt: dict) -> list[list]:
    env = receipt.get("env") or {}
    num = env.get("numerics") or {}
    cuda, said = env.get("cuda") or "none", (lambda k: env.get(k) or "not recorded")  # noqa: E731
    return [["status", str(receipt.get("status", "?")).upper()], ["profile", receipt.get("profile")],
            ["git", git_text(env.get("git") or {})], ["python", env.get("python")],
            ["torch", f"{said('torch')} (CUDA {cuda}, triton {env.get('triton') or 'none'})"],
            ["device", env.get("device")],
            ["compute capability", env.get("compute_capability") or "none (no CUDA device)"],
            ["kernel sets", _set_names(env)],
            *[[f"numerics: {k}", v] for k, v in num.items()],   # one row each: a joined row was cut in the table
            ["host, time (UTC)", f"{said('hostname')}, {said('time_utc')}"]]


def _set_names(env: dict) -> str | None:
    """The run's kernel sets as given, each one given by reference shown under its own name: ``mine
    (mypkg.kernels:SET)``."""
    names = {r.get("reference"): r.get("name") for r in env.get("kernel_set_records") or []}
    given = env.get("kernel_sets") or []
    return ", ".join(f"{names[s]} ({s})" if names.get(s) not in (None, s) else s for s in given) or None


def _provenance_rows(receipt: dict) -> list[list]:
    """One row per section whose object carries a ``provenance`` dict (computed_on, commit, command, notes)."""
    provs = [(name, obj.get("provenance")) for name, obj in sections(receipt)]
    return [[name, p.get("computed_on"), p.get("commit"), p.get("command"), p.get("notes")]
            for name, p in provs if isinstance(p, dict)]


def render_errors(errors: list[dict]) -> str:
    """The errors block: a table of (notebook, cell, error, message), each section failure's whole message (an
    engine that failed: the engine, its configuration and what happened) and each traceback's tail."""
    if not errors:
        return ""
    rows = [[e.get("notebook"), e.get("cell"), e.get("ename"), e.get("evalue")] for e in errors]
    out = ["## Errors", "", table(rows, ["notebook", "cell", "error", "message"])]
    whole = [f"- **{md_escape(str(e['section']))}**: {md_escape(str(e.get('evalue')))}" for e in errors
             if e.get("section")]
    out += ["", "Failures the sections found in their runs:", "", *whole] if whole else []
    for e in errors:
        if e.get("traceback"):
            tail = "\n".join(e["traceback"][-15:]).replace("```", "'''")
            out += ["", f"Traceback tail ({e.get('notebook')}):", "", "```", tail, "```"]
    return "\n".join(out)


def render_header(receipt: dict) -> str:
    """Title, a FAILED banner when failed, the environment table, the errors and the parameters."""
    failed = receipt.get("status") != "ok"
    on = [k for k in receipt.get("runs_on") or [] if k != "reference"]
    what = f"{receipt.get('profile')}" + (f" ({', '.join(on)})" if on else "")
    parts = [f"# Exactness receipt: {what} — {'FAILED' if failed else 'ok'}", ""]
    if failed:
        parts += ["**This run FAILED: the receipt is incomplete. The errors are listed below.**", ""]
    summary = render_summary(receipt)
    if summary:
        parts += [summary, ""]
    parts += ["## Environment", "", table(_env_rows(receipt), ["field", "value"])]
    records = (receipt.get("env") or {}).get("kernel_set_records") or []
    if records:   # a list, not a table: a module's path and SHA-256 do not fit a table cell
        parts += ["", "## Kernel sets", "", *[f"- **{md_escape(str(r.get('name')))}**: {kernel_set_text(r)}"
                                             for r in records]]
    served = [(name, obj["fast_cuda"]) for name, obj in sections(receipt) if isinstance(obj.get("fast_cuda"), dict)]
    if served:
        parts += ["", "The fast set's CUDA kernels as they served each section (ok, or why its torch code served "
                  "instead):", "", *[f"- **{name}**: " + md_escape("; ".join(f"{k} {v}" for k, v in s.items()))
                                    for name, s in served]]
    prov = _provenance_rows(receipt)
    if prov:
        parts += ["", "## Where each section was computed", "",
                  "Sections computed elsewhere carry their own record (`provenance`); the environment above is the "
                  "precomputed folder's env.json, and the parameters below are the profile's: each section ran "
                  "with the command given here.", ""]
        flat = lambda v: DASH if v is None else " ".join(str(v).split())  # noqa: E731  (a list: no cell limit)
        parts += [f"- **{name}**: {flat(on)}; commit `{flat(commit)}`; `{flat(cmd)}`. {flat(notes)}"
                  for name, on, commit, cmd, notes in prov]
    if failed:
        parts += ["", render_errors(receipt.get("errors") or [])]
    params = receipt.get("parameters") or {}
    if params:
        parts += ["", "## Parameters", "", table([[k, parameter_text(k, v)] for k, v in params.items()],
                                                 ["parameter", "value"])]
    nbs = receipt.get("notebooks") or []
    if nbs:
        secs = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else v  # noqa: E731  (one decimal for all)
        rows = [[n.get("name"), f"{n.get('status')}" + (f" (run again alone after: {n['retried_alone']})"
                                                         if n.get("retried_alone") else ""), secs(n.get("seconds"))]
                for n in nbs]
        parts += ["", "## Notebooks", "", table(rows, ["notebook", "status", "time (s)"], dash="not timed")]
    return "\n".join(parts)


def _count(rows, pred) -> str:
    rows = list(rows)
    return f"{sum(1 for r in rows if pred(r))}/{len(rows)}" if rows else DASH


def render_summary(receipt: dict) -> str:
    """One verdict line per kernel set (by its own name in every section), one column per sections.Verdict of the
    section table (runs equal to the serial-decode oracle, contract pairs without a byte mismatch, FP64 rows outside
    their bound, stream equalities holding...). Empty without data."""
    objs = dict(sections(receipt))
    columns = [(v, v.rows(objs.get(s.name, {}))) for s in SECTIONS.values() for v in s.summary]
    sets = list(dict.fromkeys(r.get(v.set_field) for v, rows in columns for r in rows))
    rows = [[ks, *[_count((r for r in col if r.get(v.set_field) == ks), v.holds) for v, col in columns]]
            for ks in sets if ks]
    if not rows:
        return ""
    head = ["kernel set", *[v.header for v, _ in columns]]
    return "\n".join(["## Summary", "", "Each kernel set's paths against its oracle (serial decode through the same "
                      "set's decode kernels) and its kernels against their decode kernels. A set is exact only where "
                      "the bytes are equal, never within a tolerance: read n/N as n of N checks holding (for FP64, n "
                      "of N rows outside their error bound).", "",
                      table(rows, head, dash="this section was not run or holds no rows of this set")])


# ----------------------------------------------------------------------------------------------------- generic

def render_generic(data, title: str = "") -> str:
    """Fallback for a section with no renderer: a list of dicts as one table (union of keys), a dict as a
    key/value table, anything else as a one-cell table."""
    head = [f"## {title}", ""] if title else []
    if isinstance(data, list) and all(isinstance(r, dict) for r in data):
        keys = list(dict.fromkeys(k for r in data for k in r))
        return "\n".join(head + [table([[r.get(k) for k in keys] for r in data], keys)])
    if isinstance(data, dict):
        return "\n".join(head + [table([[k, v] for k, v in data.items()], ["key", "value"])])
    return "\n".join(head + [table([[data]], ["value"])])


# Renderers of sections outside sections.SECTIONS (whose entries name their own, Section.render).
RENDERERS: dict[str, Callable[[object], str]] = {}


def section_object(receipt: dict, name: str) -> dict:
    """The section object ``name`` of a receipt, as its analysis computed it.

    Raises:
        KeyError: the receipt holds no such section (the message names the ones it holds).
    """
    objs = dict(sections(receipt))
    if name not in objs:
        raise KeyError(f"the receipt holds no section {name!r}; it holds: {', '.join(objs) or 'none'}")
    return objs[name]


def sections(receipt: dict) -> list[tuple[str, dict]]:
    """The (name, section object) pairs of the receipt, in the order they were run."""
    objs = receipt.get("sections") or {}
    return [(k, v) for k, v in objs.items() if isinstance(v, dict)]


def section_md(name: str, obj: dict) -> str:
    """One section object's receipt.md block: its table entry's renderer, a RENDERERS entry, or generic."""
    if name in SECTIONS:
        return SECTIONS[name].renderer()(obj)
    if name in RENDERERS:
        return RENDERERS[name](obj)
    return render_generic({k: v for k, v in obj.items() if k != "section"}, title=name)


def render_markdown(receipt: dict, limit: int = MD_LIMIT) -> str:
    """``receipt.md``: header (summary and verdicts first) plus one block per section, under ``limit`` characters
    whatever the run: over it, tables lose their padding (compact_tables), then each section block over its share
    of the room the header leaves is cut with a note (fit.fit_blocks); only a header alone over the limit is cut
    at its end (truncate)."""
    header = render_header(receipt)
    blocks = [(name, section_md(name, obj)) for name, obj in sections(receipt)]
    text = join(header, blocks)
    if len(text) < limit:
        return text
    header, blocks = compact_tables(header), [(name, compact_tables(b)) for name, b in blocks]
    return truncate(fit_blocks(header, blocks, limit), limit)


def fallback_text(receipt: dict, html: bool = False) -> str:
    """Minimal markdown or HTML used when a renderer itself failed: the header and errors, as plain text."""
    try:
        text = render_header(receipt)
    except Exception:  # noqa: BLE001
        text = json.dumps({k: receipt.get(k) for k in ("status", "profile", "errors")}, indent=1, default=str)
    if not html:
        return text + "\n"
    return f"<!DOCTYPE html><html><body><pre>{_html.escape(text)}</pre></body></html>\n"
