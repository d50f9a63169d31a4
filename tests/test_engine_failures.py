"""Failures never pass: an engine that cannot answer is refused before anything runs, one that fails mid-run makes
the receipt failed.

Up front (exit 2, one line naming the engine spec, no receipt folder, within 15 s): a URL where nothing listens, a
server answering 500, garbage from /v1/models or from the completion, a malformed stream (fake servers in
http_servers.py), a file with the GGUF magic followed by junk, a model folder with config.json and no weights.
Mid-run (exit 1, a receipt folder marked failed, one console line naming the engine and configuration): a server
that answers the probe's one token and drops every longer stream. Controls: a healthy fake server passes the probe
and its receipt section has no failure; valid GGUF and safetensors files pass their header checks, and the GGUF
index equals the gguf package's reader.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from exactness.analysis import engines as E
from exactness.analysis import hashes as H
from exactness.engines import probe
from exactness.engines.probes import check_model_folder, read_gguf_index
from exactness.receipt import runner
from exactness.receipt.cli import main
from exactness.receipt.runner import section_failures
from http_servers import ThreadServer, failing_app, fake_app

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 15.0


@pytest.fixture(scope="module")
def servers():
    """(failing_app URL, fake_app URL), both served for the module."""
    with ThreadServer(failing_app()) as a, ThreadServer(fake_app()) as b:
        yield a.url, b.url


def _gguf(path: Path, tensors: dict, meta: bool = True) -> Path:
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    if meta:
        w.add_array("tokenizer.ggml.tokens", ["a", "bc", ""] * 50)
        w.add_array("tokenizer.ggml.scores", [0.5] * 150)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def model_files(tmp_path):
    """{case: engine spec}: the two bad model files of the done-means, each refused up front."""
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    folder = tmp_path / "noweights"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 64}))
    return {"gguf junk": f"llamacpp:{junk}", "no weights": f"transformers:{folder}"}


def _refused(tmp_path, capsys, monkeypatch, spec: str) -> str:
    """The one stderr line of `receipts --engine spec`, refused with exit 2, nothing written, no notebook run."""
    monkeypatch.setattr(runner, "_execute", lambda *a, **k: pytest.fail("a notebook ran"))
    out = tmp_path / "receipts" / "run"
    t0 = time.perf_counter()
    code = main(["receipts", "--profile", "ci", "--sections", "hashes", "--engine", spec, "--out", str(out)])
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith(f"error: engine {spec!r}: ") and "\n" not in err, err
    assert not (tmp_path / "receipts").exists()
    assert elapsed < LIMIT_S
    return err


SERVER_CASES = {   # name -> (app, path or None for a dead port, words the line must hold)
    "unreachable": (None, None, "connection refused"),
    "http 500": (1, "status500", "HTTP 500"),
    "garbage /v1/models": (0, "badmodels", "did not answer a model list"),
    "garbage completion": (0, "garbage", "ended before data: [DONE]"),
    "malformed stream": (1, "malformed", "malformed chunk (not JSON)"),
}


@pytest.mark.parametrize("case", list(SERVER_CASES))
def test_a_server_that_cannot_answer_is_refused_before_anything_runs(case, servers, tmp_path, capsys, monkeypatch):
    app, path, words = SERVER_CASES[case]
    if app is None:
        from http_servers import free_port
        url = f"http://127.0.0.1:{free_port()}/v1"
    else:
        url = f"{servers[app]}/{path}/v1"
    err = _refused(tmp_path, capsys, monkeypatch, f"openai:{url}")
    assert words in err and "configuration 'server'" in err, err


def test_a_healthy_server_passes_the_probe_and_is_judged(servers, tmp_path):
    """Control: the same probe passes a server that answers; two configurations compared give no failure, one
    configuration alone compares nothing and is a failure, unless its stream equalities ran (concurrent == alone
    on that configuration)."""
    good = f"{servers[0]}/good/v1"
    probe(f"openai:{good}")
    spec = tmp_path / "two.yaml"
    spec.write_text(f"kind: openai\nconfigurations:\n  - {{name: a, base_url: '{good}'}}\n"
                    f"  - {{name: b, base_url: '{servers[0]}/good2/v1'}}\n")
    probe(str(spec))
    common = dict(device="cpu", dtype="bfloat16", prompts=["short"], prompt_max_tokens=16, steps=[8], gen_tokens=4,
                  kernel_sets=["invariant"], preset="tiny", deep_threshold=8, engine_streams=False)
    two = H.run_section(dict(engine=[str(spec)], **common))
    assert two["errors"] == [] and section_failures({"hashes": two}) == []
    assert [r["verdict"].split(" ")[0] for r in two["rows"]] == ["equal", "equal"]
    one = H.run_section(dict(engine=[f"openai:{good}"], **common))
    assert [f["ename"] for f in section_failures({"hashes": one})] == ["NothingCompared"]
    streams = H.run_section(dict(engine=[f"openai:{good}"], **{**common, "engine_streams": True}))
    assert streams["streams"][f"openai:{good}"]["concurrent"] and section_failures({"hashes": streams}) == []


@pytest.mark.parametrize("case", ["gguf junk", "no weights"])
def test_a_model_file_that_cannot_load_is_refused_before_anything_runs(case, model_files, tmp_path, capsys,
                                                                       monkeypatch):
    err = _refused(tmp_path, capsys, monkeypatch, model_files[case])
    assert {"gguf junk": "GGUF version", "no weights": "no weights"}[case] in err, err


def test_gguf_index_equals_the_gguf_reader_and_truncation_is_named(tmp_path):
    """Control: a valid GGUF (string and float arrays in its metadata, f32 and f16 tensors) passes, and its index
    (data start and byte count of every tensor) equals gguf.GGUFReader's; cut by 10 bytes, the last tensor is
    named as running past the end; without general.architecture it is refused."""
    import gguf
    path = _gguf(tmp_path / "ok.gguf", {"a": np.ones((4, 32), np.float32), "b": np.ones((3, 64), np.float16),
                                        "c": np.zeros(7, np.float32)})
    ours = read_gguf_index(path)
    theirs = [(t.name, int(t.data_offset), int(t.n_bytes)) for t in gguf.GGUFReader(str(path)).tensors]
    assert ours == theirs and len(ours) == 3
    probe(f"llamacpp:{path}")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="tensor 'c' .* runs past the end of the file"):
        probe(f"llamacpp:{cut}")
    data = bytearray(path.read_bytes())
    at = data.index(b"general.architecture")
    data[at:at + 7] = b"general"[::-1]    # the key renamed: no architecture left
    bad = tmp_path / "noarch.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="no general.architecture"):
        read_gguf_index(bad)


def test_model_folder_weights_are_checked_by_their_headers(tmp_path):
    """Control and faults: model.safetensors with a readable header passes; the same file cut short, a shard index
    naming a missing shard and a config.json without model_type are each refused in one line."""
    from safetensors.numpy import save_file
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": np.ones((8, 8), np.float32)}, str(folder / "model.safetensors"))
    check_model_folder(folder)
    whole = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(whole[:-16])
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        check_model_folder(folder)
    (folder / "model.safetensors").write_bytes(whole)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-2.safetensors"}}))
    with pytest.raises(ValueError, match="names shard\\(s\\) model-2.safetensors"):
        check_model_folder(folder)
    (folder / "model.safetensors.index.json").unlink()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no model_type"):
        check_model_folder(folder)


def test_the_hashes_command_on_engines_probes_and_fails_too(model_files, servers, tmp_path, capsys):
    """`python -m exactness hashes --param engine=[...]`: a junk GGUF refused up front (exit 2); a server failing mid-run gives the
    section JSON with its failure, exit 1 and one stderr line naming engine and configuration."""
    spec = model_files["gguf junk"]
    assert main(["hashes", "--profile", "ci", "--param", f"engine=[{spec}]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: engine {spec!r}: ") and "GGUF version" in err and "\n" not in err, err
    spec, out = f"openai:{servers[0]}/flaky/v1", tmp_path / "engines.json"
    assert main(["hashes", "--profile", "ci", "--param", f"engine=[{spec}]", "--out", str(out)]) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[hashes] failed:")]
    assert len(lines) == 1 and spec in lines[0] and "configuration 'server'" in lines[0], lines
    assert [f["ename"] for f in json.loads(out.read_text())["failures"]] == ["EngineError"]


def _cli(tmp_path, *args) -> tuple[subprocess.CompletedProcess, float]:
    """The real command line in a subprocess with a clean environment; (process, seconds)."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    # lib and what PYTHONPATH held (a Python whose packages sit in a folder on it: make test PY=... WHEELS=...)
    # and JUPYTER_PATH, where such a Python's Jupyter kernel is registered (make puts .deps/share/jupyter on it)
    path = os.pathsep.join(p for p in (str(ROOT / "lib"), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PATH": os.defpath, "HOME": str(home), "LANG": "C.UTF-8", "PYTHONPATH": path}
    if os.environ.get("JUPYTER_PATH"):
        env["JUPYTER_PATH"] = os.environ["JUPYTER_PATH"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "exactness", "receipts", "--profile", "ci", "--sections", "hashes",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc, time.perf_counter() - t0


def test_a_refusal_through_the_real_command_line_within_15_s(tmp_path):
    """The claim as a user meets it: a fresh process (its imports included), exit 2 and one line within 15 s, no
    receipt folder."""
    from http_servers import free_port
    spec = f"openai:http://127.0.0.1:{free_port()}/v1"
    proc, elapsed = _cli(tmp_path, "--engine", spec, "--out", str(tmp_path / "out" / "run"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: engine {spec!r}: "), proc.stderr
    assert "connection refused" in lines[0] and elapsed < LIMIT_S and not (tmp_path / "out").exists()


def test_a_server_failing_mid_run_gives_a_failed_receipt_and_one_line(servers, tmp_path):
    """The flaky server answers the probe's one token, then drops the run's streams: the receipt is written and
    marked failed (FAILED file, status), the command exits 1, and one console line names engine and configuration."""
    spec = f"openai:{servers[0]}/flaky/v1"
    out = tmp_path / "run"
    proc, _ = _cli(tmp_path, "--engine", spec, "--out", str(out))
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[receipt] failed: engine")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert spec in lines[0] and "configuration 'server'" in lines[0] and "ended before data: [DONE]" in lines[0]
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["status"] == "failed" and (out / "FAILED").is_file()
    assert [e["ename"] for e in receipt["errors"]] == ["EngineError"]
    assert "FAILED" in (out / "receipt.md").read_text().splitlines()[0]
