"""Tables a reviewer reads: one formatting rule for every table of a receipt, in receipt.html (a pandas Styler
without the index) and in receipt.md (a GitHub table through tabulate).

A :class:`Table` holds rows (dicts or a DataFrame), the columns to show with their headers (units in the header,
e.g. ``"TTFT (s)"``), optional per-column formats and words for booleans, and what a dash means in it. Every cell goes
through :func:`cell_text`: a missing value (None, NaN, pd.NA) becomes "–", a boolean a word ("yes"/"no" unless the
column says otherwise), an integral number an integer (never ``8.0``), a float four significant digits. A table
that shows a dash carries a footnote saying what the dash means there.

Notebooks ``display(Table(...))``; the section renderers call ``Table(...).to_markdown()``, so a section's tables
read the same in both.
"""
from __future__ import annotations

import html as _html
import json
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

DASH = "–"
FLOAT_FMT = ".4g"
MAX_ROWS = 200  # markdown rows per table before the rest is left to receipt.json
CELL_LIMIT = 160  # characters per markdown cell
# Cell texts that report a failed equality or bound: bold in both renderings, so a reviewer's eye lands on them.
ALARM = frozenset({"no", "NO", "differs", "outside bound", "outside", "uncertified", "FAIL", "failed",
                   "not identical", "refused"})
_CSS = [{"selector": "", "props": "border-collapse: collapse; margin: 0.4em 0; max-width: 100%;"},
        {"selector": "th", "props": "text-align: left; vertical-align: bottom; border-bottom: 1px solid #888; "
                                    "padding: 0.25em 0.4em; font-weight: 600; overflow-wrap: break-word;"},
        {"selector": "td", "props": "text-align: left; padding: 0.2em 0.4em; border-bottom: 1px solid #e4e4e4; "
                                    "overflow-wrap: break-word;"}]


def is_missing(v) -> bool:
    """True for None, float NaN, pd.NA and NaT (the values a table shows as a dash)."""
    if v is None:
        return True
    if isinstance(v, (str, bytes, list, tuple, dict, set)):
        return False
    import pandas as pd

    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):  # array-likes: not one missing value
        return False


def cell_text(v, fmt: str | Callable | None = None, words: tuple[str, str] = ("yes", "no")) -> str:
    """One cell as display text.

    Args:
        v: the value (None/NaN/pd.NA give ``DASH``; bool and numpy bool give ``words``; integral numbers an integer;
            other floats ``fmt`` or 4 significant digits; dicts and lists compact JSON; anything else ``str``).
        fmt: a format spec for numbers (``".2f"``) or a callable value -> text, applied to non-missing values.
        words: the (true, false) words for booleans.
    """
    if is_missing(v):
        return DASH
    if callable(fmt):
        return str(fmt(v))
    if isinstance(v, (bool, np.bool_)):
        return words[0] if v else words[1]
    if isinstance(v, numbers.Integral):
        return format(int(v), fmt) if fmt else str(int(v))
    if isinstance(v, numbers.Real):
        f = float(v)
        if math.isinf(f):
            return "∞" if f > 0 else "−∞"
        if fmt:
            return format(f, fmt)
        return str(int(f)) if f.is_integer() and abs(f) < 2 ** 53 else format(f, FLOAT_FMT)
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, separators=(", ", ": "), default=str, ensure_ascii=False)
    return str(v)


_ENTITY = re.compile(r"&(?=#\d+;|#[xX][0-9a-fA-F]+;|[A-Za-z][A-Za-z0-9]*;)")
_EDGE_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")   # may open or close emphasis


def md_escape(text: str) -> str:
    """``text`` (the user's: a prompt name or text, a file path) shown as text in markdown, in a table cell or a
    line, in receipt.md and in receipt.html (nbconvert renders markdown outputs): newlines flattened; backslashes,
    backticks, pipes, asterisks, an underscore at a word's edge and the ``](`` of a link backslash-escaped; ``<``,
    ``>`` and an entity-like ``&`` as HTML entities, so that no tag, link, emphasis or code span is made from it and a
    table keeps its columns."""
    s = text.replace("\r\n", " ").replace("\r", " ").replace("\n", " ").replace("\\", "\\\\")
    s = s.replace("`", "\\`").replace("|", "\\|").replace("](", "\\](").replace("*", "\\*")
    s = _EDGE_UNDERSCORE.sub(r"\\_", s)
    return _ENTITY.sub("&amp;", s).replace("<", "&lt;").replace(">", "&gt;")


