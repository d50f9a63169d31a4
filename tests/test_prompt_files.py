"""The user's own prompts (prompt_files.py: reading and build_prompts; engines.build_prompts): .txt and .jsonl files mixed
with the built-in names, recorded by name, kind, SHA-256 and token count, refused up front with one line, escaped
wherever a receipt shows them; and the CI receipt of one prompt file through four engines.

The SHA-256s are computed here independently (hashlib, struct) from the fixture files; the flips of the tiny GGUF at
n_ubatch 1 vs 512 are recomputed with llama-cpp-python directly, not through the adapter.
"""
import hashlib
import json
import re
import struct
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch

from exactness.config import get_preset
from exactness.exact import token_hash
from exactness.prompt_files import build_prompts, prompt_record, resolve
from exactness.prompts import plain_chat_text
from exactness.receipt.cli import main
from exactness.params import ParamError, check_common
from exactness.receipt.preflight import PreflightError, check_run
from exactness.tables import Table, table
from exactness.tokenizer import ByteTokenizer

FIXTURES = Path(__file__).parent / "fixtures"
ENGINES_FILE = FIXTURES / "prompts_engines.jsonl"   # a text, an ids (flips the tiny GGUF) and a chat prompt
ODD_FILE = FIXTURES / "prompts_odd_names.jsonl"     # names and texts holding tags, pipes, backticks, newlines


def _lines(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text("utf-8").splitlines() if s.strip()]


