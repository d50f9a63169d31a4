"""The ``hashes`` section given engines (``engine``): the hash matrix and stream equalities of engines under test
(engines/: our reference engine, transformers, OpenAI-compatible servers, llama.cpp), and a cross-engine view when
several run; and the one comparison of a run with its reference every hash row and stream row is made with.

For each engine and prompt, every configuration runs greedily and is compared with the engine's oracle
configuration: generated tokens (always), and where the engine exposes them, the bytes of every prompt logit row
(or a server's prompt logprob row), of every generated logit row and of the KV cache. A run equals its oracle only
when every compared part is equal; its verdict names what differed and what the engine did not expose (never
counted as equal). A run or oracle found not greedy (a chosen token below its row's top-1) is "not greedy: ...",
never compared; tokens that are a server's lossy text are "equal as text, lossy: ...", counted apart. The stream
equalities (drafted == plain, resumed == fresh, concurrent == alone) are judged the same way, or recorded as "not
available from this engine" with the engine's reason. Markdown: analysis/engines_md.py.
"""
from __future__ import annotations

import time

import torch

from ..engines import open_engine, parse_spec
from ..engines.base import Engine, EngineError, NotAvailable
from ..exact import NOT_EXPOSED, Verdict, compare as exact_compare, token_hash
from ..params import HashesParams
from ..progress import bar as progress_bar
from ..run import Run
from .engines_dumps import run_engine_dumps
from .repeat import many_prompts, prompt_counts, run_repeat


def not_kernel_level(section: str) -> str:
    """Why the kernel-level section ``section`` is not computed from engines, and how to get it."""
    return ("needs kernel-level access: our reference engine (make receipts without ENGINE), or the engine's tensor "
            f"dumps (make receipts DUMPS=DIR, or python -m exactness {section} --dumps DIR)")


def verdict(v: Verdict, not_greedy: str | None = None, lossy: list | None = None) -> str:
    """One line: "not greedy: <where>" when the run or its reference was not greedy (never compared as greedy);
    else the Verdict's line ("equal", "equal (not exposed: X, Y)" or "differs: <what differed>"), with the lossy
    text named where the tokens are texts a server may have lost bytes of ("equal as text, lossy: <what was
    lost>" where nothing differed)."""
    if not_greedy:
        return f"not greedy: {not_greedy}"
    if v.failed:
        return v.line() + (f" (lossy text: {'; '.join(lossy)})" if lossy else "")
    return "equal as text, lossy: " + "; ".join(lossy) if lossy else v.line()


def _not_greedy(run: Run, ref: Run) -> str | None:
    """Where the run or its reference is known not greedy (Run.greedy False), in words, else None."""
    for who, g in (("this run", run), (f"its reference {ref.config}", ref)):
        if g.greedy is False:
            c = g.info.get("greedy_check") or {}
            return (f"{who} chose a token below the top-1 at position {c.get('position')} (logprob "
                    f"{c.get('chosen_logprob')} < {c.get('top1_logprob')})")
    return None


DIFF_BINS = 256  # the logit-difference curve keeps at most this many points per run


