"""The view of the ``hashes`` section run on engines (display blocks, blocks.py): the engines and their configurations, each engine's
hash matrix against its oracle (with many prompts, counts per configuration: repeat_md.py), the repeat test, the
stream equalities, the cross-engine view and what the engines could not give."""
from __future__ import annotations

from ..blocks import Block, heading, plot, text, to_markdown
from ..tables import md_escape, table
from .repeat_md import counts_block, plot_divergence, repeat_block

INTRO = ("Each engine runs every prompt greedily under each of its configurations; each run is compared with the "
         "engine's oracle configuration: the generated tokens always, and the bytes of every prompt logit row, every "
         "generated logit row and the KV cache where the engine exposes them. **equal** means every compared part "
         "is byte-identical; a part the engine does not expose is named, never counted as equal.")


CROSS = ("Every engine's runs against the first engine's oracle tokens: meaningful only where the engines run the same "
         "weights (the engines table names each one's model; `reference` alone runs the preset's synthetic weights, "
         "`reference:/path` a model folder's).")

VERSION_KEYS = ("transformers", "torch", "llama_cpp_python")
MODEL_KEYS = ("model", "model_class", "folder", "config_sha256", "gguf_sha256", "served_model")


def _model(ident: dict) -> str:
    """What the engine ran: its model record, or the model class, folder and file hashes it reported."""
    parts = []
    for k in MODEL_KEYS:
        v = ident.get(k)
        if isinstance(v, dict):
            parts += [f"{a} {str(b)[:80]}" for a, b in v.items()]
        elif v:
            parts.append(f"{k.replace('_', ' ')} {str(v)[:16] if k.endswith('sha256') else v}")
    return ", ".join(parts) or "not reported"


def _version(ident: dict) -> str:
    v = ident.get("version")
    if isinstance(v, dict):
        return ", ".join(f"{a} {b}" for a, b in v.items())
    return str(v) if v else ", ".join(f"{k} {ident[k]}" for k in VERSION_KEYS if ident.get(k)) or "not reported"


def engines_table(section: dict) -> str:
    rows = [[e.get("spec"), e.get("kind"), _version(e), _model(e), e.get("device"), e.get("dtype"),
             ", ".join(e.get("configurations") or [])] for e in section.get("engines") or []]
    return table(rows, ["engine", "kind", "version", "model", "device", "dtype", "configurations"])


def _rows_text(r: dict) -> str:
    if r.get("prompt_logits_equal") is None and r.get("prompt_logprobs_equal") is not None:
        return f"{r.get('prompt_logprob_rows_differing')} (prompt logprobs)"   # a server's prompt rows
    if r.get("prompt_logits_equal") is None:
        return "not exposed"
    return f"{r.get('prompt_rows_differing')}/{r.get('prompt_tokens')}"


def _first_row(r: dict):
    if r.get("prompt_logits_equal") is None:
        return r.get("first_differing_prompt_logprob_row")
    return r.get("first_differing_prompt_row")


def hash_table(rows: list[dict]) -> str:
    body = [[r["engine"], r["prompt"], r["prompt_tokens"], r["config"] + (" (oracle)" if r["config"] == r["oracle"]
                                                                         else ""),
             r["hash"], r.get("first_divergence"), r.get("oracle_margin"), _rows_text(r),
             _first_row(r), r.get("verdict")] for r in rows]
    return table(body, ["engine", "prompt", "tokens", "configuration", "token hash", "first divergent token",
                        "oracle top-1 margin there", "prompt rows differing", "first differing row",
                        "verdict"], dash="none (or not applicable)")


def streams_block(streams: dict) -> str:
    out = []
    for spec, data in streams.items():
        rows = [[r["check"], r["prompt"], r["config"], r.get("first_divergence"), r.get("verdict")]
                for check in ("drafted", "resumed", "concurrent") for r in data.get(check) or []]
        out += [f"### Stream equalities: {md_escape(spec)}", "",
                "drafted == plain, resumed == fresh (prefix: half the prompt), concurrent == alone; each against "
                "the same configuration run alone.", ""]
        if rows:
            out += [table(rows, ["check", "prompt", "configuration", "first divergent token", "verdict"],
                          dash="none"), ""]
        out += [f"- **{k}**: {v}" for k, v in (data.get("not_available") or {}).items()]
        out.append("")
    return "\n".join(out)


def prompts_table(section: dict) -> str:
    """Each engine's prompts: name, kind, SHA-256 of the prompt as given (first 12 hex), tokens sent, template."""
    rows = [[label, r["name"], r["kind"], (r.get("sha256") or "")[:12] or None, r.get("tokens"), r.get("template")]
            for label, recs in (section.get("prompts") or {}).items() for r in recs]
    return table(rows, ["engine", "prompt", "kind", "SHA-256 (first 12 hex)", "tokens", "chat template"],
                 dash="not applicable (tokens: messages sent, the server counts them)")


def cross_table(cross: list[dict]) -> str:
    rows = [[c["prompt"], f"{c['engine']}:{c['config']}", c["hash"], c["reference"], c["tokens_equal"]]
            for c in cross]
    return table(rows, ["prompt", "engine:configuration", "token hash", "compared with", "same tokens"])