class Code:
    """A cell the suite shows as inline code in markdown (e.g. a token hash), ``after`` following it as text."""

    def __init__(self, text: str, after: str = ""):
        self.text, self.after = str(text), after

    def __str__(self) -> str:
        return self.text + self.after

    def markdown(self) -> str:
        return f"`{self.text}`" + md_escape(self.after)


def _md_cell(text: str) -> str:
    """``text`` safe inside a GitHub table cell (md_escape), at most CELL_LIMIT characters."""
    s = md_escape(text)
    return s if len(s) <= CELL_LIMIT else s[:CELL_LIMIT - 3] + "..."


def _records(rows) -> tuple[list[str], list[dict]]:
    """(keys in order, row dicts) from a list of dicts or a DataFrame (index dropped; a float column holding only
    whole numbers, an int column widened by a missing value, read back as ints)."""
    if hasattr(rows, "to_dict") and hasattr(rows, "columns"):
        df = rows.reset_index(drop=True)
        recs = df.astype(object).to_dict("records")
        for k in df.columns:
            vals = [r[k] for r in recs if not is_missing(r[k])]
            if df[k].dtype.kind == "f" and vals and all(float(x).is_integer() for x in vals):
                for r in recs:
                    r[k] = None if is_missing(r[k]) else int(r[k])
        return [str(k) for k in df.columns], [{str(k): v for k, v in r.items()} for r in recs]
    rows = list(rows)
    return list(dict.fromkeys(k for r in rows for k in r)), rows


@dataclass
class Table:
    """A receipt table: the same cells in HTML (``_repr_html_``, for ``display``) and markdown (``to_markdown``).

    Attributes:
        rows: list of dicts (missing keys show a dash) or a pandas DataFrame (its index is dropped).
        columns: key -> header (units in the header) of the columns to show, in order; None shows every key under
            its own name.
        formats: key -> format spec (``".2f"``) or callable(value) -> text.
        words: key -> (true word, false word) for boolean columns (default yes/no), e.g. ("equal", "differs").
        dash: what a dash means in this table (the footnote, shown only when a dash is present).
        notes: further footnotes, one sentence each.
    """

    rows: object
    columns: dict[str, str] | None = None
    formats: dict[str, str | Callable] = field(default_factory=dict)
    words: dict[str, tuple[str, str]] = field(default_factory=dict)
    dash: str = "not applicable to this row"
    notes: list[str] = field(default_factory=list)

    def _layout(self) -> tuple[list[str], list[str], list[dict]]:
        keys, recs = _records(self.rows)
        cols = self.columns or {k: k for k in keys}
        return list(cols), [cols[k] for k in cols], recs

    def cells(self) -> tuple[list[str], list[list[str]]]:
        """(headers, rows of display texts)."""
        keys, heads, recs = self._layout()
        return heads, [[cell_text(r.get(k), self.formats.get(k), self.words.get(k, ("yes", "no"))) for k in keys]
                       for r in recs]

    def footnotes(self, body: list[list[str]] | None = None) -> list[str]:
        """The dash footnote (when a cell shows a dash) and the notes."""
        body = self.cells()[1] if body is None else body
        dash = [f"{DASH} : {self.dash}."] if any(c == DASH for row in body for c in row) else []
        return dash + list(self.notes)

    def to_markdown(self, max_rows: int = MAX_ROWS) -> str:
        """GitHub markdown: the table (alarm words bold), a note when over ``max_rows`` rows, then the footnotes."""
        from tabulate import tabulate

        heads, body = self.cells()
        shown = [[f"**{c}**" if c in ALARM else _md_cell(c) for c in row] for row in body[:max_rows]]
        text = tabulate(shown, headers=[_md_cell(h) for h in heads], tablefmt="github", disable_numparse=True)
        notes = self.footnotes(body)
        if len(body) > max_rows:
            notes.append(f"{len(body) - max_rows} more rows not shown; see receipt.json.")
        return text + "".join(f"\n\n_{n}_" for n in notes)

    def styler(self):
        """The pandas Styler of the table: index hidden, every cell through :func:`cell_text`, alarm words bold."""
        import pandas as pd

        keys, heads, recs = self._layout()
        df = pd.DataFrame([[r.get(k) for k in keys] for r in recs], columns=heads, dtype=object)
        fmt = {h: (lambda v, k=k: _html.escape(cell_text(v, self.formats.get(k), self.words.get(k, ("yes", "no")))))
               for k, h in zip(keys, heads)}
        alarm = {_html.escape(w) for w in ALARM}
        st = df.style.hide(axis="index").format(formatter=fmt, na_rep=DASH)
        st = st.set_table_attributes('class="receipt-table"').set_table_styles(_CSS)
        styles = [[("font-weight: 700; color: #a40000;" if fmt[h](v) in alarm else "") for h, v in zip(heads, row)]
                  for row in df.itertuples(index=False)]
        if styles:
            st = st.apply(lambda _: pd.DataFrame(styles, columns=heads, index=df.index), axis=None)
        return st

    def to_html(self) -> str:
        """The Styler's HTML followed by the footnotes (``<p class="receipt-note">``)."""
        notes = "".join(f'<p class="receipt-note">{_html.escape(n)}</p>' for n in self.footnotes())
        return self.styler().to_html() + notes

    def _repr_html_(self) -> str:
        return self.to_html()

    def __repr__(self) -> str:  # the text/plain fallback Jupyter stores beside the HTML
        return self.to_markdown()