def _binned_max(diff: torch.Tensor) -> list[float]:
    """Per-position values [P] -> at most DIFF_BINS maxima over equal-width position bins."""
    P = diff.numel()
    width = max(1, -(-P // DIFF_BINS))
    pad = (-P) % width
    d = torch.cat([diff, diff.new_zeros(pad)]) if pad else diff
    return [float(v) for v in d.view(-1, width).amax(dim=1)]


def _logit_diff(run: Run, ref: Run, curve: bool) -> dict:
    """The prompt rows' largest |logit difference| and, with ``curve``, its binned curve (``_curve``: None for the
    reference itself), where both runs carry the same prompt rows; else {}."""
    a, b = run.prompt_logits, ref.prompt_logits
    if a is None or b is None or a.shape != b.shape:
        return {}
    row_diff = (a - b).abs().amax(dim=1)                                            # [P] fp32
    out = {"max_prompt_logit_diff": float(row_diff.max()) if row_diff.numel() else 0.0}
    return {**out, "_curve": None if run is ref else _binned_max(row_diff)} if curve else out


def compare(run: Run, ref: Run, curve: bool = False) -> dict:
    """Row fields comparing a run with its reference, for every engine (exact.compare: tokens, prompt-logit rows,
    prompt logprobs (servers), generated-logit rows, KV bytes; the first difference of each and the reference's
    margin there); a run or reference not greedy, or tokens that are lossy text, is never counted as equal
    (equals_oracle None where the tokens agree). Where both carry prompt logits: the largest |difference| and, with
    ``curve``, its per-position curve (``_curve``, for the section's plot)."""
    v = exact_compare(run, ref)
    ng = _not_greedy(run, ref)
    ref_lost = [] if ref is run else [f"reference {ref.config}: {x}" for x in ref.info.get("lost") or []]
    lossy = (run.info.get("lost") or []) + ref_lost or None
    p, lp, g, kv = v.prompt_rows, v.prompt_logprobs or NOT_EXPOSED, v.gen_rows, v.kv.first or {}
    return {"equals_oracle": False if not v.tokens.equal else (None if ng or lossy else True),
            "first_divergence": v.tokens.first, "oracle_margin": v.oracle_margin,
            "prompt_logits_equal": p.equal, "prompt_rows_differing": p.count, "first_differing_prompt_row": p.first,
            "prompt_logprobs_equal": lp.equal,
            "prompt_logprob_rows_differing": None if lp.equal is None else lp.count,
            "first_differing_prompt_logprob_row": lp.first,
            "gen_logits_equal": g.equal, "first_differing_gen_row": g.first,
            "kv_equal": v.kv.equal,   # None: a run kept no cache, KV not compared
            "kv_first_position": kv.get("position"), "kv_first_layer": kv.get("layer"),
            "kv_first_tensor": kv.get("tensor"),
            "greedy": run.greedy, "lossy": lossy, "verdict": verdict(v, ng, lossy), **_logit_diff(run, ref, curve)}


def _prompt_tokens(ids, run: Run) -> int | None:
    """Tokens of the prompt: its ids, or for a chat prompt sent as messages what the server counted (else None)."""
    if isinstance(ids, (list, tuple, torch.Tensor)):
        return len(ids)
    return ((run.info or {}).get("usage") or {}).get("prompt_tokens")


def _row(engine: Engine, prompt: str, ids: list[int], run: Run, seconds: float) -> dict:
    return {"engine": engine.kind, "prompt": prompt, "prompt_tokens": _prompt_tokens(ids, run), "config": run.config,
            "oracle": engine.oracle, "gen_tokens": int(run.gen_ids.numel()), "hash": token_hash(run.gen_ids),
            "ttft_s": round(run.ttft_s, 4), "decode_s": round(run.decode_s, 4), "seconds": round(seconds, 3)}


def oracle_runs(engine: Engine, ids, gen_tokens: int, configs: list, *, run=None, oracle: Run | None = None):
    """The hash matrix's walk over one prompt: each of ``configs`` run in order by ``run(config) -> Run`` (default:
    engine.generate of ``ids``), yielded as (config, its Run, the oracle's Run, seconds). The oracle is ``oracle``
    when given, else the first configuration's run (yielded as its own oracle)."""
    run = run or (lambda config: engine.generate(ids, gen_tokens, config))
    for config in configs:
        t0 = time.perf_counter()
        r = run(config)
        oracle = oracle or r
        yield config, r, oracle, time.perf_counter() - t0


def hash_rows(engine: Engine, prompts: dict[str, list[int]], gen_tokens: int, bar=None) -> list[dict]:
    """Every (prompt, configuration) of ``engine``, the oracle first, each compared with the oracle (compare)."""
    rows, names = [], [engine.oracle] + [c.name for c in engine.configurations() if c.name != engine.oracle]
    for prompt, ids in prompts.items():
        for _, run, oracle, seconds in oracle_runs(engine, ids, gen_tokens, names):
            rows.append({**_row(engine, prompt, ids, run, seconds), **compare(run, oracle)})
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


def build_prompts(engine: Engine, entries: list[str], max_tokens: int | None, allow_unpinned: bool,
                  records: list | None = None) -> dict:
    """{name: prompt} of a ``prompts`` list (built-in names, pins checked, and prompt files: prompt_files.py) for
    ``engine``, each cut to its first ``max_tokens`` ids (None: whole): text through ``engine.encode``, ids as they
    are, a chat prompt as an engines.base.Chat where the engine has the ``chat`` capability (uncut; the server
    applies its template), through ``engine.encode_chat`` with ``chat_template``, else the ids of
    prompts.plain_chat_text. ``records``, when given, receives each prompt's name, kind, sha256, tokens (None for a
    Chat sent as messages), file and template (``server``, ``model`` or ``plain``)."""
    from ..engines.base import Chat
    from ..prompt_files import resolve
    from ..prompts import build_prompt, plain_chat_text

    out = {}
    for s in resolve(entries):
        template = None
        if s.kind == "builtin":
            pr = build_prompt(s.name, None, allow_unpinned)
            ids, sha = engine.encode(pr.text.decode("utf-8")), pr.sha256
        elif s.kind == "chat":
            chat = Chat(s.messages)
            template = ("server" if "chat" in engine.capabilities
                        else "model" if "chat_template" in engine.capabilities else "plain")
            ids = (chat if template == "server" else engine.encode_chat(chat) if template == "model"
                   else engine.encode(plain_chat_text(chat)))
        else:
            ids = list(s.ids) if s.kind == "ids" else engine.encode(s.text)
        ids = ids[:max_tokens] if max_tokens and not isinstance(ids, Chat) else ids
        out[s.name] = ids
        if records is not None:
            records.append({"name": s.name, "kind": s.kind, "sha256": sha if s.kind == "builtin" else s.sha256,
                            "tokens": None if isinstance(ids, Chat) else len(ids), "file": s.file,
                            "template": template})
    return out


def id_prompts(prompts: dict) -> dict:
    """The prompts given as token ids (a chat prompt sent as messages has none to cut, resume or batch: the stream
    equalities and the bench leave it out)."""
    return {name: ids for name, ids in prompts.items() if isinstance(ids, list)}


def run_engines(p: HashesParams) -> dict:
    """The hash matrix of the engines ``p.engine`` names (the ``hashes`` section when engines are given).

    p: the section's parameters (analysis/hashes.py documents each): engine (engine specs, engines/__init__.py),
    prompts, hash_max_tokens / prompt_max_tokens (prompt cut, tokens), gen_tokens, steps (each adapter's chunk or
    batch sizes), device, dtype, kernel_sets (our engine runs once per set), engine_streams (run the stream
    equalities), engine_bench (the bench tables of every configuration, analysis/engines_bench.py),
    engine_cold_lengths (the bench's cold-prefill prompt lengths, tokens), allow_unpinned; the repeat test
    (analysis/repeat.py): engine_repeat (N requests of one prompt, 0 = off), engine_repeat_concurrency (requests in
    flight per level), engine_repeat_prompt (default the first), engine_repeat_tokens, engine_repeat_configs
    (default: every server configuration, an in-process engine's streams configuration), engine_repeat_only (skip
    the hash matrix and stream equalities); engine_dumps (off, on-differ, always or a folder: engines_dumps.py).
    Returns:
        {"section": "hashes", "engines": [identity...], "prompts": {label: [build_prompts' records]},
        "rows": [...] (with prompt_kind, prompt_sha256, template), "streams": {label: {...}},
        "bench": {label: {...}} (with engine_bench), "repeat": {label: repeat.repeat_engine's} (with
        engine_repeat), "engine_dumps": {label: engines_dumps.engine_dumps'} (with engine_dumps), "prompt_counts":
        [...] (repeat.prompt_counts, over MANY_PROMPTS prompts), "cross": [...],
        "not_available": {"contract": ..., "fp64": ...}, "errors": [...], "failures": [...]}; an engine that fails
        (EngineError: it did not start, a server's error or dropped stream) is recorded in ``errors`` (engine, what
        failed) and the others still run; ``failures`` ({ename, evalue}: each error, or that no run was compared
        with an oracle) make the receipt failed (receipt/runner.py).
    Raises:
        ValueError: bad engine specs, before any engine runs.
    """
    common = dict(device=p.device, dtype=p.dtype, steps=list(p.steps), kernel_sets=list(p.kernel_sets or []),
                  preset=p.preset, deep_threshold=p.deep_threshold)
    section = {"section": "hashes", "engines": [], "rows": [], "streams": {}, "errors": [],
               "not_available": {s: not_kernel_level(s) for s in ("contract", "fp64")}}
    with progress_bar(None, "engines", "run") as bar:
        for spec in p.engine:
            kind, _, options = parse_spec(spec)
            ours = kind == "reference" and "kernels" not in options
            for ks in (p.kernel_sets if ours else [None]):   # our engine: one engine per kernel set
                _run_engine(spec, {**common, "kernels": ks}, p, section, bar)
    section["cross"] = cross_engine(section["rows"]) if len(section["engines"]) > 1 else []
    if many_prompts(section["rows"]):
        section["prompt_counts"] = prompt_counts(section["rows"])
    section["failures"] = _failures(section)
    return section


def _failures(section: dict) -> list[dict]:
    """What makes the receipt of this section failed ({ename, evalue}, receipt/runner.py): each engine error, or
    that nothing was compared (no run against an oracle or another engine, no stream equality, no repeat)."""
    out = [{"ename": "EngineError", "evalue": f"engine {e['engine']}: {e['error']}"} for e in section["errors"]]
    compared = (sum(r["config"] != r["oracle"] for r in section["rows"]) + len(section["cross"])
                + sum(len(v) for st in section["streams"].values() for v in st.values() if isinstance(v, list))
                + sum(max(lv["completions"] - 1, 0) for r in (section.get("repeat") or {}).values()
                      for levels in r["configs"].values() for lv in levels))
    if not compared and not out:
        out.append({"ename": "NothingCompared", "evalue": "engines: no run was compared (each engine ran its oracle "
                    "configuration only, no stream equality or repeat test ran); add configurations or a second "
                    "engine"})
    return out


def _run_engine(spec: str, common: dict, p: HashesParams, section: dict, bar) -> None:
    label = f"{spec}:{common['kernels']}" if common.get("kernels") else spec
    engine = None
    try:   # an engine that fails to start (a launched server that never answers) is an error of that engine
        engine = open_engine(spec, **{k: v for k, v in common.items() if v is not None})
        section["engines"].append({"spec": label, "oracle": engine.oracle, **engine.identity()})
        records = section.setdefault("prompts", {}).setdefault(label, [])
        prompts = build_prompts(engine, p.prompts, p.max_tokens, p.allow_unpinned, records)
        meta = {r["name"]: {"prompt_kind": r["kind"], "prompt_sha256": r["sha256"], "template": r["template"]}
                for r in records}
        matrix = not p.engine_repeat_only   # the repeat test alone skips the hash matrix and stream equalities
        section["rows"] += [{**r, "engine": label, **meta[r["prompt"]]}
                            for r in (hash_rows(engine, prompts, p.gen_tokens, bar) if matrix else [])]
        run_engine_dumps(engine, label, prompts, p, section)   # the first op that broke, per differing configuration
        if p.engine_streams and matrix:
            config = next((c.name for c in engine.configurations() if c.name != engine.oracle), engine.oracle)
            section["streams"][label] = stream_rows(engine, id_prompts(prompts), p.gen_tokens, config)
        if p.engine_bench:
            from .engines_bench import bench_engine
            full = build_prompts(engine, p.prompts, None, p.allow_unpinned)   # cold prompts are cut from these
            source = [i for ids in id_prompts(full).values() for i in ids]
            section.setdefault("bench", {})[label] = bench_engine(engine, id_prompts(prompts), p.gen_tokens,
                                                                 list(p.engine_cold_lengths), source)
        if p.engine_repeat:
            run_repeat(engine, label, prompts, p, section)
    except EngineError as e:
        section["errors"].append({"engine": label, "error": str(e)})
    finally:
        if engine is not None:
            engine.close()
