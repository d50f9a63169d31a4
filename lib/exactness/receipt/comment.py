"""The pull-request comment (``python -m exactness comment BASE PR [--out FILE]``, ``make comment BASE=... PR=...``).

One markdown text under GitHub's comment limit (render.MD_LIMIT): PR's status and commit, its summary (one verdict
line per kernel set, and per engine for an engines run), its errors when it failed, then what moved against BASE as
``exactness diff`` computes it (diff.diff_receipts, diff_md.render: cut with a note when long, diff.json holding every
row). BASE and PR are receipt folders or receipt.json files. Exit status (cli.main runs :func:`run`): 0 written, 2 bad
input (a message on stderr, nothing written).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .diff import DiffError, diff_receipts, load_receipt
from .diff_cli import write_text
from .diff_md import render as diff_markdown
from .fit import SEP
from .render import MD_LIMIT, git_text, render_errors, render_summary, truncate

HELP = "the pull-request comment: PR's summary and what moved against BASE, under GitHub's comment limit"
SLACK = 64   # characters kept free below the limit for the separator and the final newline


def _demoted(markdown: str) -> str:
    """``markdown`` with every heading one level lower (the diff's title under the comment's title)."""
    return "\n".join("#" + line if line.startswith("#") else line for line in markdown.split("\n"))


def summary_md(pr: dict, pr_name: str) -> str:
    """PR's title, commit, summary table and (when it failed) its errors."""
    failed = pr.get("status") != "ok"
    git = ((pr.get("env") or {}).get("git")) or {}
    parts = [f"# Exactness: {pr.get('profile')} — {'FAILED' if failed else 'ok'}", "",
             f"Receipt `{pr_name}` at {git_text(git)}; its receipt.md and receipt.html hold every section.", ""]
    if failed:
        parts += ["**This run FAILED: the receipt is incomplete.**", ""]
    summary, engines = render_summary(pr), (pr.get("sections") or {}).get("hashes")
    if isinstance(engines, dict) and engines.get("engines"):
        from ..analysis.engines_md import verdict_md   # one verdict line per engine under test
        summary = "\n\n".join(x for x in (summary, verdict_md(engines)) if x)
    parts += [summary if summary else "_No summary: the run holds none of the summarized sections._"]
    if failed:
        parts += ["", render_errors(pr.get("errors") or [])]
    return "\n".join(parts)


def comment_text(base: dict, pr: dict, base_name: str = "BASE", pr_name: str = "PR", limit: int = MD_LIMIT) -> str:
    """The comment for receipts ``base`` and ``pr`` (dicts as in receipt.json), under ``limit`` characters: the
    summary whole (cut at its end only if it alone is over the limit), the diff in the room it leaves."""
    head = summary_md(pr, pr_name)
    room = limit - len(head) - len(SEP) - SLACK
    result = diff_receipts(base, pr, base_name, pr_name)
    diff = _demoted(diff_markdown(result, limit=max(room, 0))).strip() if room > 0 else ""
    if diff and len(diff) >= room:   # demoting added a character per heading
        diff = truncate(diff, room).strip()
    return truncate(SEP.join(p for p in (head, diff) if p) + "\n", limit)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """BASE, PR and ``--out FILE``."""
    p.add_argument("base", help="the base receipt: a receipt folder or its receipt.json")
    p.add_argument("pr", help="the pull request's receipt: a receipt folder or its receipt.json")
    p.add_argument("--out", default=None, help="file to write the comment to (never overwritten); else stdout")


def run(args: argparse.Namespace) -> int:
    """Write the comment to ``--out`` (a new file) or stdout; 0.

    Raises:
        DiffError: ``--out`` exists or its folder does not; a receipt is missing or not a receipt (load_receipt).
    """
    out = Path(args.out) if args.out else None
    if out is not None and (out.exists() or not out.parent.is_dir()):
        raise DiffError(f"--out {args.out!r} " + ("exists; refusing to overwrite: pick a new file" if out.exists()
                                                  else f"is in a folder that does not exist ({out.parent})"))
    text = comment_text(load_receipt(args.base), load_receipt(args.pr), str(args.base), str(args.pr))
    if out is None:
        sys.stdout.write(text)
    else:
        write_text(text, out)
        print(f"wrote {out} ({len(text):,} characters)", file=sys.stderr)
    return 0
