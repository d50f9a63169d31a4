"""The ``exactness diff`` command: two receipts in, what moved out (diff.py computes it, diff_md.py writes the
markdown), and :func:`write_text`, which the ``comment`` command shares with it.

Exit status (cli.main runs :func:`run`; a DiffError is one ``error:`` line on stderr): 0 nothing moved, 1 something
moved (or could not be compared), 2 bad input (a message on stderr, nothing written).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from .diff import DiffError, diff_receipts, load_receipt
from .diff_md import render
from ..files import write_json

HELP = "compare two receipts (folders or receipt.json): what moved, as markdown for a pull-request comment"


# ------------------------------------------------------------------------------------------------ command line

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The diff's arguments: BASE, PR, ``--out`` folder."""
    p.add_argument("base", help="the base receipt: a receipt folder, its receipt.json, or a folder of section JSONs "
                   "(python -m exactness sections --out DIR)")
    p.add_argument("pr", help="the pull request's receipt, as BASE")
    p.add_argument("--out", default=None, help="folder to write diff.md and diff.json into (created; existing "
                   "files are never replaced); the markdown goes to stdout as well")


def write_text(text: str, path: Path) -> None:
    """``text`` to ``path`` atomically (a hidden temporary file beside it, renamed into place)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def check_out(out: str) -> Path:
    """The ``--out`` folder, checked before any work.

    Raises:
        DiffError: ``out`` is a file, or already holds diff.md or diff.json (nothing is ever overwritten).
    """
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise DiffError(f"--out {out!r} is a file; expected a folder (created where missing)")
    taken = [n for n in ("diff.md", "diff.json") if (folder / n).exists()]
    if taken:
        raise DiffError(f"--out {out!r} already holds {', '.join(taken)}; refusing to overwrite: pick a new folder")
    return folder


def write_outputs(result: dict, markdown: str, out: str) -> None:
    """diff.json (files.write_json) and diff.md into folder ``out``, created where missing.

    Raises:
        DiffError: see check_out.
    """
    folder = check_out(out)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(result, str(folder / "diff.json"))
    write_text(markdown, folder / "diff.md")


def run(args: argparse.Namespace) -> int:
    """Diff ``args.base`` against ``args.pr``; print the markdown, write ``--out``; 0 nothing moved, 1 moved.

    Raises:
        DiffError: bad input (see load_receipt, check_out)."""
    if args.out:
        check_out(args.out)
    result = diff_receipts(load_receipt(args.base), load_receipt(args.pr), str(args.base), str(args.pr))
    markdown = render(result)
    if args.out:
        write_outputs(result, markdown, args.out)
    sys.stdout.write(markdown)
    return 1 if result["moved"] else 0