def bench_block(bench: dict) -> str:
    """The bench tables of each engine: cold/warm runs, concurrent streams and cold prefill at exact lengths."""
    out = []
    for label, b in bench.items():
        runs = [[r["config"], r["prompt"], r["prompt_tokens"], r["run"], r["ttft_s"], r["prefill_tps"],
                 r["decode_tps"], r["itl_mean_ms"], r["itl_p50_ms"], r["itl_p95_ms"], r.get("cached_tokens")]
                for r in b.get("runs") or []]
        head = f"### Bench: {md_escape(label)}"
        out += [head, "", table(runs, ["configuration", "prompt", "prompt tokens", "run", "TTFT (s)", "prefill tok/s",
                                       "decode tok/s", "ITL mean (ms)", "ITL p50 (ms)", "ITL p95 (ms)",
                                       "cached prompt tokens"], dash="not reported"), ""]
        streams = [[c, r["streams"], r["wall_s"], r["aggregate_tps"], r["equal_to_alone"]]
                   for c, rows in (b.get("streams") or {}).items() if isinstance(rows, list) for r in rows]
        reasons = [f"- **{c}** streams: {rows}" for c, rows in (b.get("streams") or {}).items() if isinstance(rows, str)]
        if streams:
            out += [table(streams, ["configuration", "streams", "wall (s)", "aggregate tok/s", "tokens equal alone"]),
                    ""]
        out += reasons
        cold = [[c, r["length"], r.get("ttft_s"), r.get("prefill_tps"), r.get("cold"), r.get("skipped")]
                for c, rows in (b.get("cold") or {}).items() for r in rows]
        if cold:
            out += ["", table(cold, ["configuration", "prompt tokens", "TTFT (s)", "prefill tok/s", "cold (no cache hit)",
                                     "skipped"], dash="none"), ""]
    return "\n".join(out)


def verdict_md(section: dict) -> str:
    """One line per engine: runs equal to the oracle (every exposed part) of all runs."""
    lines = []
    for e in section.get("engines") or []:
        rows = [r for r in section.get("rows") or [] if r["engine"] == e.get("spec") and r["config"] != r["oracle"]]
        v = [str(r.get("verdict", "")) for r in rows]
        eq = sum(1 for x in v if x == "equal" or x.startswith("equal ("))   # exact equalities only
        lossy, notg = sum(x.startswith("equal as text") for x in v), sum(x.startswith("not greedy") for x in v)
        tok = sum(1 for r in rows if r.get("equals_oracle"))
        apart = "".join(f"; {n}/{len(rows)} {what}" for n, what in ((lossy, "equal as text only (lossy)"),
                                                                     (notg, "not greedy (not compared)")) if n)
        lines.append(f"- **{md_escape(str(e.get('spec')))}**: {eq}/{len(rows)} runs equal their oracle "
                     f"({md_escape(str(e.get('oracle', 'oracle')))}); {tok}/{len(rows)} with the oracle's tokens{apart}.")
    return "\n".join(lines)


def blocks(section: dict) -> list[Block]:
    """The view of a ``hashes`` section run on engines (blocks.py): verdict lines, the engines, the hash matrix (with
    many prompts, counts per configuration and the divergence plot), prompts, repeat test, stream equalities, the
    first op that broke, the table across engines, the bench, what the engines could not give and their errors."""
    many = bool(section.get("prompt_counts"))
    matrix = (counts_block(section) if many else hash_table(section["rows"])
              if section.get("rows") or not section.get("repeat") else "_Not run (engine_repeat_only)._")
    out = [heading("Engines under test"), text(INTRO, verdict_md(section)), text(engines_table(section)),
           heading("Hash matrix against each engine's oracle", 3), text(matrix)]
    out += [plot(lambda: plot_divergence(section), "where the runs part from their oracle, per configuration")
            ] if many else []
    out += [heading("Prompts", 3), text(prompts_table(section))] if section.get("prompts") else []
    out += [text(repeat_block(section["repeat"]))] if section.get("repeat") else []
    out += [text(streams_block(section["streams"]))] if section.get("streams") else []
    if section.get("engine_dumps"):
        from .engines_dumps import render_md as dumps_md
        out.append(text(dumps_md(section["engine_dumps"])))
    if section.get("cross"):
        out += [heading("Across engines", 3), text(CROSS, cross_table(section["cross"]))]
    out += [text(bench_block(section["bench"]))] if section.get("bench") else []
    na = section.get("not_available") or {}
    out += [heading("Not available from these engines", 3), text("\n".join(f"- **{k}**: {v}" for k, v in na.items()))
            ] if na else []
    if section.get("errors"):
        out += [heading("Engine errors", 3), text(table([[x["engine"], x["error"]] for x in section["errors"]],
                                                        ["engine", "error"]))]
    return out


def render_md(section: dict) -> str:
    """receipt.md's block of a ``hashes`` section run on engines: its :func:`blocks` as markdown."""
    return to_markdown(blocks(section))
