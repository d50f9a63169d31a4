"""``receipt.html``: the executed notebooks merged into one self-contained page (nbconvert, no code cells).

The page keeps what a reviewer reads (markdown, tables, plots, stdout) and leaves out what the run printed for the
person watching it: every ``stderr`` stream (progress bars, warnings) is dropped from the merged copy, so the
executed .ipynb files keep them. Nothing loads from outside the page: MathJax, require.js and widget scripts are
left out of the template, images are inlined as data URIs, and the embedded CSS keeps no comments (the theme's
credit web addresses).
"""
from __future__ import annotations

import re
from pathlib import Path

from .render import render_header

# nbconvert's lab template, less everything that loads from a CDN (require.js, MathJax, mermaid, widgets), plus
# the receipt's layout rules: tables wrap their cells instead of running past the page, text is left-aligned.
_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{% block notebook_css %}{{ super() }}
<style type="text/css">
body.jp-Notebook { max-width: 1240px; margin: 0 auto; }
.jp-RenderedHTMLCommon table { table-layout: auto; max-width: 100%; margin-left: 0; margin-right: 0; }
.jp-RenderedHTMLCommon td, .jp-RenderedHTMLCommon th,
:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td, :not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon th {
  text-align: left; overflow-wrap: break-word; padding: 0.25em 0.4em; }
.jp-RenderedHTMLCommon code { overflow-wrap: anywhere; }
.jp-OutputArea-output pre { white-space: pre-wrap; overflow-wrap: anywhere; }
p.receipt-note { font-size: 0.85em; color: #555; margin: 0.2em 0 0.9em 0; }
</style>
{% endblock notebook_css %}
"""
_EXTERNAL = re.compile(r"<script[^>]*\bsrc=[\"']?(?:https?:)?//|import\(\s*[\"'](?:https?:)?//", re.IGNORECASE)
_STYLE = re.compile(r"(<style[^>]*>)(.*?)(</style>)", re.DOTALL | re.IGNORECASE)
_CSS_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)


def strip_css_comments(html: str) -> str:
    """``html`` with every comment removed from its ``<style>`` blocks: the theme CSS nbconvert embeds credits its
    sources in comments that hold web addresses, and a receipt (pasted, committed) carries none."""
    return _STYLE.sub(lambda m: m.group(1) + _CSS_COMMENT.sub("", m.group(2)) + m.group(3), html)


def drop_stderr(nb):
    """``nb`` (an nbformat notebook, changed in place and returned) without stream outputs named ``stderr``."""
    for c in nb.cells:
        if c.get("cell_type") == "code":
            c["outputs"] = [o for o in c.get("outputs", [])
                            if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
    return nb


def merge_notebooks(receipt: dict, notebook_files: list[Path]):
    """One nbformat notebook: a header markdown cell (status, summary, environment, errors), then each executed
    notebook's cells (cell ids renumbered to stay unique, stderr streams dropped).

    Raises:
        OSError, nbformat.reader.NotJSONError: a notebook file cannot be read.
    """
    import nbformat

    merged = nbformat.v4.new_notebook()
    merged.cells.append(nbformat.v4.new_markdown_cell(render_header(receipt), id="receipt-header"))
    for path in notebook_files:
        nb = drop_stderr(nbformat.read(str(path), as_version=4))
        merged.metadata = merged.metadata or nb.metadata
        for i, c in enumerate(nb.cells):
            c["id"] = f"{Path(path).stem}-{i}"[-64:]
            merged.cells.append(c)
    return merged


def render_html(receipt: dict, notebook_files: list[Path]) -> str:
    """``receipt.html``: the merged notebooks through nbconvert's ``HTMLExporter`` without code cells, MathJax and
    other CDN scripts left out of the template, images inline as data URIs, stderr streams dropped.

    Raises:
        RuntimeError: an external script is still present after removal (never a silently non-standalone page).
    """
    import jinja2
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(extra_loaders=[jinja2.DictLoader({"receipt.html.j2": _TEMPLATE})],
                            template_file="receipt.html.j2", exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True, embed_images=True)
    title = f"Exactness receipt {receipt.get('profile')} ({receipt.get('status')})"
    body, _ = exporter.from_notebook_node(merge_notebooks(receipt, notebook_files),
                                          resources={"metadata": {"name": title}})
    if _EXTERNAL.search(body):
        raise RuntimeError("receipt.html would load an external script; the template let one through")
    return strip_css_comments(body)
