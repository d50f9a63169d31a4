"""The counts of the hash matrix run on engines: the same request N times under load (distinct completions), and
many prompts read as counts. Markdown and the notebook's plot: analysis/repeat_md.py.

Repeat test (:func:`repeat_engine`): ONE prompt sent N times greedily at each concurrency level c (at most c
requests in flight). A server (the ``openai`` engine) gets N streamed requests through the adapter's ``generate``
(so its greedy knobs and checks apply) from c threads, and only where it listens on this machine (the hosts of
params_engines.LOCAL_HOSTS): the loop is bounded and never loads a remote host. An in-process engine runs the N
requests in batches of c through ``Engine.concurrent`` (one batch each; c = 1 runs ``generate`` alone).
Completions are told apart by their exact token ids, or by the exact UTF-8 bytes of the text where a server returns
text only (``compared_as`` says which). Per level: N, the requests that failed (an error of the test, never a
completion; each such level is also an entry of the section's ``errors``), the replies the adapter found not greedy
(counted apart), the distinct completions most common first with their counts, and the first generated position at
which each minority completion leaves the most common one.

Many prompts (:func:`prompt_counts`): with more than MANY_PROMPTS prompts, per engine and configuration the prompts
whose tokens equal the oracle's (k of n), the first-divergence positions and the smallest oracle top-1 margin at a
flip; the rows themselves stay in the section.
"""
from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from ..engines.base import Engine, EngineError, NotAvailable
from ..exact import first_differing_row, token_hash
from ..progress import bar as progress_bar
from ..params_engines import check_local

MANY_PROMPTS = 20    # more prompts than this: the engines' matrix shows counts, not one row per run
KEEP_ERRORS = 3      # failure messages kept per level
KEEP_GROUPS = 100    # distinct completions kept per level (each with its ids); the count is always whole


class _NoBar:
    def update(self, n: int) -> None:
        pass


def parting(a, b) -> int | None:
    """The first position where id sequences ``a`` and ``b`` differ (the shorter length where one is a prefix of
    the other), or None where they are equal (exact.first_differing_row of the ids)."""
    return first_differing_row(torch.tensor(a, dtype=torch.int64), torch.tensor(b, dtype=torch.int64))


def distinct(completions: list[tuple]) -> list[dict]:
    """The distinct completions of ``completions`` (tuples of ids), most common first (ties: first seen): hash,
    count, share of the completions, parts_at (parting from the first one; None for it), first_request (index in
    ``completions``), ids."""
    counts, first = Counter(completions), {}
    for i, c in enumerate(completions):
        first.setdefault(c, i)
    order = sorted(counts, key=lambda c: (-counts[c], first[c]))
    return [{"hash": token_hash(list(c)), "count": counts[c], "share": counts[c] / len(completions),
             "parts_at": parting(c, order[0]) if k else None, "first_request": first[c], "ids": list(c)}
            for k, c in enumerate(order)]


def _server_level(engine: Engine, ids: list[int], n: int, c: int, tokens: int, config: str, bar) -> tuple[list, list]:
    """N requests from c threads; (Run or None per request, failure messages). An interrupt (Ctrl-C)
    cancels the requests not yet sent and waits only for the c in flight."""
    gens, errors = [], []
    pool = ThreadPoolExecutor(c)
    try:
        futures = [pool.submit(engine.generate, ids, tokens, config) for _ in range(n)]
        for f in futures:
            try:
                gens.append(f.result())
            except EngineError as e:
                gens.append(None)
                errors.append(str(e))
            bar.update(1)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return gens, errors


def _batched_level(engine: Engine, ids: list[int], n: int, c: int, tokens: int, config: str, bar) -> tuple[list, list]:
    """N requests in batches of c through concurrent (generate at c = 1); a batch that fails fails every request
    in it. Raises NotAvailable where the engine cannot batch."""
    gens, errors = [], []
    for start in range(0, n, c):
        k = min(c, n - start)
        try:
            gens += [engine.generate(ids, tokens, config)] if c == 1 else engine.concurrent([ids] * k, tokens, config)
        except EngineError as e:
            gens += [None] * k
            errors += [str(e)] * k
        bar.update(k)
    return gens, errors


def repeat_level(engine: Engine, ids: list[int], n: int, c: int, tokens: int, config: str, bar=None) -> dict:
    """The repeat test at one concurrency level (module docstring); ``bar`` (progress.bar) counts requests.

    Returns:
        {concurrency, requests, failed, errors (first KEEP_ERRORS messages), not_greedy (replies whose chosen token
        was not the top-1 of its logprobs: counted apart, never as completions), greedy_checked (completions checked
        greedy), completions, distinct, largest_share,
        first_parting (the earliest parts_at of a minority completion, None with one), compared_as, largest_batch
        (rows the engine reported batching at once, None where not reported), wall_s, groups (distinct(), the first
        KEEP_GROUPS)}.
    Raises:
        NotAvailable: an in-process engine that cannot run requests together (c > 1).
    """
    c = min(c, n)
    t0 = time.perf_counter()
    level = _server_level if engine.kind == "openai" else _batched_level
    gens, errors = level(engine, ids, n, c, tokens, config, bar or _NoBar())
    wall = time.perf_counter() - t0
    off = [g for g in gens if g is not None and g.greedy is False]   # the adapter saw a chosen token below top-1
    done = [g for g in gens if g is not None and g.greedy is not False]
    groups = distinct([tuple(int(i) for i in g.gen_ids.tolist()) for g in done]) if done else []
    kinds = {g.info.get("gen_ids_are", "token ids") for g in done}
    batches = [g.info["batch_rows"] for g in done if isinstance(g.info.get("batch_rows"), int)]
    return {"concurrency": c, "requests": n, "failed": len(errors), "errors": errors[:KEEP_ERRORS],
            "not_greedy": len(off), "greedy_checked": sum(g.greedy is True for g in done),
            "completions": len(done), "distinct": len(groups),
            "largest_share": groups[0]["share"] if groups else None,
            "first_parting": min((g["parts_at"] for g in groups[1:]), default=None),
            "compared_as": " and ".join(sorted(kinds)) or None, "largest_batch": max(batches, default=None),
            "wall_s": round(wall, 3), "groups": groups[:KEEP_GROUPS]}


