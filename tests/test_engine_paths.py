"""Paths in engine specs: on the command line they are the caller's (made absolute before the notebooks, which run in
their own folder, read them); inside a YAML engine file they are the file's (a relative target, and the folder the
launch commands run in)."""
import os
import sys

from exactness.engines import open_engine, parse_spec
from exactness.params import check_common

SERVE_HERE = "import sys\nfrom exactness.engines.serve import main\nsys.exit(main(['--port', sys.argv[1]]))\n"


def test_command_line_engine_paths_are_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "e.yaml").write_text("kind: openai\ntarget: http://127.0.0.1:9/v1\n")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    values = {"engine": ["e.yaml", "llamacpp:m.gguf", "reference", "openai:http://127.0.0.1:9/v1"]}
    check_common(values)
    assert values["engine"] == [str(tmp_path / "e.yaml"), f"llamacpp:{tmp_path / 'm.gguf'}", "reference",
                                "openai:http://127.0.0.1:9/v1"]


def test_paths_in_an_engine_file_are_the_files(tmp_path, monkeypatch):
    folder = tmp_path / "engines"
    folder.mkdir()
    (folder / "m.gguf").write_bytes(b"GGUF" + bytes(8))
    (folder / "ll.yaml").write_text("kind: llamacpp\ntarget: m.gguf\n")
    monkeypatch.chdir(tmp_path)   # the caller is elsewhere
    kind, target, _ = parse_spec(str(folder / "ll.yaml"))
    assert (kind, target) == ("llamacpp", str(folder / "m.gguf"))
    (folder / "serve_here.py").write_text(SERVE_HERE)
    (folder / "s.yaml").write_text('kind: openai\nprompt_logprobs: "off"\nconfigurations:\n'
                                   '  - {name: here, launch: "{python} serve_here.py {port}"}\n')
    assert parse_spec(str(folder / "s.yaml"))[2]["cwd"] == str(folder)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
    engine = open_engine(str(folder / "s.yaml"))   # serve_here.py is found only from the file's folder
    try:
        assert engine.generate([1, 72, 105], 2, "here").gen_ids.numel() == 2
        assert engine.configurations()[0].settings["base_url"] == "launched"
    finally:
        engine.close()
