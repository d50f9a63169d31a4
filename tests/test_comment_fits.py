"""receipt.md and the PR comment stay under GitHub's comment limit whatever the run (receipt/fit.py, comment.py).

The largest receipt.md the profiles make: the committed full-length GPU receipt (receipts/gpu/receipt.json)
re-rendered with its hash matrix run on 4 engines x 200 prompts (more than any one run makes: our engine's matrix
and the engines' are one section, whichever the run computes), each with the repeat test and stream rows (rows
cloned from one real run of the tiny reference engine, prompt names and hashes made distinct). Without the fit it
is over the limit and a cut at the end loses whole sections (the control); with it, it fits, the summary comes
first and every section keeps its heading and verdict."""
from __future__ import annotations

import copy
import subprocess
import json
from pathlib import Path

import pytest

from exactness.analysis import engines as E
from exactness.analysis import engines_md
from exactness.analysis.repeat import prompt_counts, repeat_engine
from exactness.config import get_preset
from exactness.engines.reference import ReferenceEngine
from exactness.receipt import comment, fit, render
from exactness.receipt.cli import main as cli
from exactness.weights import synthetic_weights

GPU = Path(__file__).resolve().parents[1] / "receipts" / "gpu"
LIMIT = render.MD_LIMIT
ENGINES, PROMPTS = ("reference", "transformers:/m", "llamacpp:/m.gguf", "openai:http://127.0.0.1:8000/v1"), 200


@pytest.fixture(scope="module")
def engines_section() -> dict:
    """An engines section of 4 engines x 200 prompts (with the repeat test and stream rows), grown from one run
    of the tiny reference engine (fast set) on one 12-id prompt."""
    eng = ReferenceEngine(synthetic_weights(get_preset("tiny")), None, "fast")
    ids = list(range(3, 15))
    one = E.hash_rows(eng, {"p": ids}, 3)
    rep = repeat_engine(eng, "p", ids, 2, [1, 2], 3)
    rows, prompts, repeat, streams = [], {}, {}, {}
    for e in ENGINES:
        for i in range(PROMPTS):
            rows += [{**r, "engine": e, "prompt": f"prompt-{i:03d}-of-a-long-prompt-file",
                      "hash": f"{i:04x}{r['hash'][4:]}"} for r in one]
        prompts[e] = [{"name": f"prompt-{i:03d}-of-a-long-prompt-file", "kind": "text", "sha256": f"{i:064x}",
                       "tokens": len(ids), "template": None} for i in range(PROMPTS)]
        repeat[e] = copy.deepcopy(rep)
        streams[e] = {"drafted": [{"check": "drafted", "prompt": f"prompt-{i:03d}", "config": "batched",
                                   "first_divergence": None, "verdict": "equal"} for i in range(PROMPTS)]}
    return {"section": "hashes", "engines": [{"spec": e, "kind": e.split(":")[0], "oracle": eng.oracle,
                                               "configurations": [c.name for c in eng.configurations()]}
                                              for e in ENGINES],
            "rows": rows, "prompt_counts": prompt_counts(rows), "prompts": prompts, "repeat": repeat,
            "streams": streams, "errors": [], "cross": []}


@pytest.fixture(scope="module")
def largest(engines_section) -> dict:
    receipt = json.loads((GPU / "receipt.json").read_text(encoding="utf-8"))
    receipt["sections"]["hashes"] = engines_section
    receipt["runs_on"] = ["reference", *ENGINES[1:]]
    return receipt


def _headings(receipt: dict) -> list[str]:
    """Each section block's first line (its ``## ...`` heading)."""
    return [render.section_md(n, o).split("\n", 1)[0] for n, o in render.sections(receipt)]


@pytest.mark.parametrize("engines_first", [False, True], ids=["run-order", "engines-first"])
def test_the_largest_receipt_md_fits_with_every_section(largest, engines_first):
    if engines_first:   # the largest block first: a cut at the end would drop whole sections after it
        secs = largest["sections"]
        largest = {**largest, "sections": {"hashes": secs["hashes"], **secs}}
    heads = _headings(largest)
    whole = fit.join(render.render_header(largest), [(n, render.section_md(n, o))
                                                     for n, o in render.sections(largest)])
    assert len(render.compact_tables(whole)) >= LIMIT       # control: it needs the fit at all
    if engines_first:
        assert [h for h in heads if h not in render.truncate(whole)], "control: a cut at the end loses sections"
    md = render.render_markdown(largest)
    assert len(md) < LIMIT, len(md)
    assert md.index("## Summary") < md.index("## Environment") < md.index(heads[0])
    assert all(h in md for h in heads), [h for h in heads if h not in md]
    verdicts = engines_md.verdict_md(largest["sections"]["hashes"]).split("\n")
    assert len(verdicts) == len(ENGINES) and all(v in md for v in verdicts)   # each engine's verdict line kept
    assert "receipt.md under GitHub's comment limit; the whole section is in receipt.html and receipt.json" in md
    assert md.count("```") % 2 == 0 and md.count("<details") == md.count("</details>")
    print(f"receipt.md {len(md):,} characters of {LIMIT:,}; unfitted {len(whole):,}")