# ------------------------------------------------------------------------------------------------- parameters

# What an unset parameter (None, "" or []) means, said instead of "null".
UNSET = {"prompt_max_tokens": "full prompts", "hash_max_tokens": "as prompt_max_tokens",
         "bench_gen_tokens": "as gen_tokens", "stream_prompt_tokens": "a quarter of prompt_max_tokens, at most 256",
         "checkpoint": "synthetic weights (seeded)", "contract_control_sweep": "as contract_sweep",
         "contract_dtypes": "the model dtype, then the other of bfloat16 / float32",
         "contract_classes": "every kernel class", "precomputed_json": "no (computed here)",
         "fp64_prompt": "the longest prompt", "fp64_tokens": "as prompt_max_tokens",
         "out_json": "not written (interactive run)"}


def parameter_text(key: str, value) -> str:
    """A parameter's value as a reviewer reads it: lists comma-separated, unset values (None, "", []) said in
    words (``UNSET``, else "not set (default)")."""
    if value is None or value == "" or value == []:
        return UNSET.get(key, "not set (default)")
    if isinstance(value, (list, tuple)):
        return ", ".join(parameter_text(key, v) for v in value)
    return cell_text(value)


def parameters_line(params: dict, precomputed: str = "") -> str:
    """Markdown: one wrapped line of ``name = value`` for a notebook's parameters, and where the section came
    from (computed here, or the precomputed file)."""
    items = "; ".join(f"`{k}` = {md_escape(parameter_text(k, v))}" for k, v in params.items())
    source = f"rendered from `{precomputed}` (computed elsewhere)" if precomputed else "computed here"
    return f"**Parameters:** {items}. **Section:** {source}."


def cell(v) -> str:
    """One table cell as text (tables.cell_text: a dash for missing values, words for booleans, integers as
    integers), escaped (tables.md_escape: no tag, link or code span from the user's text, pipes and newlines kept
    from breaking the GitHub table; a tables.Code value as inline code), at most 160 characters."""
    s = v.markdown() if isinstance(v, Code) else md_escape(cell_text(v))
    return s if len(s) <= 160 else s[:157] + "..."


def table(rows: list[list], headers: list[str], max_rows: int = MAX_ROWS, dash: str = "not recorded") -> str:
    """A GitHub markdown table (tabulate, cells through :func:`cell`); over ``max_rows`` rows it is cut with a
    note; when a cell shows a dash, a footnote says what the dash means (``dash``)."""
    from tabulate import tabulate
    note = ""
    if len(rows) > max_rows:
        note = f"\n\n_{len(rows) - max_rows} more rows not shown; see receipt.json._"
        rows = rows[:max_rows]
    body = [[cell(v) for v in r] for r in rows]
    if any(c == DASH for r in body for c in r):
        note += f"\n\n_{DASH} : {dash}._"
    return tabulate(body, headers=[cell(h) for h in headers], tablefmt="github", disable_numparse=True) + note


def render_extra(name: str, extra: dict) -> str:
    """A section's extra keys: scalars as a key/value table; lists and dicts (plot data, provenance) stay in
    receipt.json only. Empty when there are no scalars."""
    scalars = {k: v for k, v in extra.items() if not isinstance(v, (list, dict))}
    if not scalars:
        return ""
    return "\n".join([f"## {name[:-len('_extra')]}: further values", "",
                      table([[k, v] for k, v in scalars.items()], ["key", "value"])])
