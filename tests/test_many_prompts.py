"""Many prompts read as counts (analysis/repeat.py prompt_counts, analysis/repeat_md.py): a generated .jsonl file of
120 short ids prompts on the tiny reference engine (fast set) with a planted fault in its batched path; the
summary's counts, histogram and smallest flip margin equal what the rows say, receipt.md shows the summary instead
of one row per run, and every row stays in the section."""
from __future__ import annotations

import json
import random
import re

import matplotlib
import pytest

matplotlib.use("Agg")

from exactness.analysis import engines as E  # noqa: E402
from exactness.analysis import engines_md  # noqa: E402
from exactness.analysis.repeat import MANY_PROMPTS, many_prompts, prompt_counts  # noqa: E402
from exactness.analysis.repeat_md import bins, counts_block, histogram_text, plot_divergence  # noqa: E402
from exactness.config import get_preset  # noqa: E402
from exactness.engines.reference import ReferenceEngine  # noqa: E402
from exactness.kernels import KernelSet  # noqa: E402
from exactness.weights import synthetic_weights  # noqa: E402
from faults import row0_perturbed  # noqa: E402

N_PROMPTS, GEN = 120, 4


def _faulty_fast() -> KernelSet:
    """The fast set (quick on the CPU) with RMSNorm scaled by 1.125 on row 0 of every multi-row prompt call."""
    return row0_perturbed("rmsnorm", lambda t: t * 1.125, roles=("prompt",), base="fast")


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    """The engines section's rows and counts of 120 ids prompts (6 to 10 ids each) under _faulty_fast (prompt rows
    of the batched path; the decode oracle makes no multi-row call)."""
    rng = random.Random(7)
    path = tmp_path_factory.mktemp("many") / "many.jsonl"
    path.write_text("".join(json.dumps({"name": f"p{i:03d}", "ids": [rng.randrange(1, 256) for _ in
                                                                      range(rng.randrange(6, 11))]}) + "\n"
                            for i in range(N_PROMPTS)))
    eng = ReferenceEngine(synthetic_weights(get_preset("tiny")), None, _faulty_fast())
    records = []
    prompts = E.build_prompts(eng, [str(path)], None, False, records)
    rows = [{**r, "engine": "reference:faulty"} for r in E.hash_rows(eng, prompts, GEN)]
    sec = {"section": "hashes", "engines": [{"spec": "reference:faulty", "oracle": "decode"}], "rows": rows,
           "streams": {}, "errors": [], "cross": []}
    if many_prompts(rows):
        sec["prompt_counts"] = prompt_counts(rows)
    return sec


def test_every_row_stays_and_the_counts_equal_the_rows(section):
    rows = section["rows"]
    assert len({r["prompt"] for r in rows}) == N_PROMPTS > MANY_PROMPTS and len(rows) == 2 * N_PROMPTS
    (c,) = section["prompt_counts"]                    # one configuration besides the oracle: batched
    runs = [r for r in rows if r["config"] == "batched"]
    flips = [r for r in runs if r["first_divergence"] is not None]
    assert (c["engine"], c["config"], c["prompts"]) == ("reference:faulty", "batched", N_PROMPTS)
    assert c["tokens_equal"] == sum(r["equals_oracle"] for r in runs) == N_PROMPTS - len(flips)
    assert c["parts_equal"] == sum(r["verdict"].startswith("equal") for r in runs)
    assert c["divergence"] == sorted(r["first_divergence"] for r in flips)
    margins = [r["oracle_margin"] for r in flips]
    assert c["min_flip_margin"] == min(margins) and c["min_flip_prompt"] in {r["prompt"] for r in flips}
    assert flips, "negative control: the planted fault must flip some prompt's greedy tokens"
    assert c["parts_equal"] == 0                       # every batched run's prompt rows differ (row 0 perturbed)
    print(f"{len(flips)} of {N_PROMPTS} prompts flip; first divergences {histogram_text(c['divergence'], GEN)}; "
          f"smallest oracle margin at a flip {c['min_flip_margin']:.4g}")


def test_histogram_bins_hold_every_flip():
    assert bins([0, 0, 3, 5, 17, 63], 64) == [(0, 7, 4), (16, 23, 1), (56, 63, 1)]
    assert bins([70], 64) == [(63, 71, 1)]                  # a position past gen_tokens widens the bins
    assert histogram_text([0, 0, 3, 5, 17, 63], 64) == "0–7: 4 · 16–23: 1 · 56–63: 1"
    assert histogram_text([0, 2, 2], 4) == "0: 1 · 2: 2" and histogram_text([], 64) == "no flip"


def test_receipt_md_shows_counts_not_a_row_per_run(section):
    md = engines_md.render_md(section)
    c = section["prompt_counts"][0]
    shown = [f"p{i:03d}" for i in range(N_PROMPTS) if f"p{i:03d}" in md]
    assert shown == [c["min_flip_prompt"]]                  # no row per prompt: only the smallest flip is named
    line = next(ln for ln in md.splitlines() if ln.startswith("| reference:faulty") and f"of {N_PROMPTS}" in ln)
    cells = [x.strip() for x in line.strip("|").split("|")]
    assert cells[2] == f"{c['tokens_equal']} of {N_PROMPTS}" and cells[3] == f"0 of {N_PROMPTS}"
    hist = [int(n) for n in re.findall(r": (\d+)", cells[4])]
    assert sum(hist) == N_PROMPTS - c["tokens_equal"]
    assert f"{N_PROMPTS} prompts: counts per configuration" in counts_block(section)


def test_notebook_plot_draws_the_flips(section):
    fig = plot_divergence(section)
    (ax,) = fig.axes
    c = section["prompt_counts"][0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [f"batched: {N_PROMPTS - c['tokens_equal']} of {N_PROMPTS} flip"]
    assert ax.patches, "the histogram of first divergences is drawn"
    assert plot_divergence({"rows": []}) is None
