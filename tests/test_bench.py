"""The bench section (analysis/bench.py, bench_tables.py, notebooks/50_bench.ipynb) on the tiny preset: the metric
definitions of analysis/bench.py are computed as written, cold runs are exactly cold and exact-length, refused runs
show no numbers, bad parameters fail clearly, and the notebook renders a precomputed section."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from exactness.analysis import bench
from exactness.analysis import bench_runner
from exactness.analysis.bench_tables import cold_table, render_md, tables
from exactness.engines.reference import ReferenceEngine
from exactness.offload import ExpertStore
from exactness.prompts import build_prompt

ROOT = Path(__file__).resolve().parents[1]
PARAMS = dict(profile="ci", preset="tiny", device="cpu", dtype="bfloat16", prompts=["short"], prompt_max_tokens=16,
              gen_tokens=3, deep_threshold=8, kernel_sets=["invariant"], bench_path="deep", bench_step=8,
              bench_reps=2, bench_itl_reps=2, bench_cold_lengths=[16, 24], offload=False)


@pytest.fixture(scope="module")
def section():
    return bench.run_section(dict(PARAMS))


def test_section_shape_and_json(section):
    assert section["section"] == "bench"
    data = section["data"]
    json.dumps(section, allow_nan=False)                                     # JSON-ready, no tensors left
    assert set(data) >= {"config", "plain", "drafted", "itl", "cold", "streams", "memory", "not_run", "offload"}
    assert data["not_run"] == {}, data["not_run"]                              # mtp and streams are present
    assert [len(r["runs"]) for r in data["plain"]] == [2] and [len(r["runs"]) for r in data["itl"]] == [2, 2]
    assert data["config"]["prompt_cache"].startswith("off")


def test_metrics_follow_the_definitions(section):
    for row in section["data"]["plain"] + section["data"]["drafted"]:
        for r in row["runs"]:
            P, N = r["prompt_tokens"], r["generated"]
            assert N == PARAMS["gen_tokens"] and P == 16
            assert r["prefill_tps"] == pytest.approx(P / r["ttft_s"])
            span = r["last_token_s"] - r["ttft_s"]                             # last token - first token
            assert r["decode_tps"] == pytest.approx((N - 1) / span)
            assert r["itl_mean_ms"] == pytest.approx(span / (N - 1) * 1e3)
            assert r["itl_p50_ms"] <= r["itl_p95_ms"]
            assert r["cache_state"] == "cold" and r["prefilled_rows"] == P
            assert r["served"]["deep"]["rows"] == P                           # the bench path served the prefill


def test_timing_metrics_known_values():
    m = bench_runner.timing_metrics(10, 1.0, [1.0, 1.5, 2.0, 3.0])                   # gaps 500, 500, 1000 ms
    assert m["prefill_tps"] == 10 and m["decode_tps"] == 1.5
    assert m["itl_mean_ms"] == pytest.approx(2000 / 3) and m["itl_p50_ms"] == 500
    assert m["itl_p95_ms"] == pytest.approx(950)                              # numpy linear: 500 + 0.9 * 500
    one = bench_runner.timing_metrics(10, 1.0, [1.0])
    assert one["decode_tps"] is None and one["itl_mean_ms"] is None and one["generated"] == 1


def test_drafted_equals_plain_with_the_invariant_set(section):
    df = tables(section["data"])["drafted == plain"]
    assert list(df["drafted == plain (all reps)"]) == ["yes"]
    assert list(df["plain hash"]) == list(df["drafted hash"])


def test_streams_equal_their_run_alone(section):
    rows = section["data"]["streams"]
    assert [r["streams"] for r in rows] == [1, 2]
    for r in rows:
        assert r["failed"] == 0 and r["not_equal_to_alone"] == 0
        assert r["equal_to_alone"] == r["streams"] * PARAMS["bench_reps"]


def test_cold_prefill_is_exact_length_and_cold(section):
    rows = section["data"]["cold"]
    assert [r["requested"] for r in rows] == PARAMS["bench_cold_lengths"]
    for r in rows:
        assert r["qualified"] and r["refused_reps"] == []
        assert all(x["prompt_tokens"] == r["requested"] and x["cache_state"] == "cold" for x in r["runs"])


def test_a_run_that_hit_a_cache_is_refused(section):
    """Negative control: a cold run whose prefill skipped rows (as a prompt-cache resume would) is refused."""
    data = json.loads(json.dumps(section["data"]))
    run = data["cold"][0]["runs"][1]
    served = {"decode": {"segments": 0, "rows": 0}, "batched": {"segments": 1, "rows": 4},
              "deep": {"segments": 0, "rows": 0}}
    hit = bench_runner._record("plain", torch.zeros(16, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), served,
                        run["ttft_s"], [run["ttft_s"], 1.0, 2.0], None)
    assert hit["cache_state"] == "hit (12 rows not prefilled)"
    data["cold"][0].update(qualified=False, refused_reps=[1])
    data["cold"][0]["runs"][0] = bench._strip(hit)
    row = cold_table(data).iloc[0]
    assert row["verdict"].startswith("refused")
    assert row["cold prefill TTFT s"] == "–" and row["prefill tok/s"] == "–"


def test_exact_length_ids():
    code, docs = build_prompt("code", 10).ids, build_prompt("docs", 7).ids
    for n in (1, 10, 13, 40):
        ids = bench.exact_length_ids(n, [code, docs])
        assert ids.shape == (n,) and ids.dtype == torch.int64 and int(ids[0]) == 256
    expect = torch.cat([code, docs[1:], code[1:], docs[1:], code[1:]])[:40]
    assert torch.equal(bench.exact_length_ids(40, [code, docs]), expect)
    assert int((bench.exact_length_ids(40, [code, docs]) == 256).sum()) == 1  # one BOS, at the start


@pytest.mark.parametrize("change, message", [
    ({"bench_cold_lengths": [64, 40000]}, "bench_cold_lengths entry 40000 with 3 generated tokens is 40003 "
                                          "positions, past the max_positions=32768"),
    ({"bench_cold_lengths": [1]}, "every bench_cold_lengths entry must be an int >= 2, got 1"),
    ({"bench_path": "fastest"}, "bench_path 'fastest' is not a path; allowed: decode, batched, deep"),
    ({"bench_reps": 0}, "bench_reps must be an int >= 1, got 0"),
    ({"bench_step": -2}, "bench_step must be an int >= 1, got -2"),
    ({"offload": "yes"}, "offload must be true or false, got 'yes'"),
])
def test_bad_parameters_fail_before_any_run(change, message):
    with pytest.raises(ValueError, match=message):
        bench.run_section({**PARAMS, **change})


def test_offload_load_keeps_experts_on_the_host():
    p = bench.bench_params({**PARAMS, "offload": True})
    w, store, _ = bench._load(p)
    assert store.weights is w and store.deep_ready and store.ring_bytes == bench.RING_SLOTS * store.expert_bytes
    assert all(lw.w_gate.numel() == 0 for lw in w.layers) and store.device_bytes_saved > 0


def test_runner_says_when_the_ring_is_missing(tiny_weights):
    store = ExpertStore(tiny_weights, "offload", max_ring_bytes=0)
    runner = bench_runner.Runner(ReferenceEngine(store.weights, None, "fast", experts=store), bench.bench_params(PARAMS))
    rec = runner.plain(build_prompt("short", 12).ids, "fast", 2)
    assert "expert ring not reserved" in rec["path_served"] and "max_ring_bytes=0" in rec["path_served"]


def test_not_run_markers_render(section, tiny_weights):
    data = json.loads(json.dumps(section["data"]))
    data.update(drafted=[], not_run={"drafted": "not run: mtp missing (No module named 'exactness.mtp')"})
    md = render_md({"section": "bench", "data": data})
    assert md.count("_not run: mtp missing") == 2                             # drafted table and drafted == plain
    assert bench._not_run(ReferenceEngine(tiny_weights)) == {}


def test_render_md(section):
    md = render_md(section)
    assert md == render_md(section["data"])
    for title in tables(section["data"]):
        assert f"### {title}" in md
    assert section["data"]["plain"][0]["runs"][0]["hash"] in md
    assert "| kernels" in md and len(md) < 65_536


def test_notebook_renders_a_precomputed_section(section, tmp_path):
    import papermill
    pre = tmp_path / "bench.json"
    pre.write_text(json.dumps(section))
    out = tmp_path / "out.json"
    nb = papermill.execute_notebook(str(ROOT / "notebooks" / "50_bench.ipynb"), str(tmp_path / "50.ipynb"),
                                    parameters={"precomputed_json": str(pre), "out_json": str(out)},
                                    kernel_name="exactness", progress_bar=False)
    assert json.loads(out.read_text()) == section
    text = json.dumps([c.get("outputs", []) for c in nb.cells])
    assert "Cold-cache prefill" in text and section["data"]["plain"][0]["runs"][0]["hash"] in text
    assert np.isfinite(section["data"]["cold"][0]["runs"][0]["ttft_s"])


def test_sections_computed_per_kernel_set_merge_into_one(section):
    """merge_sections joins per-set bench sections (one device call each) table by table; it refuses overlapping
    sets and parts whose settings differ, and the merged section renders like a two-set run."""
    fast = bench.run_section({**PARAMS, "kernel_sets": ["fast"]})
    merged = bench.merge_sections([fast, section])
    assert merged["data"]["config"]["kernel_sets"] == ["fast", "invariant"]
    for table in ("plain", "drafted", "itl", "cold", "streams", "memory"):
        got = [r["kernels"] for r in merged["data"][table]]
        assert got == [r["kernels"] for r in fast["data"][table]] + [r["kernels"] for r in section["data"][table]]
    assert "fast" in render_md(merged) and "invariant" in render_md(merged)
    with pytest.raises(ValueError, match=r"overlap in kernel sets \['invariant'\]"):
        bench.merge_sections([section, section])
    prov = bench.merge_sections([{**fast, "provenance": {"computed_on": "H200", "command": "a"}},
                                 {**section, "provenance": {"computed_on": "H200", "command": "b"}}])["provenance"]
    assert prov["computed_on"] == "H200" and prov["command"] == "a | b"
    other = json.loads(json.dumps(fast))
    other["data"]["config"]["gen_tokens"] = 192
    with pytest.raises(ValueError, match="differ in gen_tokens: 192 vs 3|differ in gen_tokens: 3 vs 192"):
        bench.merge_sections([section, other])
    with pytest.raises(ValueError, match="two or more bench sections"):
        bench.merge_sections([section])


def test_streams_table_keeps_the_first_run_apart_from_the_repeats(section):
    """A first concurrent run slowed by something once (a kernel compiled mid-decode) shows in the cold columns
    only; the warm columns are the median of the repeats. Control: the section's own rows, cold and warm each
    from their own repetition."""
    data = json.loads(json.dumps(section["data"]))
    row = data["streams"][1]
    slow = dict(row["reps"][0], aggregate_tps=10.0, itl_mean_ms=90.0, end_to_end_tps=5.0)
    row["reps"] = [slow] + [dict(row["reps"][1], aggregate_tps=v, itl_mean_ms=1000 / v) for v in (100.0, 300.0, 200.0)]
    t = tables(data)["Concurrent streams"].iloc[1]
    assert (t["aggregate tok/s cold"], t["mean ITL ms cold"], t["end-to-end tok/s cold"]) == ("10.0", "90.00", "5.0")
    assert (t["aggregate tok/s warm"], t["mean ITL ms warm"]) == ("200.0", "5.00")          # medians of reps 1..
    own = tables(section["data"])["Concurrent streams"]
    for (_, r), src in zip(own.iterrows(), section["data"]["streams"]):
        assert r["aggregate tok/s cold"] == format(src["reps"][0]["aggregate_tps"], ".1f")
        assert r["aggregate tok/s warm"] == format(src["reps"][1]["aggregate_tps"], ".1f")
    assert "per-stream tok/s" not in own.columns
