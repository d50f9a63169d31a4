"""Views of the ``streams`` section (analysis/streams.py computes it): intro and verdict, and its five tables, as
display blocks (blocks.py: the notebook shows them, ``render_md`` prints them as GitHub markdown).
"""
from __future__ import annotations

from ..blocks import Block, heading, table, text, to_markdown
from ..tables import Table

INTRO = ("Four serving paths, each against the path it must reproduce, per kernel set: drafted (MTP) decode "
         "against plain decode, a request resumed from the prompt cache against a fresh prefill, N concurrent "
         "streams against each stream run alone and against serial decode, and N prompts prefilled packed into one "
         "forward against each prompt's prefill alone. Tokens are compared by hash, logits and "
         "KV caches byte for byte; a configuration is *equal* only when every compared quantity matched in every "
         "repetition (each runs twice), and *reruns equal* says the repetitions were byte-identical.")
_EQ = ("equal", "differs")
_DASH_DIV = "no divergence: the tokens are equal"
# The concurrent part counts a configuration equal only when every stream equals its run alone and the serial decode.
PART_TITLES = {"drafted": "drafted == plain", "resumed": "resumed == fresh",
               "concurrent": "concurrent == alone == serial", "packed": "packed == alone"}


def _reruns(r: dict) -> str:
    """``yes``, or ``no`` naming the runs whose repetitions differed."""
    bad = [k for k, v in (r.get("reruns") or {}).items() if not v]
    return "yes" if r["reruns_equal"] else "no" + (f" ({', '.join(bad)})" if bad else "")


def _failed(r: dict) -> str:
    """What differed (``tokens, logits, kv``, and against what for concurrent rows), or ``nothing``."""
    vs = r.get("failed_vs")
    if vs:
        parts = [f"{', '.join(f)} vs {ref}" for ref, f in vs.items() if f]
        return "; ".join(parts) or "nothing"
    return ", ".join(r.get("failed") or []) or "nothing"


def _compared(r: dict) -> str:
    return " + ".join(r.get("compared") or ["tokens"])


def _rate(v) -> str | None:
    return None if v is None else f"{100 * v:.1f}%"


def drafted_table(rows: list[dict]) -> Table:
    """The drafted rows: does drafted decode give plain decode's tokens (and logits and KV bytes)?"""
    recs = [{**r, "prompt_text": f"{r['prompt']} ({r['prompt_tokens']})", "draft_text": f"{r['draft']}, k={r['k']}",
             "acc": f"{r['accepted']} of {r['proposed']}", "rate": _rate(r["acceptance_rate"]),
             "reruns_text": _reruns(r), "failed_text": _failed(r), "compared_text": _compared(r)} for r in rows]
    return Table(recs, {"set": "set", "prompt_text": "prompt (tokens)", "draft_text": "draft",
                        "plain_hash": "plain hash", "drafted_hash": "drafted hash",
                        "equal": "drafted == plain (all reps)", "compared_text": "verdict on",
                        "failed_text": "differs in", "first_divergence": "first differing token",
                        "logits_bytes_equal": "logits bytes", "kv_bytes_equal": "KV bytes",
                        "acc": "drafts accepted", "rate": "acceptance", "reruns_text": "reruns equal"},
                 words={"equal": ("yes", "no"), "logits_bytes_equal": _EQ, "kv_bytes_equal": _EQ},
                 dash=_DASH_DIV, notes=["The `self (sanity)` rows draft with the main model itself: acceptance is "
                                        "100% exactly when verify rows reproduce decode rows."])


def resumed_table(rows: list[dict]) -> Table:
    """The resumed rows: does a request resumed from the prompt cache equal a fresh one?"""
    def first(r):
        vals = (r["first_divergence"], r["first_tail_row_diff"], r["first_kv_position_diff"])
        return None if all(v is None for v in vals) else " / ".join("none" if v is None else str(v) for v in vals)
    recs = [{**r, "prompt_text": f"{r['prompt']} ({r['prompt_tokens']})",
             "at": f"{r['split']} ({'on' if r['on_grid'] else 'off'} the grid of {r['step']})",
             "logits": r["tail_logits_equal"] and r["gen_logits_equal"], "first": first(r),
             "reruns_text": _reruns(r), "failed_text": _failed(r)} for r in rows]
    return Table(recs, {"set": "set", "prompt_text": "prompt (tokens)", "mode": "mode",
                        "at": "resumed at (tokens)", "fresh_hash": "fresh hash", "resumed_hash": "resumed hash",
                        "tokens_equal": "tokens", "logits": "logits bytes", "kv_bytes_equal": "KV bytes",
                        "equal": "resumed == fresh", "failed_text": "differs in",
                        "first": "first difference: token / logits row / KV position", "reruns_text": "reruns equal"},
                 words={"tokens_equal": _EQ, "logits": _EQ, "kv_bytes_equal": _EQ},
                 dash="no difference: tokens, logits and KV bytes all equal")


