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