def test_a_receipt_that_fits_is_not_cut():
    """The GPU receipt without its bench section fits as it is: nothing compacted, folded or cut."""
    receipt = json.loads((GPU / "receipt.json").read_text(encoding="utf-8"))
    receipt["sections"] = {k: v for k, v in receipt["sections"].items() if k != "bench"}
    md = render.render_markdown(receipt)
    assert md == fit.join(render.render_header(receipt), [(n, render.section_md(n, o))
                                                          for n, o in render.sections(receipt)])
    assert len(md) < LIMIT and "receipt.md under GitHub" not in md
    blocks = [("a", "## A\n\n" + "x\n" * 100), ("b", "## B\n\nshort")]
    text = fit.fit_blocks("# H", blocks, LIMIT)
    assert text == "# H\n\n" + blocks[0][1] + "\n\n" + blocks[1][1] + "\n"


def test_shares_give_small_blocks_all_and_split_the_rest():
    assert fit.shares([10, 1000, 50], 400) == [10, 340, 50]
    assert fit.shares([500, 500], 400) == [200, 200] and fit.shares([5, 5], 400) == [5, 5]
    assert sum(fit.shares([300, 700, 900, 1], 1000)) <= 1000 and fit.shares([], 10) == []


def test_a_cut_block_closes_its_fence_and_details_and_names_the_section():
    text = "## S\n\n<details>\n\n```\n" + "line\n" * 400 + "```\n\n</details>\n"
    out = fit.cut_block("S", text, 800)
    assert len(out) <= 800 and out.startswith("## S\n") and "_S: cut to" in out
    assert out.count("```") == 2 and out.count("</details>") == 1
    assert fit.cut_block("S", "## S\n\nshort", 800) == "## S\n\nshort"


def test_the_pr_comment_fits_and_says_what_moved(largest, tmp_path):
    moved = copy.deepcopy(largest)
    for r in moved["sections"]["hashes"]["rows"]:
        r["hash"] = "f" + r["hash"][1:]                   # every engine run's token hash moved
    text = comment.comment_text(largest, moved, "base", "pr")
    assert len(text) < LIMIT, len(text)
    assert text.startswith("# Exactness: gpu — ok") and "## Summary" in text
    assert "**Moved:" in text and "### Token hashes that moved" in text
    assert "**Nothing moved.**" in comment.comment_text(largest, largest)
    for name, obj in (("base", largest), ("pr", moved)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "receipt.json").write_text(json.dumps(obj), encoding="utf-8")
    out = tmp_path / "comment.md"
    assert cli(["comment", str(tmp_path / "base"), str(tmp_path / "pr"), "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == comment.comment_text(largest, moved, str(tmp_path / "base"),
                                                                   str(tmp_path / "pr"))
    assert cli(["comment", str(tmp_path / "base"), str(tmp_path / "pr"), "--out", str(out)]) == 2   # not overwritten
    assert cli(["comment", str(tmp_path / "base"), str(tmp_path / "nope")]) == 2


def test_a_failed_pr_says_so_first(largest):
    failed = {**largest, "status": "failed", "errors": [{"notebook": "10_output_hashes", "cell": 3, "ename": "RuntimeError",
                                                         "evalue": "the server went away"}]}
    text = comment.comment_text(largest, failed)
    assert text.startswith("# Exactness: gpu — FAILED") and "the server went away" in text and len(text) < LIMIT


def test_make_comment_runs_the_comment_command(tmp_path):
    """``make comment`` runs ``python -m exactness comment BASE PR --out FILE`` (its recipe, printed by make -n; the
    command itself is tested above) and refuses to run without BASE and PR."""
    root = GPU.parents[1]
    made = subprocess.run(["make", "-s", "-n", "comment", "BASE=a b", "PR=pr", f"OUT={tmp_path}/c.md"], cwd=root,
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert f"-m exactness comment 'a b' 'pr' --out '{tmp_path}/c.md'" in made.stdout
    bare = subprocess.run(["make", "-s", "-n", "comment", "PR=pr"], cwd=root, capture_output=True, text=True)
    assert bare.returncode != 0 and "make comment needs BASE=" in bare.stderr


def test_an_engines_receipt_comment_carries_each_engines_verdict_line(engines_section):
    only = {"status": "ok", "profile": "ci", "env": {}, "sections": {"hashes": engines_section}}
    text = comment.comment_text(only, only)
    lines = [line for line in text.splitlines() if "runs equal their oracle" in line]
    assert len(lines) == len(ENGINES) and all(f"**{render.md_escape(e)}**" in "\n".join(lines) for e in ENGINES)
    assert "No summary" not in text and len(text) < LIMIT
