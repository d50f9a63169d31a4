"""Receipt run folders: where a run's folder goes, never overwriting one, and leaving nothing behind when a run stops.

A run writes into a hidden temporary folder beside its final one (``.<name>.tmp-<pid>-<random>``) and renames it into
place when complete. Ctrl-C and SIGTERM (:func:`sigterm_as_interrupt`) remove it; a later run removes those that
runs killed outright left (:func:`remove_stale_temporaries`).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import re
import shutil
import signal
import sys
import threading
from pathlib import Path

from .env import REPO_ROOT

DEFAULT_RECEIPTS_DIR = REPO_ROOT / "receipts"


class ReceiptError(Exception):
    """Bad input to a receipt run (unknown parameter, existing folder, missing notebook or kernel, ...).

    Raised before anything is written."""


def run_folder(profile: str, out: Path | str | None, env: dict, receipts_dir: Path | str | None = None) -> Path:
    """The final run folder: ``out`` if given, else ``<receipts_dir>/<UTC %Y%m%dT%H%M%SZ>-<git short>-<profile>``
    (``profile`` names the run: the profile, with ``-engines`` / ``-dumps`` for runs on engines or dumps).

    Raises:
        ReceiptError: the folder already exists (receipts are never overwritten).
    """
    if out is None:
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        short = env.get("git", {}).get("short") or "nogit"
        out = Path(receipts_dir or DEFAULT_RECEIPTS_DIR) / f"{stamp}-{short}-{profile}"
    final = Path(out).absolute()
    if final.exists():
        raise ReceiptError(f"run folder {final} already exists; receipts are never overwritten: pick another OUT")
    return final


_TMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, owned by another user
        return True
    return True


def remove_stale_temporaries(parent: Path) -> list[Path]:
    """Remove the hidden temporary folders (``.<name>.tmp-<pid>-*``) that runs whose process no longer exists left
    in ``parent`` (a run killed with SIGKILL, or a machine that went down); each is named on stderr. Folders of
    live processes are left alone. Returns the removed paths."""
    removed = []
    for entry in sorted(Path(parent).iterdir()) if Path(parent).is_dir() else []:
        m = _TMP_NAME.match(entry.name)
        if m and entry.is_dir() and not _pid_alive(int(m["pid"])):
            shutil.rmtree(entry, ignore_errors=True)
            print(f"[receipt] removed {entry}: the temporary folder of a run (pid {m['pid']}) that did not finish",
                  file=sys.stderr, flush=True)
            removed.append(entry)
    return removed


class Terminated(KeyboardInterrupt):
    """SIGTERM during a run, raised as an interrupt so that the cleanup of Ctrl-C runs; ``signum`` gives the exit
    status 128 + signum that a process killed by the signal would have."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within this block SIGTERM raises KeyboardInterrupt in the main thread, so a terminated run cleans up (its
    temporary folder, the notebook kernel) exactly as Ctrl-C does; the previous handler is restored on exit. Off the
    main thread (where Python cannot install handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise Terminated(signum)
    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
