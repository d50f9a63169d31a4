"""Concurrent streams: each of N = 2 and 4 concurrent streams equals its run alone and the serial no-draft run
(tokens, prompt- and generated-logits bytes) with the invariant set; a batch-composition-dependent kernel is caught
exactly where it acts; bad input; the ``streams`` section end to end (tiny parameters) and notebook 40 through
papermill on its output.

Tiny preset, bf16, CPU; stream prompts are the profile prompts cut to at most 40 tokens (minus 5 per stream)."""
import json
from pathlib import Path

import pytest
import torch

from exactness.analysis import streams as section
from exactness.analysis import streams_report
from exactness.exact import bytes_equal, first_differing_row

from exactness.paths import Schedule, generate
from faults import row0_rmsnorm_perturbed
from exactness.prompts import build_prompt
from exactness.batch import run_streams

GEN, STEP, OFFSET = 8, 16, 2
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prompts():
    """Four stream prompts of different lengths: code 40, docs 35, short 30, code 25 tokens."""
    ps = [build_prompt(n, max_tokens=40) for n in ("code", "docs", "short")]
    return [ids for _, ids in section.stream_prompts(ps, 4, 40)]


def same(s, ref) -> bool:
    return (torch.equal(s.gen_ids, ref.gen_ids) and bytes_equal(s.gen_logits, ref.gen_logits)
            and bytes_equal(s.prompt_logits, ref.prompt_logits))


@pytest.mark.parametrize("n", [2, 4])
def test_concurrent_streams_equal_alone_and_serial_invariant(tiny_weights, prompts, n):
    res = run_streams(tiny_weights, prompts[:n], GEN, "invariant", Schedule("batched", STEP), offset=OFFSET)
    assert res.max_batch_rows == n and len({int(p.numel()) for p in prompts[:n]}) == n  # a real mixed batch
    for j, s in enumerate(res.streams):
        alone = generate(tiny_weights, prompts[j], GEN, "invariant", Schedule("batched", STEP))
        serial = generate(tiny_weights, prompts[j], GEN, "invariant", Schedule("decode"))
        assert s.info["join_step"] == j * OFFSET
        assert same(s, alone), f"stream {j} differs from its run alone"
        assert same(s, serial), f"stream {j} differs from the serial oracle"


def test_graphs_on_cpu_fall_back_per_batch_size_with_reason(tiny_weights, prompts, monkeypatch):
    """run_streams(graphs=True) without a CUDA device: one GraphDecoder per active count (1 while stream 0 is
    alone, then 2), every forward eager with the reason recorded, and the eager run's bytes."""
    from exactness import loop
    built = []

    class Counted(loop.GraphDecoder):
        def __init__(self, *a, **kw):
            built.append(kw.get("batch"))
            super().__init__(*a, **kw)
    monkeypatch.setattr(loop, "GraphDecoder", Counted)
    args = (tiny_weights, prompts[:2], GEN, "invariant", Schedule("batched", STEP))
    eager, run = run_streams(*args, offset=OFFSET), run_streams(*args, offset=OFFSET, graphs=True)
    assert eager.graphs == {} and sorted(run.graphs) == [1, 2] and built == [1, 2]   # one decoder per batch size
    assert all(not g["served"] and "CUDA device" in g["reason"] for g in run.graphs.values())
    assert sum(g["eager_steps"] for g in run.graphs.values()) == run.decode_forwards == eager.decode_forwards
    assert all(same(a, b) for a, b in zip(run.streams, eager.streams))


def test_batch_dependent_kernel_is_caught_where_it_acts(tiny_weights, prompts):
    """Negative control: RMSNorm perturbed (about one ulp) on row 0 of every call of more than one row. Stream 0
    decodes alone for steps 0-1; stream 1 joins at step 2, so stream 0's token 3 (decoded at step 2) is the first
    one from a two-row forward: its logits row is the first to differ. Stream 1 sits in row 1 and stays equal."""
    bad = row0_rmsnorm_perturbed()
    res = run_streams(tiny_weights, prompts[:2], GEN, bad, Schedule("batched", STEP), offset=OFFSET)
    alone = [generate(tiny_weights, p, GEN, bad, Schedule("batched", STEP)) for p in prompts[:2]]
    assert first_differing_row(res.streams[0].gen_logits, alone[0].gen_logits) == 3
    assert same(res.streams[1], alone[1])


