"""Views of the ``bench`` section (analysis/bench.py): one table per measure, one row per kernel set and prompt, as
display blocks (blocks.py: the notebook shows them, ``render_md`` prints them as GitHub markdown).

Every table function takes the section's ``data`` and returns a pandas DataFrame of display strings (numbers
formatted here: seconds to 2 decimals, tok/s to 1 (decode tok/s 2), milliseconds to 2, memory in MiB).
"cold" = rep 0, "warm" = the median of reps 1.. .
"""
from __future__ import annotations

import statistics

import pandas as pd

from ..blocks import Block, heading, text, to_markdown
from ..blocks import table as table_block
from ..tables import Table

MIB = 2 ** 20
INTRO = ("Serving speed and memory of each kernel set on this machine: time to the first token (TTFT), prefill "
         "and decode throughput, inter-token latency (ITL), drafted against plain decode, cold-cache prefill at "
         "exact lengths, concurrent streams and peak memory. These are measurements, not pass/fail checks (the "
         "exactness verdicts are in the sections above); the *drafted == plain* and *equal-to-alone* columns repeat "
         "the equality checks on the timed runs. Cold = the first request of a prompt since the model was loaded, "
         "warm = the median of its identical repeats.")


def _f(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _warm(runs: list[dict], key: str):
    vals = [r[key] for r in runs[1:] if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _hash(runs: list[dict]) -> str:
    hashes = list(dict.fromkeys(r["hash"] for r in runs))
    return hashes[0] if len(hashes) == 1 else " / ".join(hashes) + " (reps differ)"


def decode_table(data: dict, kind: str = "plain") -> pd.DataFrame:
    """Plain or drafted decode: per kernel set and prompt, TTFT / prefill tok/s / decode tok/s / mean ITL, cold
    and warm, the text hash, and what served the prefill (drafted adds the draft acceptance rate)."""
    out = []
    for row in data.get(kind, []):
        runs, c = row["runs"], row["runs"][0]
        rec = {"kernels": row["kernels"], "prompt": row["prompt"], "prompt tok": c["prompt_tokens"],
               "gen tok": c["generated"], "TTFT cold s": _f(c["ttft_s"], ".2f"),
               "TTFT warm s": _f(_warm(runs, "ttft_s"), ".2f"), "prefill cold tok/s": _f(c["prefill_tps"], ".1f"),
               "prefill warm tok/s": _f(_warm(runs, "prefill_tps"), ".1f"),
               "decode cold tok/s": _f(c["decode_tps"], ".2f"),
               "decode warm tok/s": _f(_warm(runs, "decode_tps"), ".2f"),
               "mean ITL cold ms": _f(c["itl_mean_ms"], ".2f"),
               "mean ITL warm ms": _f(_warm(runs, "itl_mean_ms"), ".2f"),
               "text hash": _hash(runs)}
        if kind == "drafted":
            rec["acceptance"] = _f(c.get("acceptance"), ".2f")
        rec["prefill served"] = c["path_served"]
        out.append(rec)
    return pd.DataFrame(out)


def drafted_vs_plain_table(data: dict) -> pd.DataFrame:
    """drafted == plain: hashes of both, equality over all repetitions, decode tok/s and mean ITL side by side."""
    plain = {(r["kernels"], r["prompt"]): r["runs"] for r in data.get("plain", [])}
    out = []
    for row in data.get("drafted", []):
        d, p = row["runs"], plain.get((row["kernels"], row["prompt"]))
        if p is None:
            continue
        same = {r["hash"] for r in d} == {r["hash"] for r in p} and len({r["hash"] for r in p}) == 1
        pc, dc = p[0]["decode_tps"], d[0]["decode_tps"]
        out.append({"kernels": row["kernels"], "prompt": row["prompt"], "plain hash": _hash(p),
                    "drafted hash": _hash(d), "drafted == plain (all reps)": "yes" if same else "NO",
                    "plain decode cold": _f(pc, ".2f"), "drafted decode cold": _f(dc, ".2f"),
                    "ratio": _f(dc / pc if pc and dc else None, ".2f") + ("x" if pc and dc else ""),
                    "plain ITL": _f(p[0]["itl_mean_ms"], ".2f"), "drafted ITL": _f(d[0]["itl_mean_ms"], ".2f"),
                    "plain decode warm": _f(_warm(p, "decode_tps"), ".2f"),
                    "drafted decode warm": _f(_warm(d, "decode_tps"), ".2f")})
    return pd.DataFrame(out)


def itl_table(data: dict) -> pd.DataFrame:
    """Decode over the ITL repetitions: median decode tok/s and each rep's, median TTFT and prefill tok/s, median
    mean ITL, ITL p50/p95 over the pooled gaps, token hash."""
    out = []
    for row in data.get("itl", []):
        runs = row["runs"]

        def med(k):
            return statistics.median([r[k] for r in runs]) if all(r[k] is not None for r in runs) else None
        out.append({"mode": row["mode"], "kernels": row["kernels"], "prompt": row["prompt"],
                    "decode tok/s median": _f(med("decode_tps"), ".2f"),
                    f"{len(runs)} reps": "/".join(_f(r["decode_tps"], ".2f") for r in runs),
                    "TTFT s": _f(med("ttft_s"), ".3f"), "prefill tok/s": _f(med("prefill_tps"), ".1f"),
                    "mean ITL ms": _f(med("itl_mean_ms"), ".2f"), "ITL p50": _f(row["itl_p50_ms"], ".1f"),
                    "ITL p95": _f(row["itl_p95_ms"], ".1f"), "token sha": _hash(runs)})
    return pd.DataFrame(out)


def cold_table(data: dict) -> pd.DataFrame:
    """Cold-cache prefill at exact token-id lengths; a length with a run that hit a cache is refused (no numbers)."""
    out = []
    for row in data.get("cold", []):
        runs, c = row["runs"], row["runs"][0]
        ok = row["qualified"]
        verdict = (f"qualified (every rep cold); repeats' TTFT s: "
                   f"{' / '.join(_f(r['ttft_s'], '.2f') for r in runs[1:]) or 'none'}"
                   if ok else f"refused: reps {row['refused_reps']} hit a cache ({c['cache_state']})")
        out.append({"kernels": row["kernels"], "requested tok": row["requested"], "prompt tok": c["prompt_tokens"],
                    "cold prefill TTFT s": _f(c["ttft_s"] if ok else None, ".2f"),
                    "prefill tok/s": _f(c["prefill_tps"] if ok else None, ".1f"),
                    "decode tok/s": _f(c["decode_tps"] if ok else None, ".2f"), "cache state": c["cache_state"],
                    "verdict": verdict, "prefill served": c["path_served"]})
    return pd.DataFrame(out)


def streams_table(data: dict) -> pd.DataFrame:
    """1 and 2 concurrent streams, cold (rep 0: the first run of that count and prompt, which also meets any kernel
    variant not met before) and warm (the median of reps 1..), and equality of every stream with its run alone.
    Per-stream tok/s is aggregate / streams and is left out."""
    out = []
    for row in data.get("streams", []):
        reps = row["reps"]
        c = reps[0] if reps else {}
        rec = {"kernels": row["kernels"], "prompt": row["prompt"], "streams": row["streams"]}
        for label, key, spec in (("aggregate tok/s", "aggregate_tps", ".1f"), ("TTFT max s", "ttft_max_s", ".2f"),
                                 ("mean ITL ms", "itl_mean_ms", ".2f"), ("end-to-end tok/s", "end_to_end_tps", ".1f")):
            rec[f"{label} cold"] = _f(c.get(key), spec)
            rec[f"{label} warm"] = _f(_warm(reps, key), spec)
        rec["ITL p95 ms warm"] = _f(_warm(reps, "itl_p95_ms"), ".1f")
        rec["failed"] = row["failed"]
        rec["equal-to-alone"] = (f"{row['equal_to_alone']} of "
                                 f"{row['equal_to_alone'] + row['not_equal_to_alone'] + row['failed']} streams")
        out.append(rec)
    return pd.DataFrame(out)


def _mib(v) -> str:
    return _f(v / MIB if v is not None else None, ".1f")


def memory_table(data: dict) -> pd.DataFrame:
    """Peak device memory per kernel set (max over its runs), the measured peak of a batched and a bench-path
    prefill of the longest prompt and their difference, the rings' reserved bytes (expert and layer ring), weights on
    the device.

    The rings are reserved when the store is built, so both measured peaks include them: the deep path's extra
    memory over the batched path is the rings' bytes plus the measured difference."""
    cfg, off = data.get("config", {}), data.get("offload") or {}
    out = []
    for m in data.get("memory", []):
        ks = m["kernels"]
        peaks = [r["peak_mem_bytes"] for key in ("plain", "drafted", "itl", "cold") for row in data.get(key, [])
                 if row["kernels"] == ks for r in row["runs"] if r.get("peak_mem_bytes") is not None]
        out.append({"kernels": ks, "peak device MiB": _mib(max(peaks) if peaks else None),
                    "batched prefill peak MiB": _mib(m.get("batched_peak_bytes")),
                    f"{cfg.get('path', 'path')} prefill peak MiB": _mib(m.get("path_peak_bytes")),
                    "extra MiB (measured)": _mib(m.get("extra_bytes")),
                    "rings reserved bytes": cfg.get("ring_bytes", 0),
                    "weights on device MiB": _mib(cfg.get("weights_device_bytes")),
                    "experts off device MiB": _mib(off.get("device_bytes_saved"))})
    return pd.DataFrame(out)


TABLES = (("Plain decode (no drafts)", lambda d: decode_table(d, "plain")),
          ("Drafted decode (MTP head, drafts enabled)", lambda d: decode_table(d, "drafted")),
          ("drafted == plain", drafted_vs_plain_table),
          ("Decode, ITL over repetitions", itl_table),
          ("Cold-cache prefill, exact token-id prompts", cold_table),
          ("Concurrent streams", streams_table),
          ("Memory", memory_table))
# The not_run key (bench._not_run) whose reason replaces a table that was not run.
NOT_RUN_KEY = {"Drafted decode (MTP head, drafts enabled)": "drafted", "drafted == plain": "drafted",
               "Concurrent streams": "streams"}
METRICS = ("Prompts short / code / docs, `gen_tokens` new tokens, temperature 0, end-of-sequence ignored. **Cold** = "
           "the first request of that prompt since the model was loaded, **warm** = the identical repeat, prefilled "
           "again from scratch (the engine holds no prompt cache). TTFT = time to the first generated token; prefill "
           "tok/s = prompt tokens / TTFT; decode tok/s = (generated − 1) / (last token time − first token time); mean "
           "ITL = that span / (generated − 1); ITL p50/p95 over the gaps between tokens. Prefill runs on `bench_path` "
           "at `bench_step`; the *prefill served* column says which plan actually served the rows (a deep run that "
           "fell back to the batched pass shows it). Cold-cache prefill runs exact token-id prompts and refuses a run "
           "whose prefill did not serve every row. Concurrent streams: cold = the first run of that stream count and "
           "prompt (on CUDA, the first run to meet a kernel variant also compiles it), warm = the median of its "
           "repeats.")
STORE_INTRO = ("Where the routed experts' weights lived during the bench. With offload: the rings' reserved bytes, the "
               "bytes kept off the device, the fallback reason (if the ring could not be reserved) and the fetch "
               "counters summed over the whole bench.")


def tables(data: dict) -> dict[str, pd.DataFrame]:
    """Title -> DataFrame of every table (empty DataFrames for tables that were not run)."""
    return {title: fn(data) for title, fn in TABLES}


def _receipt_table(df: pd.DataFrame) -> Table:
    """One of :func:`tables`' frames as a receipt table (its cells are already display strings)."""
    return Table(df, dash="not measured or not applicable: a rate needs two generated tokens, device memory a CUDA "
                          "device, experts off the device offload, and a refused run has no timings")


def expert_store_blocks(data: dict) -> list[Block]:
    """Where the routed experts lived during the bench; with offload, the store's record as a table."""
    off = data.get("offload")
    if not off:
        return [text(STORE_INTRO, "Expert store: resident on the device (no offload): every expert's weights stay "
                                  "in device memory.")]
    return [text(STORE_INTRO, "Expert store: offloaded to host memory."),
            table_block(Table([{"field": k, "value": v} for k, v in off.items()], dash="not recorded"))]


def config_line(data: dict) -> str:
    """One line: preset, device, dtype, weights, KV cache, prefill path, gen tokens, reps, offload, prompt cache,
    not-run notes."""
    c = data["config"]
    off = data.get("offload")
    offload = "off" if not c["offload"] else (
        f"on (rings {c['ring_bytes']} bytes" + ("" if off["deep_ready"] else f"; NO RING: {off['fallback_reason']}")
        + (f"; no layer ring: {off['layer_ring_reason']}" if off.get("layer_ring_reason") else "") + ")")
    return (f"{c['preset']} on {c['device_name']} ({c['dtype']}; weights {c.get('weights', 'bf16')}, KV cache "
            f"{c.get('kv_dtype', 'bf16')}); prefill {c['path']}@{c['step']} (deep threshold "
            f"{c['deep_threshold']}); {c['gen_tokens']} new tokens, temperature 0, EOS ignored; {c['reps']} reps "
            f"(cold = rep 0, warm = repeat), ITL over {c['itl_reps']} reps; MTP k={c['mtp_k']}; expert offload "
            f"{offload}; prompt cache {c['prompt_cache']}"
            + ("; the forwards after the prefill (plain replies' and concurrent streams' decode steps, drafted runs' "
               "verify, decode and MTP head forwards) replayed from CUDA graphs where their shape can be captured "
               "(graphs.GraphForward, one per shape; a drafted run's captured at a shape's second call; each run's "
               "`decode_graphs` says whether they served and, per shape, why not)" if c.get("decode_graphs") else ""))


def table_blocks(data: dict) -> list[Block]:
    """Each table under its heading; a table that was not run shows the reason, an empty one says so."""
    not_run = data.get("not_run", {})
    out = []
    for title, df in tables(data).items():
        reason = not_run.get(NOT_RUN_KEY.get(title, ""))
        out.append(heading(title, 3))
        out.append(text(f"_{reason}_") if reason else text("_no rows_") if df.empty else
                   table_block(_receipt_table(df)))
    return out


def blocks(section: dict) -> list[Block]:
    """The section's view (blocks.py; accepts the section object or its ``data``): intro, the config line and the
    metrics' definitions, each table, and the expert store."""
    data = section.get("data", section)
    return ([heading("Bench"), text(INTRO, config_line(data), METRICS)] + table_blocks(data)
            + [heading("Expert store", 3)] + expert_store_blocks(data))


def render_md(section: dict) -> str:
    """receipt.md's block of the section: its :func:`blocks` as markdown."""
    return to_markdown(blocks(section)) + "\n"
