"""The counts of the hash matrix run on engines, as GitHub markdown and a notebook plot (analysis/repeat.py computes
them): the repeat test's table (level, N, distinct completions, largest share, where they part) and, with many prompts, one
row per engine and configuration (prompts with the oracle's tokens, a text histogram of first-divergence positions,
the smallest oracle margin at a flip) instead of one row per prompt and configuration."""
from __future__ import annotations

from ..tables import table
from ..tables import md_escape

HIST_BINS = 8        # text histogram: at most this many position bins
SHOWN_GROUPS = 6     # distinct completions listed per level (their count is always whole)

REPEAT_INTRO = ("One prompt sent N times, greedily, at each concurrency level (requests in flight at once); "
                "completions are told apart by their exact token ids (or exact text bytes where a server returns "
                "text only). **parts at**: the first generated position where each less common completion leaves "
                "the most common one. A failed request is an error of the test, and a reply whose chosen token was "
                "not the top-1 of its logprobs is not greedy: neither is counted as a completion.")


def _share(v) -> str:
    return "none" if v is None else f"{100 * v:.1f}%"


def _groups(level: dict) -> tuple[str, str]:
    """(counts of each distinct completion, where each minority one parts), most common first."""
    gs = level.get("groups") or []
    more = level.get("distinct", 0) - min(len(gs), SHOWN_GROUPS)
    tail = f" (+{more} more)" if more > 0 else ""
    counts = ", ".join(str(g["count"]) for g in gs[:SHOWN_GROUPS]) + tail
    parts = ", ".join(str(g["parts_at"]) for g in gs[1:SHOWN_GROUPS]) + (tail if len(gs) > 1 else "")
    return counts or "none", parts or "one completion"


def repeat_table(repeat: dict) -> str:
    """One row per (engine, configuration, concurrency level) of ``section["repeat"]``."""
    rows = []
    for label, res in repeat.items():
        for config, levels in res["configs"].items():
            for lv in levels:
                counts, parts = _groups(lv)
                rows.append([label, config, res["prompt"], lv["concurrency"], lv["requests"], lv["failed"],
                             lv.get("not_greedy"), lv["distinct"], _share(lv["largest_share"]), lv["first_parting"],
                             counts, parts, lv["compared_as"], lv["largest_batch"]])
    return table(rows, ["engine", "configuration", "prompt", "concurrency", "N", "failed", "not greedy",
                        "distinct completions", "largest share", "first parting position", "count of each",
                        "parts at", "compared as", "largest batch (rows)"], dash="none, or not reported by the engine")


def repeat_block(repeat: dict) -> str:
    """receipt.md's block of the repeat test: intro, the table, what was not available."""
    out = ["### The same request N times under load", "", REPEAT_INTRO, "", repeat_table(repeat)]
    na = [f"- **{md_escape(label)}** {md_escape(config)}: {md_escape(why)}" for label, res in repeat.items()
          for config, why in (res.get("not_available") or {}).items()]
    return "\n".join(out + ([""] + na if na else []))


def bins(positions: list[int], gen_tokens: int, n: int = HIST_BINS) -> list[tuple[int, int, int]]:
    """(first, last, count) of each non-empty bin of first-divergence ``positions`` over 0..gen_tokens-1 (at most
    ``n`` bins of equal width)."""
    width = max(1, -(-max(gen_tokens, max(positions, default=0) + 1) // n))
    counts: dict[int, int] = {}
    for p in positions:
        counts[p // width] = counts.get(p // width, 0) + 1
    return [(b * width, b * width + width - 1, c) for b, c in sorted(counts.items())]


def histogram_text(positions: list[int], gen_tokens: int) -> str:
    """``"0–7: 3 · 8–15: 1"`` (first-divergence positions per bin; ``"2: 1"`` for a one-position bin), or
    ``"no flip"``."""
    return " · ".join(f"{a if a == b else f'{a}–{b}'}: {c}" for a, b, c in bins(positions, gen_tokens)) or "no flip"


def counts_table(counts: list[dict]) -> str:
    """One row per (engine, configuration) of ``section["prompt_counts"]``."""
    rows = [[c["engine"], c["config"], f"{c['tokens_equal']} of {c['prompts']}",
             f"{c['parts_equal']} of {c['prompts']}", histogram_text(c["divergence"], c["gen_tokens"]),
             c["min_flip_margin"], c["min_flip_prompt"]] for c in counts]
    return table(rows, ["engine", "configuration", "prompts with the oracle's tokens", "prompts equal in every part",
                        "first divergent token (position: prompts)", "smallest oracle top-1 margin at a flip",
                        "at prompt"], dash="no flip, or no oracle logits exposed")


def counts_block(section: dict) -> str:
    """The many-prompts summary that replaces the hash matrix table in receipt.md."""
    n = len({r["prompt"] for r in section.get("rows") or []})
    return "\n".join([f"{n} prompts: counts per configuration against its engine's oracle instead of one row per "
                      f"run (every row is in receipt.json).", "", counts_table(section["prompt_counts"])])


def plot_divergence(section: dict):
    """A matplotlib figure: per engine, a histogram of first-divergence positions, one step line per
    configuration; None without prompt_counts."""
    counts = section.get("prompt_counts") or []
    if not counts:
        return None
    import matplotlib.pyplot as plt
    engines = list(dict.fromkeys(c["engine"] for c in counts))
    fig, axes = plt.subplots(1, len(engines), figsize=(5.5 * len(engines), 3.4), squeeze=False, layout="constrained")
    for ax, eng in zip(axes[0], engines):
        for c in (c for c in counts if c["engine"] == eng):
            label = f"{c['config']}: {c['prompts'] - c['tokens_equal']} of {c['prompts']} flip"
            if c["divergence"]:
                ax.hist(c["divergence"], bins=range(0, max(c["gen_tokens"], max(c["divergence"]) + 1) + 1),
                        histtype="step", label=label)
            else:
                ax.plot([], [], label=label + " (none)")
        ax.set_title(str(eng), loc="left", fontsize=9)
        ax.set_xlabel("first divergent generated token")
        ax.set_ylabel("prompts")
        ax.legend(fontsize=7)
    return fig
