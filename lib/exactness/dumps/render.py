"""Markdown of a dump contract (contract.dump_contract): verdict, per-class coverage, per call size, the first
mismatch and the first mismatch with byte-equal inputs, in the style of the receipt's contract section."""
from __future__ import annotations

from tabulate import tabulate

from ..receipt.tables import DASH

INTRO = ("Each kernel call of the engine was dumped with its role: `prompt` (many prompt rows per call) or `decode` "
         "(the serial path, one row per stream per step). Every prompt-role row is paired with the decode-role row "
         "of the same class, call site, sequence and position, and their outputs are compared as bytes. A mismatch "
         "whose two rows had byte-equal inputs is the kernel's own (*origin*); others may be carried in from an "
         "earlier call.")


def _md(rows: list[list], headers: list[str]) -> str:
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def _v(x) -> str:
    if x is None:
        return DASH
    return format(x, ".9g") if isinstance(x, float) else str(x)


def _first(title: str, f: dict | None) -> list[str]:
    if not f:
        return [f"{title}: none."]
    hdr = ["class", "site", "prompt kernel", "replaces", "decode kernel", "M", "row", "seq", "pos", "token",
           "output", "element", "ULP", "prompt", "decode", "inputs equal"]
    keys = ["class", "site", "prompt_kernel", "replaces", "decode_kernel", "call_rows", "row", "seq", "pos",
            "token", "output", "element", "ulp", "prompt", "decode", "inputs_equal"]
    return [f"{title}:", "", _md([[_v(f.get(k)) for k in keys]], hdr)]


def verdict_md(obj: dict) -> str:
    """One line: rows paired, rows that differ, of them with byte-equal inputs; the first class that parts."""
    t = obj["totals"]
    line = (f"**Verdict.** {t['mismatches']:,} of {t['paired']:,} paired rows differ in at least one output byte; "
            f"{t['origin_mismatches']:,} of them had byte-equal inputs.")
    f, o = obj.get("first_mismatch"), obj.get("first_origin")
    if f:
        line += f" The roles first differ at class `{f['class']}`" + (f", site `{f['site']}`" if f.get("site") else "")
        line += f" (M = {f.get('call_rows')}, position {f.get('pos')})."
    if o and o is not f and o != f:
        line += f" The first mismatch with equal inputs is at `{o['class']}`" + \
            (f", site `{o['site']}`" if o.get("site") else "") + "."
    return line


def render_md(obj: dict) -> str:
    """Markdown of a dump contract object: intro, verdict, coverage per class, mismatching/paired rows per class and
    call size M, the first mismatch and the first with equal inputs, and the sites that differ."""
    eng = obj["engine"]
    out = [f"## Dump contract: {eng['name']}" + (f" ({eng['build']})" if eng.get("build") else "")
           + ", prompt-role rows vs decode-role rows, compared as bytes", "", INTRO, "", verdict_md(obj), ""]
    cls_rows = [[c["class"], c["prompt_rows"], c["decode_rows"], c["paired"], c["mismatches"],
                 c["origin_mismatches"], c["unpaired_prompt"], c["unpaired_decode"], c["status"]]
                for c in obj["classes"]]
    out += [_md(cls_rows, ["class", "prompt rows", "decode rows", "paired", "differ", "differ, equal inputs",
                           "unpaired prompt", "unpaired decode", "status"]), ""]
    sizes = sorted({int(m) for c in obj["classes"] for m in c["sizes"]})
    if sizes:
        body = [[c["class"]] + [("/".join(map(str, c["sizes"][str(m)][::-1])) if str(m) in c["sizes"] else DASH)
                                for m in sizes] for c in obj["classes"] if c["sizes"]]
        out += ["Differing / paired rows per class and prompt call size M:", "",
                _md(body, ["class"] + [f"M={m}" for m in sizes]), ""]
    pairs = [[c["class"], q["prompt"], q["replaces"], q["decode"], "yes" if q["claim_names_decode"] else "NO",
              f"{q['mismatches']}/{q['paired']}"] for c in obj["classes"] for q in c["kernel_pairs"]]
    if pairs:
        out += ["Kernel pairs (a prompt kernel, the decode kernel it claims to replace, the decode kernel its rows "
                "were paired with):", "",
                _md(pairs, ["class", "prompt kernel", "replaces", "decode kernel", "claim names it",
                            "differ / paired"]), ""]
    out += _first("First mismatch (prompt call order)", obj.get("first_mismatch")) + [""]
    out += _first("First mismatch with byte-equal inputs", obj.get("first_origin")) + [""]
    bad = [s for s in obj["sites"] if s["mismatches"]]
    if bad:
        out += ["Sites with differing rows:", "",
                _md([[s["class"], _v(s["site"]), f"{s['mismatches']}/{s['paired']}", s["origin_mismatches"],
                      s["positions"], s.get("origin_positions") or DASH] for s in bad],
                    ["class", "site", "differ / paired", "equal inputs", "positions", "positions, equal inputs"]), ""]
    out.append(f"_{DASH} : not applicable (no site, no float ULP order, or no such call size)._")
    return "\n".join(out)
