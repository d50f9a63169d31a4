"""Bad input is refused before anything runs, and a stopped run leaves nothing behind.

Each test drives the command line (what ``make receipts`` runs) with the real notebooks and the default profile,
and checks the one-line message, the exit code 2, that no notebook ran and that nothing was written. The SIGTERM
test runs the command in a subprocess and stops it while its first notebook runs.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from exactness.receipt import runner as receipt
from exactness.receipt.cli import main

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def no_notebook_runs(monkeypatch):
    monkeypatch.setattr(receipt, "_execute", lambda *a, **k: pytest.fail("a notebook ran"))


def refused(tmp_path, capsys, *args) -> str:
    """The one-line error of a receipts command that must be refused with exit 2 and nothing written."""
    out = tmp_path / "run"
    assert main(["receipts", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert list(tmp_path.iterdir()) == []
    return err


def test_generated_tokens_past_max_positions(tmp_path, capsys, no_notebook_runs):
    err = refused(tmp_path, capsys, "--profile", "full", "--param", "gen_tokens=40000")
    assert "prompt 'code' has 16022 tokens" in err and "max_positions=32768" in err and "at most 16746" in err


def test_bench_cold_length_past_max_positions(tmp_path, capsys, no_notebook_runs):
    err = refused(tmp_path, capsys, "--param", "bench_cold_lengths=[512,40000]")
    assert "bench_cold_lengths entry 40000" in err and "allowed lengths: 2..32704" in err
    err = refused(tmp_path, capsys, "--sections", "bench", "--param", "bench_gen_tokens=32767")
    assert "leave no room" in err or "past the max_positions=32768" in err


# A config.json our loader accepts (the tensors are never read before a run starts).
TINY_CONFIG = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   norm_topk_prob=True, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                   vocab_size=258, bos_token_id=256, eos_token_id=257)


def test_missing_checkpoint_and_sections_that_would_not_use_it(tmp_path, capsys, no_notebook_runs):
    for sections in ([], ["--sections", "hashes,streams,bench"]):
        err = refused(tmp_path, capsys, *sections, "--param", "checkpoint=/nonexistent")
        assert "checkpoint folder '/nonexistent' does not exist" in err
    ck = tmp_path.parent / f"{tmp_path.name}-ck"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps(TINY_CONFIG))
    err = refused(tmp_path, capsys, "--param", f"checkpoint={ck}")
    assert "contract, fp64 compute on the preset's synthetic weights" in err and "SECTIONS=hashes,streams,bench" in err
    err = refused(tmp_path, capsys, "--sections", "hashes", "--param", f"checkpoint={ck}", "--param", "gen_tokens=4000")
    assert "past the max_positions=4096 of checkpoint" in err


def test_garbage_config_json_is_named(tmp_path, capsys, no_notebook_runs):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{not json")
    out = tmp_path / "run"
    assert main(["receipts", "--out", str(out), "--sections", "hashes", "--param", f"checkpoint={ck}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{ck / 'config.json'}: not valid JSON" in err, err
    assert not out.exists()


def test_unknown_section(tmp_path, capsys, no_notebook_runs):
    err = refused(tmp_path, capsys, "--sections", "hashes,speed")
    assert "unknown section(s) speed" in err and "hashes, contract, fp64, streams, bench" in err


def _descendants(pid: int) -> set[int]:
    """Pids of every live descendant of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def lib_env(**extra: str) -> dict:
    """This process's environment with ``lib`` first on PYTHONPATH (what PYTHONPATH held stays: a Python whose
    packages sit in a folder on it, as ``make test PY=... WHEELS=...`` sets up, still finds them)."""
    path = os.pathsep.join(p for p in (str(ROOT / "lib"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


class StderrReader:
    """Reads a process's stderr in a thread, so a test can wait for a line while the pipe never fills."""

    def __init__(self, proc: subprocess.Popen):
        self.text, self._thread = "", threading.Thread(target=self._read, args=(proc.stderr,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for chunk in iter(lambda: stream.read(256), ""):
            self.text += chunk

    def wait_for(self, needle: str, proc: subprocess.Popen, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while needle not in self.text:
            assert proc.poll() is None, f"{what}: the process ended ({proc.returncode}): {self.text}"
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s: {self.text}"
            time.sleep(0.2)

    def rest(self) -> str:
        self._thread.join(timeout=60)
        return self.text


def _gone(pids, timeout_s: float = 30) -> list[int]:
    """Those of ``pids`` still alive after up to ``timeout_s`` (a loaded machine takes a while to reap them)."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the notebook kernel's process")
def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "exactness", "receipts", "--profile", "ci", "--sections", "hashes",
                             "--out", str(out)], cwd=ROOT, env=lib_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    err = StderrReader(proc)
    # the signal comes while the notebook's kernel computes (its progress line forwarded), however loaded the
    # machine (other tests beside this one under pytest -n) and however long the kernel took to start
    err.wait_for("hash matrix", proc, 300, "the hash matrix did not start")
    kernels = _descendants(proc.pid)
    assert kernels, "the notebook kernel should be running"
    assert list(tmp_path.glob(".run.tmp-*/10_output_hashes.ipynb")), "the run should be in its temporary folder"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    text = err.rest()
    assert proc.returncode == 128 + signal.SIGTERM, text
    assert "stopped: terminated by signal 15; nothing was written" in text
    assert list(tmp_path.iterdir()) == [], "the temporary folder must be removed"
    assert _gone(kernels) == [], "the notebook kernel must be shut down"


def test_stale_temporary_folder_of_a_dead_run_is_removed(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".old.tmp-{dead.pid}-abc"
    (stale / "sections").mkdir(parents=True)
    live = tmp_path / f".other.tmp-{os.getpid()}-xyz"   # a live process's run: left alone
    live.mkdir()
    run = receipt.run_receipts("ci", tmp_path / "run", ["gen_tokens=8", "n_prompts=2"], notebooks_dir=FIXTURES,
                               notebooks=["ok"])
    assert run.status == "ok"
    assert not stale.exists() and live.is_dir()
    assert f"removed {stale}" in capsys.readouterr().err
