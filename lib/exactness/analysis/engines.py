"""The ``engines`` section: the hash matrix and stream equalities of engines under test (engines/: our reference
engine, transformers, OpenAI-compatible servers, llama.cpp), and a cross-engine view when several run.

For each engine and prompt, every configuration runs greedily and is compared with the engine's oracle
configuration: generated tokens (always), and where the engine exposes them, the bytes of every prompt logit row,
of every generated logit row and of the KV cache. A run equals its oracle only when every compared part is equal;
its verdict names what differed and what the engine did not expose (never counted as equal). The stream equalities
(drafted == plain, resumed == fresh, concurrent == alone) are judged the same way, or recorded as "not available
from this engine" with the engine's reason. Markdown: analysis/engines_md.py.
"""
from __future__ import annotations

import time

import torch

from ..engines import open_engine, parse_spec
from ..engines.base import Engine, EngineError, Generation, NotAvailable
from ..exact import bytes_equal, differing_rows, first_differing_row, token_hash
from ..receipt.params import EnginesParams
from ..progress import bar as progress_bar
from .engines_md import (INTRO, bench_block, cross_table, engines_table, hash_table, render_md,  # noqa: F401
                         streams_block, verdict_md)

def not_kernel_level(section: str) -> str:
    """Why the kernel-level section ``section`` is not computed from engines, and how to get it."""
    return ("needs kernel-level access: our reference engine (make receipts without ENGINE), or the engine's tensor "
            f"dumps (make receipts DUMPS=DIR, or python -m exactness {section} --dumps DIR)")


def _rows_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[bool | None, int | None, int]:
    """(every row byte-equal, first differing row, count) of two [R, V] tensors; (None, None, 0) where either is
    missing; a shape mismatch counts every row of the longer one as differing."""
    if a is None or b is None:
        return None, None, 0
    if a.shape != b.shape:
        return False, 0, max(a.shape[0], b.shape[0])
    d = differing_rows(a, b)
    return not bool(d.any()), (int(d.nonzero()[0]) if d.any() else None), int(d.sum())


def _kv_equal(a: list | None, b: list | None) -> tuple[bool | None, int | None]:
    """(all KV tensors byte-equal, index of the first differing tensor) or (None, None) where not exposed."""
    if a is None or b is None:
        return None, None
    if len(a) != len(b):
        return False, 0
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x.shape != y.shape or not bytes_equal(x, y)), None)
    return first is None, first


def verdict(tokens: bool, parts: dict[str, bool | None]) -> str:
    """One line: "equal" when tokens and every exposed part are equal ("equal (tokens only: X not exposed)" when
    some were not exposed), else "differs: <what differed>"."""
    failed = (["tokens"] if not tokens else []) + [k for k, v in parts.items() if v is False]
    missing = [k for k, v in parts.items() if v is None]
    if failed:
        return "differs: " + ", ".join(failed)
    return "equal" + (f" ({', '.join(missing)} not exposed)" if missing else "")


def compare(run: Generation, ref: Generation) -> dict:
    """Row fields comparing a run with its reference: tokens, prompt-logit rows, generated-logit rows, KV bytes."""
    div = first_differing_row(run.gen_ids, ref.gen_ids)
    p_eq, p_first, p_count = _rows_equal(run.prompt_logits, ref.prompt_logits)
    g_eq, g_first, _ = _rows_equal(run.gen_logits, ref.gen_logits)
    kv_eq, kv_first = _kv_equal(run.kv, ref.kv)
    margin = None
    if div is not None and ref.gen_logits is not None and div < ref.gen_logits.shape[0]:
        top = torch.topk(ref.gen_logits[div].float(), 2).values
        margin = float(top[0] - top[1])
    return {"equals_oracle": div is None, "first_divergence": div, "oracle_margin": margin,
            "prompt_logits_equal": p_eq, "prompt_rows_differing": p_count, "first_differing_prompt_row": p_first,
            "gen_logits_equal": g_eq, "first_differing_gen_row": g_first, "kv_equal": kv_eq, "kv_first_tensor": kv_first,
            "verdict": verdict(div is None, {"prompt logits": p_eq, "generated logits": g_eq, "KV": kv_eq})}


def _row(engine: Engine, prompt: str, ids: list[int], run: Generation, seconds: float) -> dict:
    return {"engine": engine.kind, "prompt": prompt, "prompt_tokens": len(ids), "config": run.config,
            "oracle": engine.oracle, "gen_tokens": int(run.gen_ids.numel()), "hash": token_hash(run.gen_ids),
            "ttft_s": round(run.ttft_s, 4), "decode_s": round(run.decode_s, 4), "seconds": round(seconds, 3)}


def hash_rows(engine: Engine, prompts: dict[str, list[int]], gen_tokens: int, bar=None) -> list[dict]:
    """Every (prompt, configuration) of ``engine``, the oracle first, each compared with the oracle (compare)."""
    rows, names = [], [engine.oracle] + [c.name for c in engine.configurations() if c.name != engine.oracle]
    for prompt, ids in prompts.items():
        oracle = None
        for name in names:
            t0 = time.perf_counter()
            run = engine.generate(ids, gen_tokens, name)
            oracle = oracle or run
            rows.append({**_row(engine, prompt, ids, run, time.perf_counter() - t0), **compare(run, oracle)})
            if bar is not None:
                bar.update(1)
    return rows


def _try(fn) -> tuple[object, str | None]:
    try:
        return fn(), None
    except NotAvailable as e:
        return None, f"not available from this engine: {e}"