def _sha(obj: dict) -> str:
    """The SHA-256 the module docstring of prompt_files.py defines, computed here from the JSON line."""
    if "text" in obj:
        return hashlib.sha256(obj["text"].encode("utf-8")).hexdigest()
    if "ids" in obj:
        return hashlib.sha256(struct.pack(f"<{len(obj['ids'])}q", *obj["ids"])).hexdigest()
    canon = json.dumps([{"content": m["content"], "role": m["role"]} for m in obj["messages"]],
                       ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def _byte_ids(obj: dict) -> list[int]:
    """Our byte tokenizer's ids of a fixture prompt (BOS + UTF-8 bytes; a chat prompt by the plain template)."""
    if "ids" in obj:
        return list(obj["ids"])
    text = obj["text"] if "text" in obj else plain_chat_text(obj["messages"])
    return [256, *text.encode("utf-8")]


# ------------------------------------------------------------------------------------------------ files, records

def test_files_and_builtin_names_mix_in_one_list(tmp_path):
    txt = tmp_path / "my prompt.txt"
    txt.write_bytes("héllo | wörld\n".encode("utf-8"))
    sources = resolve(["short", str(txt), str(ENGINES_FILE)])
    objs = _lines(ENGINES_FILE)
    assert [s.name for s in sources] == ["short", "my prompt", *[o["name"] for o in objs]]
    assert [s.kind for s in sources] == ["builtin", "text", "text", "ids", "chat"]
    assert sources[1].sha256 == hashlib.sha256("héllo | wörld\n".encode("utf-8")).hexdigest()
    assert [s.sha256 for s in sources[2:]] == [_sha(o) for o in objs]


def test_our_engine_takes_text_ids_and_chat_and_cuts_them(tmp_path):
    objs = _lines(ENGINES_FILE)
    full = build_prompts([str(ENGINES_FILE)])
    for pr, obj in zip(full, objs):
        assert pr.ids.dtype == torch.int64 and pr.ids.tolist() == _byte_ids(obj), obj["name"]
        rec = prompt_record(pr)
        assert (rec["name"], rec["sha256"], rec["tokens"]) == (obj["name"], _sha(obj), len(_byte_ids(obj)))
    assert [prompt_record(p)["template"] for p in full] == [None, None, "plain"]
    cut = build_prompts(["short", str(ENGINES_FILE)], max_tokens=10)
    assert [p.n_tokens for p in cut] == [10] * 4
    assert [p.ids.tolist() for p in cut[1:]] == [_byte_ids(o)[:10] for o in objs]
    assert cut[0].ids.tolist() == build_prompts(["short"])[0].ids[:10].tolist()   # a built-in one is cut alike


def _write(tmp_path, name: str, data) -> str:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return str(path)


BAD_FILES = [
    ("missing.jsonl", None, "unreadable"),
    ("latin.txt", b"caf\xe9", "is not UTF-8"),
    ("empty.txt", b"", "is empty"),
    ("blank.jsonl", b"\n\n", "holds no prompt"),
    ("json.jsonl", '{"name": "a", "text": "x"}\n{"name": "b", "text": \n', "line 2: not valid JSON"),
    ("two.jsonl", '{"name": "a", "text": "x", "ids": [1]}\n', "gives \"text\" and \"ids\"; allowed: exactly one of"),
    ("none.jsonl", '{"name": "a"}\n', "gives none of \"text\", \"ids\", \"messages\""),
    ("extra.jsonl", '{"name": "a", "text": "x", "colour": 1}\n', "unknown keys colour"),
    ("noname.jsonl", '{"text": "x"}\n', 'non-empty string "name"'),
    ("emptytext.jsonl", '{"name": "a", "text": ""}\n', '"text" must be a non-empty string'),
    ("emptyids.jsonl", '{"name": "a", "ids": []}\n', '"ids" must be a non-empty list of token ids'),
    ("negids.jsonl", '{"name": "a", "ids": [1, -2]}\n', '"ids" must be a non-empty list of token ids'),
    ("badchat.jsonl", '{"name": "a", "messages": [{"role": "user"}]}\n', '"messages" must be a non-empty list'),
    ("emptychat.jsonl", '{"name": "a", "messages": [{"role": "user", "content": ""}]}\n', "the prompt is empty"),
    ("dup.jsonl", '{"name": "a", "text": "x"}\n{"name": "a", "ids": [1]}\n', "prompt name 'a' is given twice"),
    ("short.jsonl", '{"name": "short", "text": "x"}\n', "prompt name 'short' is given twice"),
]


@pytest.mark.parametrize("name,data,words", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_a_bad_prompt_file_is_refused_in_one_line(tmp_path, name, data, words):
    path = str(tmp_path / name) if data is None else _write(tmp_path, name, data)
    with pytest.raises(ParamError) as e:
        check_common({"prompts": ["short", path]})
    msg = str(e.value)
    assert "\n" not in msg and words in msg and "parameter prompts" in msg, msg


def test_an_entry_neither_builtin_nor_a_prompt_file_is_refused():
    with pytest.raises(ParamError, match=r"prompts entry 'my\.json' is not allowed; allowed: a built-in prompt "
                                         r"\(short, code, docs\) or a path to a \.txt or \.jsonl prompt file"):
        check_common({"prompts": ["my.json"]})


def test_relative_prompt_files_are_made_absolute_for_the_notebooks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "p.txt", "x")
    values = {"prompts": ["short", "p.txt"]}
    check_common(values)
    assert values["prompts"] == ["short", str(tmp_path / "p.txt")]


def test_preflight_refuses_an_id_outside_the_vocabulary_and_a_prompt_too_long(tmp_path):
    cfg = get_preset("tiny")
    base = {"preset": "tiny", "gen_tokens": 8, "prompt_max_tokens": None}
    ok = _write(tmp_path, "ok.jsonl", json.dumps({"name": "edge", "ids": [256, cfg.vocab_size - 1]}) + "\n")
    check_run({**base, "prompts": [ok]}, ["hashes"])   # the control: the last id of the vocabulary passes
    bad = _write(tmp_path, "bad.jsonl", json.dumps({"name": "over", "ids": [256, 1, cfg.vocab_size]}) + "\n")
    with pytest.raises(PreflightError, match=rf"prompt 'over': id {cfg.vocab_size} at position 2 is outside the "
                                             rf"vocabulary of preset tiny \(ids 0\.\.{cfg.vocab_size - 1}\)"):
        check_run({**base, "prompts": [bad]}, ["hashes"])
    long = _write(tmp_path, "long.txt", "x" * (cfg.max_positions - 8))   # BOS + bytes: 1 + P - 8 tokens
    with pytest.raises(PreflightError, match=rf"hashes: prompt 'long' has {cfg.max_positions - 7} tokens; with 8 "
                                             rf"generated that is {cfg.max_positions + 1} positions, past the "
                                             rf"max_positions={cfg.max_positions}"):
        check_run({**base, "prompts": [long]}, ["hashes"])
    check_run({**base, "prompts": [long], "prompt_max_tokens": 300}, ["hashes"])   # cut like a built-in prompt


# ------------------------------------------------------------------------------------------------------ escaping

def _unescaped_pipes(line: str) -> int:
    """Pipes of a markdown table line not escaped by an odd run of backslashes (the column separators)."""
    return sum(1 for m in re.finditer(r"(\\*)\|", line) if len(m.group(1)) % 2 == 0)


def table_widths(md: str) -> list[set[int]]:
    """For each markdown table of ``md`` (consecutive lines starting with ``|``), the set of separator counts."""
    out, cur = [], None
    for line in md.split("\n"):
        if line.startswith("|"):
            cur = set() if cur is None else cur
            cur.add(_unescaped_pipes(line))
        elif cur is not None:
            out, cur = out + [cur], None
    return out + ([cur] if cur is not None else [])


class _Tags(HTMLParser):
    """Every start tag with its attributes, and the text (entities decoded) per enclosing tag."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tags, self.text, self._open = [], [], None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._open = tag

    def handle_data(self, data):
        self.text.append((self._open, data))


def live_markup(html: str) -> list[str]:
    """What in ``html`` a prompt name could have made live: event-handler attributes, javascript: URLs, images
    not embedded as data: URIs, scripts that call alert."""
    p = _Tags(html)
    bad = [f"{t} {k}" for t, a in p.tags for k in a if k.lower().startswith("on")]
    bad += [f"{t} {k}={v}" for t, a in p.tags for k, v in a.items()
            if (v or "").strip().lower().startswith("javascript:")]
    bad += [f"img src={a.get('src')}" for t, a in p.tags if t == "img" and not (a.get("src") or "").startswith("data:")]
    bad += ["script alert" for t, d in p.text if t == "script" and "alert(" in d]
    return bad


def test_the_checkers_catch_a_broken_table_and_a_live_tag():
    """Negative controls: a row with an unescaped pipe and a live tag are what the checkers below report."""
    assert table_widths("| a | b |\n|---|---|\n| x \\| y | z |") == [{3}]
    assert table_widths("| a | b |\n|---|---|\n| x | y | z |") == [{3, 4}]
    assert live_markup('<p><img src=x onerror=alert(1)></p><a href="javascript:alert(2)">l</a>') == [
        "img onerror", "a href=javascript:alert(2)", "img src=x"]
    assert live_markup('<p>&lt;img src=x onerror=alert(1)&gt;</p><img src="data:image/png;base64,AA">') == []


def test_odd_names_keep_markdown_tables_intact():
    names = [o["name"] for o in _lines(ODD_FILE)] + ["back\\", "a\\|b", "x\r\ny"]
    md = table([[n, 1, n] for n in names], ["prompt", "tokens", "again"])
    widths = table_widths(md)
    assert widths == [{4}], md
    md2 = Table([{"prompt": n, "tokens": 1} for n in names]).to_markdown()
    assert table_widths(md2) == [{3}], md2
    for text in (md, md2):
        assert "<img" not in text and not re.search(r"(?<!\\)\]\(javascript", text)
        assert "`" not in text.replace("\\`", "")


@pytest.fixture(scope="module")
def odd_receipt(tmp_path_factory):
    """A ci receipt of the hashes section (fast set, one step, cut prompts) on the odd names and a built-in prompt."""
    out = tmp_path_factory.mktemp("odd") / "r"
    code = main(["receipts", "--profile", "ci", "--out", str(out), "--sections", "hashes",
                 "--param", f"prompts=[{json.dumps(str(ODD_FILE))},short]", "--param", "kernel_sets=[fast]",
                 "--param", "steps=[4]", "--param", "hash_sweep_steps=[]", "--param", "hash_fp32_control=false",
                 "--param", "hash_features=false", "--param", "hash_rerun=false", "--param", "gen_tokens=4",
                 "--param", "prompt_max_tokens=24"])
    return code, out


def test_a_receipt_shows_odd_prompt_names_as_text(odd_receipt):
    code, out = odd_receipt
    assert code == 0
    objs = _lines(ODD_FILE)
    rec = json.loads((out / "receipt.json").read_text())
    got = rec["sections"]["hashes"]["prompts"]
    assert [(r["name"], r["kind"], r["sha256"], r["tokens"]) for r in got[:3]] == [
        (o["name"], k, _sha(o), min(24, len(_byte_ids(o)))) for o, k in zip(objs, ("text", "ids", "chat"))]
    md = (out / "receipt.md").read_text()
    widths = table_widths(md)
    assert widths and all(len(w) == 1 for w in widths), [w for w in widths if len(w) > 1]
    html = (out / "receipt.html").read_text()
    assert live_markup(html) == []
    text = "".join(d for _, d in _Tags(html).text)
    assert objs[0]["name"] in text and objs[2]["name"] in text   # shown as text, tags and links as typed


# ------------------------------------------------------------------------------------ the CI receipt, 4 engines

GEN = 24


def _llama_greedy(gguf: Path, prompt: list[int], n_ubatch: int) -> list[int]:
    """Greedy ids after ``prompt`` with llama-cpp-python directly: the prompt in one batch of n_ubatch-row
    micro-batches, then one token at a time, each the first maximal logit."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=4096, n_batch=4096, n_ubatch=n_ubatch, logits_all=True,
                          n_threads=1, n_threads_batch=1, seed=0, verbose=False)
    llm.eval(prompt)
    out = []
    for _ in range(GEN):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    llm.close()
    return out


