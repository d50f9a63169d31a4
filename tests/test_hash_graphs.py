"""hash_graphs: the hash matrix replays its runs' decode steps from CUDA graphs on a CUDA device only.

On a CPU device graphs are never tried: every generate call gets graphs=False, every row records ``graphs`` None
(not tried, so nothing to say why) and the section's rows are those of hash_graphs=False, timings aside. A run that
does ask for graphs on the CPU (run_prompt with graphs=True) records why none served, with the eager bytes. The GPU
side (prompt rows replayed, bytes equal) is tests/test_cuda_graphs.py's.
"""
from __future__ import annotations

import pytest

from exactness.analysis import hashes, hashes_report
from exactness.analysis.hashes_report import graphs_summary, summary_table
from exactness.engines import reference
from exactness.prompts import build_prompt

BASE = dict(preset="tiny", device="cpu", dtype="bfloat16", prompts=["short"], prompt_max_tokens=None, steps=[16],
            gen_tokens=4, deep_threshold=16, kernel_sets=["invariant"], hash_rerun=False)
TIMINGS = ("ttft_s", "decode_s", "seconds")


def same_rows(a: list[dict], b: list[dict], ignore: tuple = ()) -> bool:
    """Rows equal field by field, timings and ``ignore`` aside (hashes, byte verdicts, first differences)."""
    def strip(r):
        return {k: v for k, v in r.items() if k not in TIMINGS + ignore}
    return len(a) == len(b) and all(strip(x) == strip(y) for x, y in zip(a, b))


@pytest.fixture
def calls(monkeypatch) -> list:
    """The ``graphs`` argument of every generate call the hash matrix makes."""
    seen, generate = [], reference.generate

    def spy(*args, graphs=False, **kw):
        seen.append(graphs)
        return generate(*args, graphs=graphs, **kw)
    monkeypatch.setattr(reference, "generate", spy)   # where our engine's runs call it
    return seen


def test_on_the_cpu_hash_graphs_tries_nothing_and_changes_nothing(calls):
    on = hashes.run_section({**BASE, "hash_graphs": True})
    assert calls and not any(calls)                     # decode, batched@16, deep@16: none asked for graphs
    off = hashes.run_section({**BASE, "hash_graphs": False})
    assert len(calls) == 6 and not any(calls)
    assert all(r["graphs"] is None for r in on["rows"] + off["rows"])
    assert same_rows(on["rows"], off["rows"]) and on["curves"] == off["curves"]
    assert "CUDA graphs" not in hashes_report.render_md(on) and graphs_summary(on["rows"]) is None
    assert "graphs" not in summary_table(on["rows"]).columns
    planted = [dict(r) for r in on["rows"]]             # negative control: one row's hash changed
    planted[1]["hash"] = "0" * 12
    assert not same_rows(planted, off["rows"])


def test_a_cpu_run_that_asks_for_graphs_records_why_none_served(tiny_weights, calls):
    prompt = build_prompt("short")
    args = (tiny_weights, prompt, ["invariant"], [16], 4, 16)
    eager = hashes.run_prompt(*args)
    rows = hashes.run_prompt(*args, graphs=True)
    assert calls == [False] * 3 + [True] * 3            # the spy sees graphs=True when it is asked for
    P = prompt.n_tokens
    steps = {r["path"]: r["graphs"]["eager_steps"] for r in rows}
    assert steps == {"decode": P + 3, "batched": 3, "deep": 3}   # the oracle's prompt rows: eager decode steps too
    assert rows[0]["graphs"]["prompt"].startswith("eager: CUDA graphs need a CUDA device")
    assert all("prompt" not in r["graphs"] for r in rows[1:])  # said only of the decode path
    for r in rows:
        assert r["graphs"]["served"] is False and r["graphs"]["replays"] == 0
        assert "CUDA device" in r["graphs"]["reason"] and "cpu" in r["graphs"]["reason"]
    assert same_rows(rows, eager, ignore=("graphs",))   # the eager steps ran: the same hashes and byte verdicts
    assert all(r["equals_oracle"] and r["prompt_logits_equal"] and r["kv_equal"] for r in rows)
    summary = graphs_summary(rows)
    assert summary.startswith("replayed in 0 of 3 runs; not in 3: CUDA graphs need a CUDA device")
    assert hashes_report.graphs_line(rows) == ("CUDA graphs (decode steps, the oracle's prompt rows included): "
                                            f"invariant: {summary}")
    assert summary_table(rows).columns["graphs"]


def test_the_graphs_summary_counts_replayed_runs_and_each_reason():
    store = "experts come from ExpertStore, which stages them on the host per call"
    rows = [{"kernels": "fast", "graphs": {"served": True, "reason": None}},
            {"kernels": "fast", "graphs": {"served": False, "reason": store}},
            {"kernels": "fast", "graphs": {"served": False, "reason": store}},
            {"kernels": "invariant", "graphs": {"served": False, "reason": None}},   # no step after the first
            {"kernels": "invariant", "graphs": None}]                               # not tried: not counted
    assert graphs_summary(rows[:3]) == f"replayed in 1 of 3 runs; not in 2: {store}"
    assert graphs_summary(rows[3:]) == "replayed in 0 of 1 runs; not in 1: no step to replay"
    assert graphs_summary(rows[4:]) is None
    one_row = {"served": True, "reason": None, "prompt": "eager: a one-row prompt: its row captured the graph"}
    assert graphs_summary([{"kernels": "fast", "graphs": one_row}]) == (
        "replayed in 1 of 1 runs; oracle prompt rows eager: a one-row prompt: its row captured the graph (1 runs)")
    line = hashes_report.graphs_line(rows)
    assert line.count(" | ") == 1 and "fast: replayed in 1 of 3 runs" in line