def stream_rows(engine: Engine, prompts: dict[str, list[int]], gen_tokens: int, config: str) -> dict:
    """drafted == plain, resumed == fresh (prefix: the first half of the prompt), concurrent == alone (every prompt
    at once) under ``config``; each a list of rows (compare fields plus ``check``), or a reason under
    ``not_available``."""
    out, reasons = {"drafted": [], "resumed": [], "concurrent": []}, {}
    alone = {p: engine.generate(ids, gen_tokens, config) for p, ids in prompts.items()}
    checks = {"drafted": lambda p, ids: engine.drafted(ids, gen_tokens, config),
              "resumed": lambda p, ids: engine.resumed(ids[:max(1, len(ids) // 2)], ids, gen_tokens, config)}
    for check, fn in checks.items():
        for p, ids in prompts.items():
            run, why = _try(lambda: fn(p, ids))
            if why:
                reasons[check] = why
                break
            out[check].append({"check": check, "prompt": p, "config": config, **compare(run, alone[p]),
                               "info": run.info})
    runs, why = _try(lambda: engine.concurrent(list(prompts.values()), gen_tokens, config))
    if why:
        reasons["concurrent"] = why
    for (p, _), run in zip(prompts.items(), runs or []):
        out["concurrent"].append({"check": "concurrent", "prompt": p, "config": config, "streams": len(prompts),
                                  **compare(run, alone[p])})
    return {**out, "not_available": reasons}


def cross_engine(rows: list[dict]) -> list[dict]:
    """Per prompt, every engine's configurations against the first engine's oracle tokens: its hash, whether the
    tokens are equal and the first divergent generated index."""
    out, first = [], {}
    for r in rows:
        ref = first.setdefault(r["prompt"], r)
        out.append({"prompt": r["prompt"], "engine": r["engine"], "config": r["config"], "hash": r["hash"],
                    "reference": f"{ref['engine']}:{ref['config']}", "tokens_equal": r["hash"] == ref["hash"]})
    return out


def build_prompts(engine: Engine, names: list[str], max_tokens: int | None, allow_unpinned: bool) -> dict:
    """{name: token ids} of the named prompts (prompts.py, pins checked) in the engine's tokenizer, cut to the first
    ``max_tokens`` ids (None: whole)."""
    from ..prompts import build_prompt
    out = {}
    for name in names:
        ids = engine.encode(build_prompt(name, None, allow_unpinned).text.decode("utf-8"))
        out[name] = ids[:max_tokens] if max_tokens else ids
    return out


def run_section(params: EnginesParams | dict) -> dict:
    """The ``engines`` section.

    params: EnginesParams (or a dict of its fields): engine (list of engine specs, engines/__init__.py), prompts,
    prompt_max_tokens / engine_max_tokens (prompt cut, tokens), gen_tokens, steps (each adapter's chunk or batch
    sizes), device, dtype, kernel_sets (the reference engine runs once per set), engine_streams (run the stream
    equalities), engine_bench (the bench tables of every configuration, analysis/engines_bench.py),
    engine_cold_lengths (the bench's cold-prefill prompt lengths, tokens), allow_unpinned.
    Returns:
        {"section": "engines", "engines": [identity...], "rows": [...], "streams": {label: {...}},
        "bench": {label: {...}} (with engine_bench), "cross": [...],
        "not_available": {"contract": ..., "fp64": ...}, "errors": [...]}; an engine that fails is recorded in
        ``errors`` (engine, what failed) and the others still run.
    Raises:
        ParamError / ValueError: bad parameters or engine specs, before any engine runs.
    """
    p = EnginesParams.from_dict(params)
    common = dict(device=p.device, dtype=p.dtype, steps=list(p.steps), kernel_sets=list(p.kernel_sets or []),
                  preset=p.preset, deep_threshold=p.deep_threshold)
    section = {"section": "engines", "engines": [], "rows": [], "streams": {}, "errors": [],
               "not_available": {s: not_kernel_level(s) for s in ("contract", "fp64")}}
    with progress_bar(None, "engines", "run") as bar:
        for spec in p.engine:
            kind, _, options = parse_spec(spec)
            ours = kind == "reference" and "kernels" not in options
            for ks in (p.kernel_sets if ours else [None]):   # our engine: one engine per kernel set
                _run_engine(spec, {**common, "kernels": ks}, p, section, bar)
    section["cross"] = cross_engine(section["rows"]) if len(section["engines"]) > 1 else []
    return section


def _run_engine(spec: str, common: dict, p: EnginesParams, section: dict, bar) -> None:
    engine = open_engine(spec, **{k: v for k, v in common.items() if v is not None})
    label = f"{spec}:{common['kernels']}" if common.get("kernels") else spec
    try:
        section["engines"].append({"spec": label, "oracle": engine.oracle, **engine.identity()})
        prompts = build_prompts(engine, p.prompts, p.max_tokens, p.allow_unpinned)
        section["rows"] += [{**r, "engine": label} for r in hash_rows(engine, prompts, p.gen_tokens, bar)]
        if p.engine_streams:
            config = next(c.name for c in engine.configurations() if c.name != engine.oracle)
            section["streams"][label] = stream_rows(engine, prompts, p.gen_tokens, config)
        if p.engine_bench:
            from .engines_bench import bench_engine
            full = build_prompts(engine, p.prompts, None, p.allow_unpinned)   # cold prompts are cut from these
            source = [i for ids in full.values() for i in ids]
            section.setdefault("bench", {})[label] = bench_engine(engine, prompts, p.gen_tokens,
                                                                 list(p.engine_cold_lengths), source)
    except EngineError as e:
        section["errors"].append({"engine": label, "error": str(e)})
    finally:
        engine.close()