@pytest.fixture(scope="module")
def four_engines(tmp_path_factory):
    """One ci receipt, SECTIONS=engines: reference, transformers and llama.cpp on the tiny model with vocabulary 512
    (the issue's flipping model), our server and llama.cpp's server launched from YAML files."""
    from exactness.engines import gguf_export
    from exactness.engines.tiny import save_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("engines")
    folder = save_tiny_qwen3_moe(root / "tiny", vocab_size=512, hidden_size=128, initializer_range=0.2)
    engines = [f"reference:{folder}", f"transformers:{folder}"]
    serve = root / "serve.yaml"
    serve.write_text("kind: openai\noracle: decode\nconfigurations:\n" + "".join(
        f'  - {{name: {p}, launch: "{{python}} -m exactness serve --kernels fast --path {p} --port {{port}}"}}\n'
        for p in ("decode", "batched")))
    gguf = None
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        engines.append(str(serve))
    else:
        gguf = gguf_export.export_gguf(folder, root / "tiny.gguf", dtype="bf16")
        server = root / "llama.yaml"
        server.write_text("kind: openai\noracle: n_ubatch-1\ntoken_ids: false\nsampling: {top_k: 0}\n"
                          "configurations:\n" + "".join(
                              f'  - {{name: n_ubatch-{u}, launch: "{{python}} -m llama_cpp.server --model {gguf} '
                              f'--port {{port}} --n_ubatch {u} --n_ctx 512"}}\n' for u in (1, 512)))
        engines += [f"llamacpp:{gguf}", str(serve), str(server)]
    out = root / "r"
    code = main(["receipts", "--profile", "ci", "--out", str(out), "--engine", *engines,
                 "--param", f"prompts=[{json.dumps(str(ENGINES_FILE))}]", "--param", "engine_streams=false",
                 "--param", "engine_repeat=0", "--param", "kernel_sets=[fast]", "--param", "steps=[128]",
                 "--param", f"gen_tokens={GEN}"])
    return code, out, engines, gguf


