"""The receipt's dirty flag: a change to the code (a tracked file, or a new file under the code folders) makes the
tree dirty; a user's own prompt or engine file beside it does not."""
import subprocess

from exactness.receipt.env import git_state


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_dirty_counts_code_changes_not_user_files(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    assert git_state(tmp_path)["dirty"] is False
    (tmp_path / "my.jsonl").write_text('{"name": "a", "text": "hi"}\n')        # docs/engines.md's own prompt file
    (tmp_path / "my-server.yaml").write_text("kind: openai\n")
    assert git_state(tmp_path)["dirty"] is False
    (tmp_path / "lib" / "b.py").write_text("y = 2\n")                          # new code: dirty
    assert git_state(tmp_path)["dirty"] is True
    (tmp_path / "lib" / "b.py").unlink()
    (tmp_path / "lib" / "a.py").write_text("x = 2\n")                          # changed code: dirty
    assert git_state(tmp_path)["dirty"] is True


def test_notebook_kernels_import_what_the_caller_imports(tmp_path, monkeypatch):
    """A kernel set module found through the caller's working folder or a relative PYTHONPATH entry is importable
    by a process started elsewhere (a notebook kernel starts in notebooks/) while callers_import_path holds; the
    control: the same process started with the caller's own environment cannot import it."""
    import os
    import sys
    from exactness.receipt.env import callers_import_path
    for pkg in ("here_pkg", "rel/rel_pkg"):
        (tmp_path / pkg).mkdir(parents=True)
        (tmp_path / pkg / "__init__.py").write_text("X = 1\n")
    elsewhere = tmp_path / "notebooks"
    elsewhere.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "rel")
    probe = [sys.executable, "-c", "import here_pkg, rel_pkg"]

    def imports() -> bool:
        return subprocess.run(probe, cwd=elsewhere, env=dict(os.environ), capture_output=True).returncode == 0

    assert not imports()                                                    # the control
    with callers_import_path():
        assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "rel"), str(tmp_path)]
        assert imports()
    assert os.environ["PYTHONPATH"] == "rel"