def test_too_many_streams_and_bad_offsets_are_refused(tiny_weights, prompts):
    with pytest.raises(ValueError, match=r"stream count must be an int in 1\.\.4 \(the batch limit\), got 5"):
        run_streams(tiny_weights, prompts + prompts[:1], GEN, "invariant")
    with pytest.raises(ValueError, match="got 0"):
        run_streams(tiny_weights, [], GEN, "invariant")
    with pytest.raises(ValueError, match="offset must be an int >= 0"):
        run_streams(tiny_weights, prompts[:2], GEN, "invariant", offset=-1)
    with pytest.raises(ValueError, match="gen_tokens must be an int >= 1"):
        run_streams(tiny_weights, prompts[:2], 0, "invariant")


TINY = {"profile": "test", "preset": "tiny", "device": "cpu", "dtype": "bfloat16", "prompts": ["short"],
        "prompt_max_tokens": 24, "steps": [16], "gen_tokens": 5, "deep_threshold": 512,
        "kernel_sets": ["invariant"], "stream_counts": [1, 2], "mtp_k": 2}


@pytest.fixture(scope="module")
def tiny_section():
    return section.run_section(dict(TINY))


def test_section_rows_and_equalities(tiny_section):
    data = tiny_section["data"]
    assert tiny_section["section"] == "streams"
    assert [r["draft"] for r in data["drafted"]] == ["mtp", "self (sanity)"]
    assert [(r["mode"], r["on_grid"]) for r in data["resumed"]] == [("grid", True), ("any", False)]
    assert [r["streams"] for r in data["concurrent"]] == [1, 2]
    for part in ("drafted", "resumed", "concurrent"):
        for r in data[part]:
            assert r["set"] == "invariant" and r["equal"] is True and r["reruns_equal"] is True, (part, r)
            assert r["failed"] == [] and r["compared"] == ["tokens", "logits", "kv"], (part, r)
    assert all(r["first_kv_diff_alone"] == [None] * r["streams"] for r in data["concurrent"])
    assert data["drafted"][1]["acceptance_rate"] == 1.0
    assert data["drafted"][0]["plain_hash"] == data["drafted"][0]["drafted_hash"] == data["resumed"][0]["fresh_hash"]
    json.dumps(tiny_section)  # JSON-ready


def test_section_render_md(tiny_section):
    md = streams_report.render_md(tiny_section)
    assert md == streams_report.render_md(tiny_section["data"])  # the receipt renderer passes the data object
    for head in ("drafted == plain", "resumed == fresh", "concurrent streams", "summary"):
        assert f"### {head}" in md
    assert tiny_section["data"]["drafted"][0]["plain_hash"] in md and "**no**" not in md


@pytest.mark.parametrize("bad, match", [({"mtp_k": 5}, "draft count k"), ({"mtp_k": 0}, "draft count k"),
                                        ({"stream_counts": [1, 5]}, "batch limit"),
                                        ({"prompt_cache_gib": -1}, "budget"), ({"drafts": ["eagle"]}, "eagle")])
def test_section_bad_params_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        section.section_params({**TINY, **bad})


def test_notebook_renders_a_precomputed_section(tmp_path, tiny_section):
    papermill = pytest.importorskip("papermill")
    src = tmp_path / "section.json"
    src.write_text(json.dumps(tiny_section))
    out_json = tmp_path / "out.json"
    papermill.execute_notebook(str(ROOT / "notebooks" / "40_streams.ipynb"), str(tmp_path / "out.ipynb"),
                               parameters={**TINY, "precomputed_json": str(src), "out_json": str(out_json)},
                               kernel_name="exactness", progress_bar=False)
    assert json.loads(out_json.read_text()) == tiny_section
