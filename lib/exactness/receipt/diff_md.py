"""The receipt diff (diff.py) as GitHub markdown, under GitHub's comment limit (render.MD_LIMIT)."""
from __future__ import annotations

from .diff import FLAG_NAMES
from ..tables import table
from .render import MD_LIMIT, compact_tables

FLAG_TEXT = {(True, False): "stopped equalling", (False, True): "started equalling"}


def _flag(field: str, base, pr) -> str:
    """"tokens: stopped equalling its oracle", "equal: started holding" and the like; "not compared → equal" where
    one side is None."""
    what = FLAG_NAMES.get(field, field.replace("_", " "))
    words = FLAG_TEXT.get((base, pr))
    if words is None:
        show = {True: "equal", False: "differs", None: "not compared"}
        return f"{what}: {show.get(base, base)} → {show.get(pr, pr)}"
    if field in FLAG_NAMES and field != "rerun_equal":
        return f"{what}: {words} its oracle"
    return f"{what}: " + words.replace("equalling", "holding")


def _num(v) -> str:
    return "—" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def hashes_md(changes: list[dict]) -> list[str]:
    """Moved token hashes, one row per (engine, configuration, prompt): "docs: 1882ea29ebf6 → e6834625432c"."""
    rows = [[(c.get("key") or {}).get("engine"), (c.get("key") or {}).get("configuration"),
             f"{(c.get('key') or {}).get('prompt')}: {c['base']} → {c['pr']}"]
            for c in changes if c["section"] == "hashes" and c["kind"] == "hash" and c.get("key")]
    if not rows:
        return []
    return ["## Token hashes that moved", "", table(rows, ["engine", "configuration", "prompt: BASE → PR"])]


def flags_md(changes: list[dict]) -> list[str]:
    """Runs that stopped or started equalling their oracle (tokens, prompt logits, KV separately), and streams'
    equalities and hashes that changed."""
    out = []
    for names, title in ((("hashes",), "Runs whose equality with their oracle changed"),
                         (("streams",), "Stream rows whose equalities or hashes changed")):
        cs = [c for c in changes if c["section"] in names and (c["kind"] == "flag" or not c.get("key"))]
        if cs:
            rows = [[c["what"], _flag(c["field"], c["base"], c["pr"]) if c["kind"] == "flag"
                     else f"{c['field']}: {c['base']} → {c['pr']}"] for c in cs]
            out += ["", f"## {title}", "", table(rows, ["run", "change (BASE → PR)"])]
    return out


def others_md(changes: list[dict]) -> list[str]:
    """Contract mismatch counts, FP64 verdicts and bench figures that moved."""
    out = []
    cs = [c for c in changes if c["kind"] == "count"]
    if cs:
        rows = [[c["what"], c["base"], c["pr"], " → ".join(map(_num, c.get("cases") or []))] for c in cs]
        out += ["", "## Contract pairs whose mismatch count changed", "",
                table(rows, ["pair (set class dtype device)", "BASE mismatches", "PR mismatches", "cases"])]
    cs = [c for c in changes if c["kind"] == "verdict"]
    if cs:
        rows = [[c["what"], c["base"], c["pr"], " → ".join(map(_num, c.get("bound_use") or []))] for c in cs]
        out += ["", "## FP64 rows whose verdict changed", "",
                table(rows, ["row (set class path dtype inputs K)", "BASE", "PR", "bound_use"])]
    cs = [c for c in changes if c["kind"] == "figure"]
    if cs:
        rows = [[c["what"], c["field"], _num(c["base"]), _num(c["pr"]), f"{c['pr'] - c['base']:+.4g}",
                 f"{c['spread']:.4g}", c["spread_of"]] for c in cs]
        out += ["", "## Bench figures that moved beyond their run-to-run spread", "",
                "Figure: the median of a row's repeats in each receipt. Spread: the larger of the two receipts' "
                "ranges (max − min) over those repeats. Moved: the medians differ by more than the spread.", "",
                table(rows, ["row", "figure", "BASE median", "PR median", "change", "spread", "repeats"])]
    return out


def rest_md(result: dict) -> list[str]:
    """Not comparable, in one receipt only, bench figures not judged, and the context."""
    out = []
    if result["not_comparable"]:
        rows = [[c["section"], c["what"], f"not comparable: {c['why']}"] for c in result["not_comparable"]]
        out += ["", "## Not compared", "", table(rows, ["section", "what", "why"])]
    one = [[c["section"], c["what"], side] for side, key in (("BASE", "only_base"), ("PR", "only_pr"))
           for c in result[key]]
    if one:
        out += ["", "## In one receipt only", "", table(one, ["section", "row", "only in"])]
    if result["not_judged"]:
        out += ["", "## Not judged", "", table(not_judged_rows(result["not_judged"]),
                                                            ["part", "fields", "rows", "why not judged"])]
    if result["context"]:
        rows = [[c["what"], c["base"], c["pr"]] for c in result["context"]]
        out += ["", "## What else differs (for reading; not a verdict)", "", table(rows, ["field", "BASE", "PR"])]
    return out


def not_judged_rows(items: list[dict]) -> list[list]:
    """Fields not judged, one row per (part, reason): the fields and how many rows (diff.json lists each)."""
    groups: dict[tuple, tuple[dict, set]] = {}
    for c in items:
        fields, rows = groups.setdefault((c["what"].split(" · ")[0], c["why"]), ({}, set()))
        fields[c["field"]] = None
        rows.add(c["what"])
    return [[part, ", ".join(fields), len(rows), why] for (part, why), (fields, rows) in groups.items()]


def headline(result: dict) -> str:
    """One line: nothing moved, or the counts of what moved, what is in one receipt only, what was not compared."""
    n = {k: len(result[k]) for k in ("changes", "only_base", "only_pr", "not_comparable")}
    n["changes"] -= result.get("speed_moved", 0)
    judged = f"; {result['within_spread']} bench figures within their spread" if result["within_spread"] else ""
    speed = result.get("speed_moved", 0)
    judged += (f"; {speed} bench figure(s) beyond their spread (speed, listed below: not an exactness change)"
               if speed else "")
    compared = ", ".join(f"{k} {v}" for k, v in result["compared"].items()) or "none"
    if not result["moved"]:
        return f"**Nothing moved.** Row pairs compared: {compared}{judged}."
    return (f"**Moved: {n['changes']} change(s); {n['only_base'] + n['only_pr']} row(s) in one receipt only; "
            f"{n['not_comparable']} not compared.** Row pairs compared: {compared}{judged}.")


def render(result: dict, limit: int = MD_LIMIT) -> str:
    """The diff as markdown: title, BASE and PR, the headline, then one block per kind of change."""
    parts = [f"# Receipt diff: {result['profile'][0]} → {result['profile'][1]}", "",
             f"BASE `{result['base']}` → PR `{result['pr']}`", "", headline(result), "",
             *hashes_md(result["changes"]), *flags_md(result["changes"]), *others_md(result["changes"]),
             *rest_md(result)]
    text = "\n".join(parts).strip() + "\n"
    if len(text) >= limit:
        text = compact_tables(text)
    if len(text) >= limit:
        note = "\n\n_Cut to stay under GitHub's comment limit; diff.json holds every row._\n"
        text = text[:max(text.rfind("\n", 0, limit - len(note) - 1), 0)] + note
    return text