def test_ci_receipt_runs_a_prompt_file_through_four_engines(four_engines):
    code, out, engines, _ = four_engines
    assert code == 0
    section = json.loads((out / "receipt.json").read_text())["sections"]["hashes"]
    assert section["errors"] == []
    objs = _lines(ENGINES_FILE)
    labels = [e["spec"] for e in section["engines"]]
    assert labels == [f"{engines[0]}:fast", *engines[1:]]
    for label in labels:
        server_chat = label.endswith(".yaml")   # the chat prompt goes to the server as messages: its template
        recs = {r["name"]: r for r in section["prompts"][label]}
        for obj in objs:
            chat = "messages" in obj
            want_tokens = None if chat and server_chat else len(_byte_ids(obj))
            assert (recs[obj["name"]]["sha256"], recs[obj["name"]]["tokens"]) == (_sha(obj), want_tokens), label
            assert recs[obj["name"]]["template"] == (("server" if server_chat else "plain") if chat else None)
            rows = [r for r in section["rows"] if r["engine"] == label and r["prompt"] == obj["name"]]
            configs = {r["config"] for r in rows}
            assert len(rows) == len(configs) >= 2, (label, obj["name"])
            assert all(r["prompt_sha256"] == _sha(obj) for r in rows)
            assert all(r["prompt_tokens"] == want_tokens for r in rows if want_tokens is not None)
            assert all(isinstance(r["prompt_tokens"], (int, type(None))) for r in rows)
    md = (out / "receipt.md").read_text()
    assert all(o["name"] in md for o in objs) and all(len(w) == 1 for w in table_widths(md))