def _streams_text(r: dict) -> str:
    return ", ".join(f"{s['prompt']}:{s['tokens']}@{s['join_step']}" for s in r["stream_prompts"])


def _count(c: dict) -> str:
    n = c["eq"] + c["neq"] + c["fail"]
    return f"{c['eq']} of {n}" + (f" ({c['fail']} failed)" if c["fail"] else "")


def _divs(v) -> str | None:
    return None if v is None else ", ".join("none" if d is None else str(d) for d in v)


def _vs_alone(rows: list[dict], unit: str, order: str, cells, heads: dict[str, str], **table) -> Table:
    """N ``unit``s run in one call against each run alone (the concurrent and packed parts): the columns named in
    ``order`` (space-separated keys); the cells and headers both parts have (set, N, equal to alone, all equal,
    differs in, reruns equal) here, the part's own from ``cells(row) -> dict`` and ``heads`` (key -> header);
    ``table``: Table's dash and notes."""
    shared = {"set": "set", "streams": f"{unit}s N", "alone": f"{unit}s equal to alone ({unit}s × reps)",
              "equal": "all equal", "failed_text": "differs in", "reruns_text": "reruns equal", **heads}
    recs = [{**r, "alone": _count(r["equal_to_alone"]), "reruns_text": _reruns(r), "failed_text": _failed(r),
             **cells(r)} for r in rows]
    return Table(recs, {k: shared[k] for k in order.split()}, **table)


def concurrent_table(rows: list[dict]) -> Table:
    """The concurrent rows: N streams decoded in one batch against each stream alone and against serial decode."""
    def cells(r):
        return {"prompts": _streams_text(r), "serial": _count(r["equal_to_serial"]),
                "div_alone": _divs(r["first_divergence_alone"]), "div_serial": _divs(r["first_divergence_serial"]),
                "kv_alone": _divs(r.get("first_kv_diff_alone"))}
    return _vs_alone(
        rows, "stream", "set streams prompts alone serial equal failed_text kv_alone div_alone div_serial reruns_text",
        cells, {"prompts": "stream prompts (prompt:tokens@join step)",
                "serial": "streams equal to serial decode (streams × reps)",
                "kv_alone": "first differing KV position vs alone, per stream",
                "div_alone": "first differing token vs alone, per stream",
                "div_serial": "first differing token vs serial, per stream"},
        dash="no run to compare (every repetition failed)",
        notes=["A stream counts as equal only when its tokens, its logits bytes (prompt and generated rows) and its "
               "KV bytes are equal. \"none\" under first differing token means the stream's tokens are equal; a "
               "stream can keep its tokens while its logits or KV bytes differ, and then it does not count as equal."])


def packed_table(rows: list[dict]) -> Table:
    """The packed rows: N prompts prefilled in one forward against each prompt's prefill alone."""
    def cells(r):
        return {"prompts": ", ".join(f"{s['prompt']}:{s['tokens']}" for s in r["stream_prompts"]),
                "div": _divs(r["first_divergence_alone"]), "row": _divs(r["first_prompt_row_diff_alone"]),
                "kv": _divs(r["first_kv_diff_alone"])}
    return _vs_alone(
        rows, "prompt", "set streams plan prompts alone equal failed_text div row kv reruns_text", cells,
        {"plan": "plan", "prompts": "prompts (prompt:tokens)", "div": "first differing token, per prompt",
         "row": "first differing prompt-logit row, per prompt", "kv": "first differing KV position, per prompt"},
        dash="no packed configuration (stream counts below 2)",
        notes=["A packed prompt counts as equal only when its tokens, its logits bytes (prompt and generated rows) "
               "and the KV bytes of its cache slot equal its prefill alone; \"none\": nothing of that kind differs "
               "for that prompt."])


def summary_rows(data: dict) -> list[dict]:
    """Per (part, kernel set): configurations, how many are equal, how many reruns are equal, and for drafted rows
    the MTP acceptance rate over all prompts (accepted / proposed)."""
    out = []
    for part in ("drafted", "resumed", "concurrent", "packed"):
        for ks in dict.fromkeys(r["set"] for r in data.get(part, [])):
            rows = [r for r in data[part] if r["set"] == ks]
            mtp = [r for r in rows if r.get("draft") == "mtp"]
            prop = sum(r["proposed"] for r in mtp)
            out.append({"part": part, "set": ks, "configurations": len(rows),
                        "equal": sum(bool(r["equal"]) for r in rows),
                        "reruns_equal": sum(bool(r["reruns_equal"]) for r in rows),
                        "mtp_acceptance": sum(r["accepted"] for r in mtp) / prop if prop else None})
    return out


