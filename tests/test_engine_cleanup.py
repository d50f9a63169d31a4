"""Servers the openai adapter launched are stopped when the command that launched them is terminated (SIGTERM), not
left running in their own session."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_refusals import ROOT, _alive, _descendants, _gone, lib_env

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the launched server")


def _servers(pid: int) -> list[int]:
    """Live descendants of ``pid`` running ``exactness serve``."""
    out = []
    for p in _descendants(pid):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"exactness serve" in cmd:
            out.append(p)
    return out


def test_sigterm_stops_the_launched_servers(tmp_path):
    engine = tmp_path / "serve.yaml"
    engine.write_text('kind: openai\nprompt_logprobs: "off"\nconfigurations:\n'
                      '  - {name: a, launch: "{python} -m exactness serve --kernels invariant --port {port}"}\n')
    # many requests, so the run is still going when the signal comes
    cmd = [sys.executable, "-m", "exactness", "hashes", "--profile", "ci", "--param", f"engine=[{engine}]",
           "--param", "engine_repeat_only=true", "--param", "engine_repeat=100000", "--param",
           "engine_repeat_concurrency=[1]", "--out", str(tmp_path / "out.json")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": lib_env()["PYTHONPATH"],
                                                "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (servers := _servers(proc.pid)):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the server was not launched"
        time.sleep(0.2)
    time.sleep(3)   # launched, probed, requests under way
    assert all(_alive(p) for p in servers)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert _gone(servers) == [], "the launched server must be stopped"
