"""Run a test's script in a fresh Python under Triton's CPU interpreter (TRITON_INTERPRET is read at import, so
the interpreted kernels need their own process); the script may import the test modules beside this file."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
NEEDS_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def interpreted_rows(script: str) -> list[list[str]]:
    """The whitespace-split lines the script printed; fails the test (with its stderr) if it exits non-zero."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", f"import sys\nsys.path.insert(0, {tests!r})\n{script}"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [line.split() for line in r.stdout.splitlines()]