def repeat_configs(engine: Engine, names: list[str]) -> list[str]:
    """The configurations the repeat test runs on: ``names`` where given, else every configuration of a server
    engine (one server each) and the stream equalities' configuration of an in-process one (the first that is not
    the oracle, else the oracle).

    Raises:
        ValueError: a name the engine does not have (lists the ones it has).
    """
    have = [c.name for c in engine.configurations()]
    bad = [n for n in names if n not in have]
    if bad:
        raise ValueError(f"engine_repeat_configs: {engine.kind} engine has no configuration {bad[0]!r}; it has: "
                         f"{', '.join(have)}")
    if names:
        return list(names)
    if engine.kind == "openai":
        return have
    return [next((n for n in have if n != engine.oracle), engine.oracle)]


def repeat_engine(engine: Engine, prompt: str, ids: list[int], requests: int, levels: list[int], tokens: int,
                  configs: list[str] = ()) -> dict:
    """The repeat test of one engine: ``requests`` greedy requests for ``tokens`` tokens after ``ids`` at every
    concurrency level in ``levels``, on each configuration of repeat_configs(engine, configs).

    Returns:
        {prompt, prompt_tokens, gen_tokens, requests, configs: {config: [repeat_level dicts]}, not_available:
        {config: reason}}.
    Raises:
        ValueError: an unknown configuration; ParamError: a server engine's base URL off this machine.
    """
    out = {"prompt": prompt, "prompt_tokens": len(ids) if isinstance(ids, list) else None, "gen_tokens": tokens,
           "requests": requests, "configs": {}, "not_available": {}}
    names = repeat_configs(engine, list(configs))
    if engine.kind == "openai":
        for name in names:
            check_local(engine.endpoints[name].base_url, f"configuration {name!r}")
    with progress_bar(requests * len(levels) * len(names), "repeat", "request") as bar:
        for name in names:
            rows = out["configs"][name] = []
            for c in levels:
                try:
                    rows.append(repeat_level(engine, ids, requests, c, tokens, name, bar))
                except NotAvailable as e:
                    out["not_available"][name] = f"concurrency {c}: not available from this engine: {e}"
                    break
    return out


def run_repeat(engine: Engine, label: str, prompts: dict, p, section: dict) -> None:
    """The repeat test of ``engine`` (named ``label``) as the hash matrix runs it with HashesParams ``p``:
    on engine_repeat_prompt (default the first prompt); the result goes to ``section["repeat"][label]``, failed
    levels to ``section["errors"]``.

    Raises:
        ValueError: engine_repeat_prompt not among ``prompts`` (names them).
    """
    name = p.engine_repeat_prompt or next(iter(prompts))
    if name not in prompts:
        raise ValueError(f"engine_repeat_prompt {name!r} is not a prompt of this run; allowed: {', '.join(prompts)}")
    res = repeat_engine(engine, name, prompts[name], p.engine_repeat, list(p.engine_repeat_concurrency),
                        p.engine_repeat_tokens, list(p.engine_repeat_configs))
    section.setdefault("repeat", {})[label] = res
    section["errors"] += repeat_errors(label, res)


def repeat_errors(label: str, result: dict) -> list[dict]:
    """One section error per level with failed requests: {engine, error} naming configuration, level and count."""
    return [{"engine": label, "error": f"repeat test, configuration {name!r}, concurrency {lv['concurrency']}: "
                                       f"{lv['failed']} of {lv['requests']} requests failed; first: {lv['errors'][0]}"}
            for name, levels in result["configs"].items() for lv in levels if lv["failed"]]


def prompt_counts(rows: list[dict]) -> list[dict]:
    """Per (engine, configuration) other than the oracle, in row order: prompts (n), tokens_equal (runs with the
    oracle's tokens), parts_equal (runs whose verdict is equal), divergence (first-divergence positions of the
    others, ascending), min_flip_margin and min_flip_prompt (the smallest oracle top-1 margin at a first divergence,
    None where no flipped run has one), gen_tokens (the largest generated count)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if r["config"] == r.get("oracle"):
            continue
        s = out.setdefault((r["engine"], r["config"]), {
            "engine": r["engine"], "config": r["config"], "prompts": 0, "tokens_equal": 0, "parts_equal": 0,
            "divergence": [], "min_flip_margin": None, "min_flip_prompt": None, "gen_tokens": 0})
        s["prompts"] += 1
        s["gen_tokens"] = max(s["gen_tokens"], int(r.get("gen_tokens") or 0))
        s["tokens_equal"] += bool(r.get("equals_oracle"))
        s["parts_equal"] += str(r.get("verdict", "")).startswith("equal")
        if r.get("first_divergence") is not None:
            s["divergence"].append(int(r["first_divergence"]))
            m = r.get("oracle_margin")
            if m is not None and (s["min_flip_margin"] is None or m < s["min_flip_margin"]):
                s["min_flip_margin"], s["min_flip_prompt"] = m, r["prompt"]
    for s in out.values():
        s["divergence"].sort()
    return list(out.values())


def many_prompts(rows: list[dict]) -> bool:
    """Whether the rows hold more than MANY_PROMPTS distinct prompts (then counts replace the per-run table)."""
    return len({r["prompt"] for r in rows}) > MANY_PROMPTS