def test_the_ids_prompt_shows_the_tiny_gguf_flipping_tokens(four_engines):
    code, out, _, gguf = four_engines
    if gguf is None:
        pytest.skip("llama-cpp-python is not installed: pip install llama-cpp-python")
    assert code == 0
    section = json.loads((out / "receipt.json").read_text())["sections"]["hashes"]
    ids = next(o["ids"] for o in _lines(ENGINES_FILE) if o["name"] == "ids-flips")
    rows = {r["config"]: r for r in section["rows"]
            if r["engine"] == f"llamacpp:{gguf}" and r["prompt"] == "ids-flips"}
    one, big = _llama_greedy(gguf, ids, 1), _llama_greedy(gguf, ids, 512)
    first = next((i for i, (a, b) in enumerate(zip(one, big)) if a != b), None)
    assert rows["n_ubatch-1"]["hash"] == token_hash(torch.tensor(one))      # the receipt's runs are llama.cpp's
    assert rows["n_ubatch-512"]["hash"] == token_hash(torch.tensor(big))
    assert rows["n_ubatch-512"]["first_divergence"] == first
    assert rows["n_ubatch-512"]["equals_oracle"] is (first is None)
    if first is None:   # ggml's kernels are the CPU's: n_ubatch 1 and 512 may agree to the byte on another one
        pytest.skip(f"on this CPU llama.cpp gives n_ubatch 1 and 512 the same tokens on the ids prompt "
                    f"({sys.platform}); the receipt agrees")
    assert rows["n_ubatch-512"]["verdict"].startswith("differs: tokens")
    flipped = sum(a != b for a, b in zip(one, big))
    assert flipped > 0 and first < GEN


def test_fp64_captures_a_file_prompt_by_name():
    from exactness.analysis.fp64.section import capture_plan
    from exactness.params import Fp64Params
    from exactness.profiles import get_profile

    base = {k: v for k, v in get_profile("ci").parameters().items() if k in Fp64Params.names()}
    ids = next(o["ids"] for o in _lines(ENGINES_FILE) if o["name"] == "ids-flips")
    plan = capture_plan(Fp64Params.from_dict({**base, "prompts": ["short", str(ENGINES_FILE)],
                                              "fp64_prompt": "ids-flips"}))
    assert plan["prompt"] == "ids-flips" and plan["ids"].tolist() == ids[:plan["tokens"]]
    assert plan["record"]["sha256"] == _sha({"ids": ids})
    with pytest.raises(ValueError, match="fp64_prompt 'nope' is not one of the run's prompts: short, text-pi"):
        capture_plan(Fp64Params.from_dict({**base, "prompts": ["short", str(ENGINES_FILE)], "fp64_prompt": "nope"}))
