"""``make lab`` starts: scripts/lab.sh (the command the Makefile runs) serves notebooks/ and prints its URL.

The server runs on a free port (``--port=0``) with its runtime files in a temporary folder, is asked for its
contents and kernel specs through the printed URL (token included), and is stopped by its own PID. As root (CI) this
also checks that the script passes ``--allow-root``: without it Jupyter exits at once.
"""
from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The jupyter next to the interpreter running the tests (.venv's under `make test`, the one `make lab` uses).
JUPYTER = Path(sys.executable).parent / "jupyter"
URL = re.compile(r"(http://127\.0\.0\.1:\d+)/lab\?token=(\w+)")
START_TIMEOUT_S = 60


def get_json(url: str, deadline: float) -> dict:
    """GET ``url`` as JSON, retrying refused connections until ``deadline``: Jupyter prints its URL just before
    its event loop binds the port."""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=20) as r:
                return json.load(r)
        except urllib.error.URLError as e:
            if not isinstance(e.reason, ConnectionRefusedError) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.skipif(not JUPYTER.exists(), reason=f"no jupyter next to {sys.executable}")
def test_lab_serves_the_notebooks(tmp_path):
    env = {**os.environ, "JUPYTER": str(JUPYTER), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    proc = subprocess.Popen([str(ROOT / "scripts" / "lab.sh"), "--port=0"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    log, match = [], None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while match is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            log.append(line)
            match = URL.search(line)
        while not match and not lines.empty():  # what a server that exited early printed last
            log.append(lines.get())
        assert match, f"no URL within {START_TIMEOUT_S} s (exit code {proc.poll()}):\n{''.join(log)[-4000:]}"
        base, token = match.groups()
        deadline = time.monotonic() + 30

        contents = get_json(f"{base}/api/contents?token={token}", deadline)
        served = {c["name"] for c in contents["content"] if c["type"] == "notebook"}
        assert "10_output_hashes.ipynb" in served
        assert served == {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}, served
        specs = get_json(f"{base}/api/kernelspecs?token={token}", deadline)["kernelspecs"]
        assert "exactness" in specs, f"kernel `exactness` not registered (make setup registers it): {sorted(specs)}"
    finally:
        proc.terminate()  # lab.sh execs jupyter, so this PID is the server's
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