def summary_table(data: dict) -> Table:
    """summary_rows as a table."""
    recs = [{**r, "part": PART_TITLES.get(r["part"], r["part"]), "eq": f"{r['equal']} of {r['configurations']}",
             "rr": f"{r['reruns_equal']} of {r['configurations']}", "acc": _rate(r["mtp_acceptance"])}
            for r in summary_rows(data)]
    return Table(recs, {"part": "equality", "set": "set", "configurations": "configurations", "eq": "equal",
                        "rr": "reruns equal", "acc": "MTP acceptance"},
                 dash="no MTP drafts in this part")


def verdict_md(data: dict) -> str:
    """Markdown, one line per equality: configurations equal, per kernel set."""
    by: dict[str, list[str]] = {}
    for r in summary_rows(data):
        by.setdefault(r["part"], []).append(f"{r['set']} {r['equal']} of {r['configurations']}")
    lines = [f"- **{PART_TITLES.get(p, p)}**: " + "; ".join(v) + " configurations equal." for p, v in by.items()]
    return "**Verdict.**\n\n" + "\n".join(lines) if lines else "_No configurations were run._"


def settings_md(data: dict) -> str:
    """One line: repetitions, prefill path and step, generated tokens, MTP weights and the verify forward."""
    st = data.get("settings", {})
    return (f"{st.get('reps', '?')} repetitions per configuration; prefill {st.get('prefill_path')} at step "
            f"{st.get('steps', ['?'])[0]} (P // 3 for shorter prompts); {st.get('gen_tokens')} generated tokens; "
            f"MTP weights: {st.get('mtp_source')}; verify forward: {st.get('verify_plan')}; weights "
            f"{st.get('weights', 'bf16')}, KV cache {st.get('kv_dtype', 'bf16')}.")


def blocks(section: dict) -> list[Block]:
    """The section's view (blocks.py; accepts the section object or its ``data``): intro, verdict, settings, the
    four equalities' tables and the summary."""
    data = section.get("data", section)
    st = data.get("settings", {})
    return [
        heading("Drafted decode, prompt-cache resume, concurrent streams"), text(INTRO, verdict_md(data),
                                                                                settings_md(data)),
        heading("drafted == plain", 3),
        text("A multi-token-prediction (MTP) head proposes k draft tokens; one verify forward runs the k+1 rows "
             "through the model (prompt kernels) and greedy acceptance keeps the longest agreeing prefix plus the "
             "model's own token. Without a checkpoint's MTP weights the head is derived from the model's own layers "
             "(one position ahead). Compared: tokens, logits bytes of every verified row (the rows the tokens were "
             "chosen from) and KV bytes; for sets that claim no exactness the verdict rests on tokens, the others "
             "shown beside."),
        table(drafted_table(data.get("drafted", []))),
        heading("resumed == fresh", 3),
        text(f"A request whose prompt extends a cached prefix restores its KV state and prefills only the tail, on "
             f"the step grid (`grid`) and off it (`any`). Prompt cache {st.get('prompt_cache_gib')} GiB, "
             f"{st.get('eviction')}; compared: tokens, logits bytes of the tail and generated rows, KV bytes; no "
             "rows when the budget is 0."),
        table(resumed_table(data.get("resumed", []))),
        heading("concurrent streams", 3),
        text(f"N streams (prompts of different lengths) decoded in one batch; stream j joins after "
             f"j·{st.get('stream_offset')} steps; prompts cut to {st.get('stream_prompt_tokens')} − 5·j tokens; "
             "compared per stream with its run alone and with serial decode: tokens, logits bytes and KV bytes of "
             "the stream's cache slot."),
        table(concurrent_table(data.get("concurrent", []))),
        heading("packed == alone", 3),
        text(f"The stream prompts prefilled packed into one {st.get('packed_plan')} forward (each prompt in its own "
             "cache slot), then decoded together; compared with each prompt's prefill alone: tokens, logits bytes "
             "of prompt and generated rows, KV bytes of its slot."),
        table(packed_table(data.get("packed", []))),
        heading("summary", 3), table(summary_table(data))]


def render_md(section: dict) -> str:
    """receipt.md's block of the section: its :func:`blocks` as markdown."""
    return to_markdown(blocks(section)) + "\n"
