"""The receipt's plots say only what they draw: every curve a title or legend names is visible, exact runs are
listed as exact (not as lines), and a figure legend has one entry per series and sits clear of the panels."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from exactness.analysis.fp64 import report as fp64_report  # noqa: E402
from exactness.analysis import hashes_report  # noqa: E402


def _curve(kernels, path, y, offload=False):
    return {"prompt": "p", "kernels": kernels, "path": path, "step": 8, "offload": offload, "bin_width": 2,
            "max_abs_diff": y}


def test_plot_curves_draws_every_named_curve_and_lists_exact_runs():
    section = {"curves": [_curve("fast", "batched", [0, 0.1, 0, 0.2]),
                          _curve("fast", "batched", [0, 0.1, 0, 0.2], offload=True),  # identical: shares a panel
                          _curve("fast", "deep", [0, 0, 0.5, 0]),                      # one isolated position
                          _curve("invariant", "batched", [0, 0, 0, 0]), _curve("invariant", "deep", [0, 0, 0, 0])]}
    fig = hashes_report.plot_curves(section)
    drawn = [ax for ax in fig.axes if ax.lines]
    assert sorted(ax.get_title(loc="left") for ax in drawn) == [
        "p: fast batched@8 (resident and offloaded)", "p: fast deep@8"]
    for ax in drawn:
        (line,) = ax.lines
        assert np.isfinite(line.get_ydata()).any() and line.get_marker() not in (None, "", "None")
    texts = " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert "exact" in texts and "invariant: all 2 runs" in texts
    assert not any("invariant" in ax.get_title(loc="left") for ax in drawn)
    plt.close(fig)


def test_ulp_hist_has_one_legend_entry_per_series_clear_of_the_panels():
    hist = {f"{cls}|{path}|{ks}|{iset}|{dt}|K{k}": [5, 3, 1, 1]
            for cls in ("dense", "router", "rope", "rmsnorm")
            for path in ("decode", "batched", "deep") for ks in ("fast", "invariant")
            for iset in ("captured", "outliers") for dt in ("bfloat16", "float32") for k in (64, 128)}
    fig = fp64_report.plot_ulp_hist({"meta": {"hist_edges": [0, 1, 2, 4]}, "hist": hist}, "captured")
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert len(labels) == len(set(labels)) == 6 and labels[0] == "decode / fast"
    assert not any(ax.get_legend() for ax in fig.axes)
    fig.canvas.draw()
    box = legend.get_window_extent()
    assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes if ax.axison)
    plt.close(fig)
