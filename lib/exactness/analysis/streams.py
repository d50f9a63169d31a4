"""The ``streams`` section: drafted == plain, resumed == fresh, concurrent == alone == serial and packed == alone,
per kernel set.

Every configuration runs twice (``REPS``); ``reruns_equal`` says whether the repetitions are byte-identical, and
``equal`` is true only when every compared quantity matched in every repetition. Three quantities are compared
(QUANTITIES): the tokens, the logits bytes of every row the run produced (for drafted runs: every verified row, the
rows the tokens were chosen from) and the KV bytes of every written position; ``failed`` lists those that differed
and ``compared`` those the verdict rests on (all three, except drafted runs of a set that claims no exactness,
whose verdict stays on tokens). Every equality is exact.compare of the two runs (analysis/streams_compare.py):

    drafted     the drafted run (our engine's run_drafted) against the plain run (its run) on the same prefill
                path and step
    resumed     a request resumed from the prompt cache against a fresh request (logits: the prefilled tail rows
                and the generated rows); one row per mode (grid: resume on the step grid; any: resume off it)
    concurrent  each of N concurrent streams against its run alone (same prefill path) and against the serial
                no-draft oracle (the ``decode`` configuration); logits of prompt and generated rows, KV of the
                stream's cache slot (read through the engine's kernel taps: the cache the attention kernels read)
    packed      the first N stream prompts prefilled packed into ONE forward (run_packed, the plan of
                ``prefill_path``: batched, or deep) and decoded together, each against its prefill alone (one
                segment on the same plan); logits of prompt and generated rows, KV of its cache slot. N runs over
                the stream counts of at least 2 (one packed prompt is a prefill alone)

Choices stated in the receipt (``data["settings"]``): the prefill step is the profile's first step, or P // 3 for a
prompt of P <= step tokens (so that short prompts still have a grid); the grid resume point is the largest multiple
of the step below P (an earlier request of P - 1 tokens left it), the off-grid one is about P / 2 (an earlier request
of exactly that prefix); stream j's prompt is the profile's prompt j mod n cut to ``stream_prompt_tokens`` (default
a quarter of prompt_max_tokens, at most 256) minus 5·j tokens, and it joins after j·offset steps. Tables and
markdown: analysis/streams_report.py.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from ..checkpoint import load_model
from ..engines.reference import ReferenceEngine
from ..exact import Verdict, compare, token_hash
from ..kernels import get_set, set_names
from ..params import StreamsParams
from ..progress import bar as progress_bar
from ..prompt_files import build_prompts, prompt_record
from ..weights import sharing_synthetic_weights
from .contract.validate import validate_sets
from .streams_compare import QUANTITIES, CacheTap, kv_position, outcome, quantities, same_run

REPS = 2
STREAM_CUT = 5  # stream j's prompt is STREAM_CUT * j tokens shorter, so the streams' lengths differ


# --------------------------------------------------------------------------------------------------- parameters

def section_params(params: StreamsParams | dict) -> StreamsParams:
    """The typed parameters of this section (StreamsParams: its defaults filled in, checked).

    Raises:
        ValueError: mtp_k outside 1..4, a stream count outside 1..BATCH_LIMIT, a negative prompt cache budget,
            an unknown draft source, an empty steps list, or any bad common field.
    """
    return StreamsParams.from_dict(params)


def prompt_step(step: int, n_prompt: int) -> int:
    """The prefill step for a prompt: ``step``, or n_prompt // 3 (at least 1) when the prompt is not longer."""
    return step if n_prompt > step else max(1, n_prompt // 3)


def engine(w, ks: str, p: StreamsParams) -> ReferenceEngine:
    """Our engine on weights ``w`` with kernel set ``ks``, the profile's deep threshold, MTP draft count and KV
    cache dtype."""
    return ReferenceEngine(w, None, ks, deep_threshold=p.deep_threshold, draft_k=p.mtp_k, kv_dtype=p.kv_dtype)


def _config(eng: ReferenceEngine, p: StreamsParams, step: int):
    """The section's prefill: ``prefill_path`` at ``step`` with the profile's deep threshold."""
    return eng.configuration(p.prefill_path, step)


def plain_runs(w, prompt, ks: str, p: StreamsParams, step: int) -> list:
    """REPS plain runs of ``prompt`` (cache kept) on the section's prefill: what drafted and resumed runs are
    compared with."""
    eng = engine(w, ks, p)
    return [eng.run(prompt.ids, p.gen_tokens, _config(eng, p, step), keep_kv=True) for _ in range(REPS)]


def resume_points(n_prompt: int, step: int) -> dict[str, int]:
    """mode -> resume position: grid = largest multiple of ``step`` below n_prompt (0 if none); any = about
    n_prompt / 2, moved off the grid when it falls on it (and below n_prompt)."""
    off = max(1, n_prompt // 2)
    if off % step == 0 and off + 1 < n_prompt:
        off += 1
    return {"grid": (n_prompt - 1) // step * step, "any": off}


# ------------------------------------------------------------------------------------------------------ drafted

def drafted_rows(w, prompt, ks: str, plain: list, p: StreamsParams, step: int) -> list[dict]:
    """One row per draft source: drafted (REPS runs) against ``plain`` (plain_runs)."""
    rows, eng = [], engine(w, ks, p)
    for draft in p.drafts:
        t0 = time.perf_counter()
        runs = [eng.run_drafted(prompt.ids, p.gen_tokens, _config(eng, p, step), draft=draft, keep_kv=True)
                for _ in range(REPS)]
        ref = plain[0]
        vs = [compare(r, q) for r, q in zip(runs, plain)]   # repetition i against plain repetition i
        oks = [quantities(v, prompt=False) for v in vs]
        ok = {q: all(o[q] for o in oks) for q in QUANTITIES}
        s = runs[0].stats
        rows.append({
            "set": ks, "prompt": prompt.name, "prompt_tokens": prompt.n_tokens, "gen_tokens": p.gen_tokens,
            "path": p.prefill_path, "step": step, "draft": draft if draft == "mtp" else "self (sanity)",
            "mtp_source": runs[0].info.get("mtp_source"), "k": p.mtp_k, "plain_hash": token_hash(ref.gen_ids),
            "drafted_hash": token_hash(runs[0].gen_ids), "drafted_hashes": [token_hash(r.gen_ids) for r in runs],
            **outcome(ok, get_set(ks).claims_exact),
            "first_divergence": next((v.tokens.first for v in vs if not v.tokens.equal), None),
            "logits_bytes_equal": ok["logits"], "first_logits_row_diff": vs[0].gen_rows.first,
            "kv_bytes_equal": ok["kv"], "first_kv_position_diff": next((kv_position(v) for v in vs if v.kv.first),
                                                                       None),
            "proposed": s.proposed, "accepted": s.accepted, "acceptance_rate": s.acceptance_rate,
            "rounds": s.rounds, **_reruns(_drafted_reruns(runs, plain)),
            "seconds": round(time.perf_counter() - t0, 3),
        })
    return rows


def _reruns(detail: dict) -> dict:
    """Row fields: ``reruns`` (which runs repeated byte-identically) and ``reruns_equal`` (all of them did)."""
    return {"reruns": detail, "reruns_equal": all(detail.values())}


def _drafted_reruns(runs, plain) -> dict:
    same = all(same_run(r, runs[0], prompt=False) and r.stats == runs[0].stats for r in runs)
    return {"plain": all(same_run(r, plain[0], prompt=False) for r in plain), "drafted": same}


# ------------------------------------------------------------------------------------------------------ resumed

def resumed_rows(w, prompt, ks: str, fresh: list, p: StreamsParams, step: int) -> list[dict]:
    """One row per prompt-cache mode: a request resumed from the cache (REPS runs) against ``fresh``."""
    P, rows, eng = prompt.n_tokens, [], engine(w, ks, p)
    config = _config(eng, p, step)
    for mode, split in resume_points(P, step).items():
        t0 = time.perf_counter()
        pc = eng.prompt_cache(p.prompt_cache_gib, mode, step)
        earlier = P - 1 if mode == "grid" else split
        if split > 0:
            eng.run_resumed(prompt.ids[:earlier], 1, config, pc)
        runs = [eng.run_resumed(prompt.ids, p.gen_tokens, config, pc, keep_kv=True) for _ in range(REPS)]
        rows.append(_resumed_row(prompt, ks, mode, split, earlier, step, runs, fresh, pc, p))
        rows[-1]["seconds"] = round(time.perf_counter() - t0, 3)
    return rows


def _resumed_row(prompt, ks, mode, split, earlier, step, runs, fresh, pc, p) -> dict:
    ref, r0 = fresh[0], runs[0]
    # repetition i against fresh repetition i; the prompt rows compared are the tail the resumed run computed
    vs = [compare(r, f) for r, f in zip(runs, fresh)]
    tok = all(x.tokens.equal for x in vs)
    tail_eq = all(x.prompt_rows.equal is True for x in vs)
    gen_eq = all(x.gen_rows.equal is True for x in vs)
    v = outcome({q: all(quantities(x)[q] for x in vs) for q in QUANTITIES})
    planned = all(r.resumed_from == split for r in runs)
    reruns = {"fresh": all(same_run(f, ref, prompt=False) for f in fresh),
              "resumed": all(same_run(r, r0) and r.resumed_from == r0.resumed_from for r in runs)}
    return {
        "set": ks, "prompt": prompt.name, "prompt_tokens": prompt.n_tokens, "gen_tokens": p.gen_tokens,
        "mode": mode, "step": step, "split": split, "on_grid": split > 0 and split % step == 0,
        "earlier_request_tokens": earlier if split > 0 else None,
        "resumed_from": [r.resumed_from for r in runs], "tail_rows": prompt.n_tokens - r0.resumed_from,
        "fresh_hash": token_hash(ref.gen_ids), "resumed_hash": token_hash(r0.gen_ids),
        "tokens_equal": tok, "tail_logits_equal": tail_eq, "gen_logits_equal": gen_eq,
        "kv_bytes_equal": all(x.kv.equal is True for x in vs), **v, "equal": v["equal"] and planned,
        "failed": v["failed"] + ([] if planned else ["resume point"]),
        "first_divergence": vs[0].tokens.first, "first_tail_row_diff": vs[0].prompt_rows.first,
        "first_kv_position_diff": kv_position(vs[0]), **_reruns(reruns),
        "resumed_as_planned": planned, "state_bytes": pc.nbytes,
        "cache_stats": dict(pc.stats), "budget_gib": p.prompt_cache_gib,
    }


# --------------------------------------------------------------------------------------------------- concurrent

def stream_prompts(prompts: list, n: int, cap: int) -> list[tuple[str, torch.Tensor]]:
    """(name, ids) of streams 0..n-1: prompt j mod len(prompts), cut to min(P, cap) - STREAM_CUT·j (>= 2)."""
    out = []
    for j in range(n):
        pr = prompts[j % len(prompts)]
        m = max(2, min(pr.n_tokens, cap) - STREAM_CUT * j)
        out.append((pr.name, pr.ids[:m]))
    return out


def concurrent_rows(w, prompts: list, ks: str, p: StreamsParams) -> list[dict]:
    """One row per stream count N: N concurrent streams (REPS runs) against each stream alone and serial."""
    N_max = max(p.stream_counts)
    sp = stream_prompts(prompts, N_max, p.stream_prompt_tokens)
    step, eng = p.steps[0], engine(w, ks, p)
    config = _config(eng, p, step)
    alone = [[eng.run(ids, p.gen_tokens, config, keep_kv=True) for _ in range(REPS)] for _, ids in sp]
    serial = [[eng.run(ids, p.gen_tokens, eng.oracle, keep_kv=True) for _ in range(REPS)] for _, ids in sp]
    rows = []
    for N in p.stream_counts:
        t0 = time.perf_counter()
        runs, errors = [], []
        for _ in range(REPS):
            try:
                with eng.tapping(CacheTap()) as tap:
                    runs.append((eng.run_concurrent([ids for _, ids in sp[:N]], p.gen_tokens, config,
                                                    offset=p.stream_offset), tap))
            except RuntimeError as e:  # a run that fails is reported, not hidden (bad input still raises)
                errors.append(f"{type(e).__name__}: {e}")
        rows.append(_concurrent_row(ks, N, sp[:N], step, runs, errors, alone, serial, p))
        rows[-1]["seconds"] = round(time.perf_counter() - t0, 3)
    return rows


def _verdicts(runs, refs, N) -> list[list[Verdict]]:
    """[repetition i][stream j]: stream j of concurrent repetition i (its KV read from the tap) against the
    reference's repetition i (a Run with its KV)."""
    return [[compare(tap.stream(r.streams[j], j, refs[j][i]), refs[j][i]) for j in range(N)]
            for i, (r, tap) in enumerate(runs)]


def _counts(vs: list[list[Verdict]], N, n_fail) -> tuple[dict, dict]:
    """eq / neq / fail over streams x repetitions (a stream is equal when tokens, logits and KV bytes all are), and
    per quantity whether it held for every stream and repetition."""
    oks = [quantities(v) for rep in vs for v in rep]
    eq = sum(all(o.values()) for o in oks)
    return ({"eq": eq, "neq": len(vs) * N - eq, "fail": n_fail * N},
            {q: all(o[q] for o in oks) for q in QUANTITIES})


def _firsts(vs: list[list[Verdict]]) -> tuple[list | None, list | None]:
    """Per stream of repetition 0: the first differing generated index and KV position (None without a run)."""
    if not vs:
        return None, None
    return [v.tokens.first for v in vs[0]], [kv_position(v) for v in vs[0]]


def _concurrent_row(ks, N, sp, step, runs, errors, alone, serial, p) -> dict:
    va, vs = _verdicts(runs, alone, N), _verdicts(runs, serial, N)
    (a, ok_a), (s, ok_s) = _counts(va, N, len(errors)), _counts(vs, N, len(errors))
    v = outcome({q: ok_a[q] and ok_s[q] for q in QUANTITIES})
    (div_a, kv_a), (div_s, kv_s) = _firsts(va), _firsts(vs)
    runs = [r for r, _ in runs]
    r0 = runs[0] if runs else None
    reruns = {"concurrent": bool(runs) and not errors and all(same_run(r.streams[j], r0.streams[j]) for r in runs
                                                               for j in range(N)),
              "alone": all(same_run(x, refs[0]) for refs in alone[:N] for x in refs),
              "serial": all(same_run(x, refs[0]) for refs in serial[:N] for x in refs)}
    return {
        "set": ks, "streams": N, "offset": p.stream_offset, "step": step, "gen_tokens": p.gen_tokens,
        "stream_prompts": [{"prompt": name, "tokens": int(ids.numel()), "join_step": j * p.stream_offset}
                           for j, (name, ids) in enumerate(sp)],
        "hashes": [token_hash(x.gen_ids) for x in r0.streams] if r0 else None,
        "alone_hashes": [token_hash(alone[j][0].gen_ids) for j in range(N)],
        "serial_hashes": [token_hash(serial[j][0].gen_ids) for j in range(N)],
        "equal_to_alone": a, "equal_to_serial": s, "failures": len(errors) * N, "errors": errors,
        "alone_equal": a["eq"] == REPS * N, "serial_equal": s["eq"] == REPS * N, **v,
        "equal": v["equal"] and a["eq"] == REPS * N and s["eq"] == REPS * N,
        "failed_vs": {"alone": outcome(ok_a)["failed"], "serial": outcome(ok_s)["failed"]},
        "first_divergence_alone": div_a, "first_divergence_serial": div_s,
        "first_kv_diff_alone": kv_a, "first_kv_diff_serial": kv_s,
        **_reruns(reruns),
        "steps": r0.steps if r0 else None, "max_batch_rows": r0.max_batch_rows if r0 else None,
    }


# ------------------------------------------------------------------------------------------------------- packed

def packed_plan(p: StreamsParams) -> tuple[str, tuple[str, None, int]]:
    """(the packed forward's plan, the (path, step, deep threshold) of a prefill alone on that plan in one
    segment)."""
    if p.prefill_path == "deep":
        return "deep", ("deep", None, 1)
    return "batched", ("batched", None, p.deep_threshold)


def packed_rows(w, prompts: list, ks: str, p: StreamsParams) -> list[dict]:
    """One row per stream count N >= 2: the first N stream prompts packed into one prefill (REPS runs of
    run_packed) against each prompt's prefill alone (REPS runs, cache kept)."""
    counts = [n for n in p.stream_counts if n >= 2]
    if not counts:
        return []
    sp = stream_prompts(prompts, max(counts), p.stream_prompt_tokens)
    plan, alone_prefill = packed_plan(p)
    eng = engine(w, ks, p)
    config = eng.configuration(*alone_prefill)
    alone = [[eng.run(ids, p.gen_tokens, config, keep_kv=True) for _ in range(REPS)] for _, ids in sp]
    rows = []
    for N in counts:
        t0 = time.perf_counter()
        runs = [eng.run_packed([ids for _, ids in sp[:N]], p.gen_tokens, plan, keep_kv=True) for _ in range(REPS)]
        rows.append(_packed_row(ks, N, sp[:N], plan, runs, alone, p))
        rows[-1]["seconds"] = round(time.perf_counter() - t0, 3)
    return rows


def _packed_row(ks, N, sp, plan, runs, alone, p) -> dict:
    # packed repetition i's prompt j against prompt j's run alone, repetition i
    vs = [[compare(run[j], alone[j][i]) for j in range(N)] for i, run in enumerate(runs)]
    oks = [quantities(x) for rep in vs for x in rep]
    v = outcome({q: all(o[q] for o in oks) for q in QUANTITIES})
    r0, eq = runs[0], sum(all(o.values()) for o in oks)
    reruns = {"packed": all(same_run(r[j], r0[j]) for r in runs for j in range(N)),
              "alone": all(same_run(x, refs[0]) for refs in alone[:N] for x in refs)}
    return {
        "set": ks, "streams": N, "plan": plan, "gen_tokens": p.gen_tokens, "kv_dtype": p.kv_dtype,
        "stream_prompts": [{"prompt": name, "tokens": int(ids.numel())} for name, ids in sp],
        "packed_rows": r0[0].served["packed"]["rows"],
        "hashes": [token_hash(r.gen_ids) for r in r0], "alone_hashes": [token_hash(a[0].gen_ids) for a in alone[:N]],
        "equal_to_alone": {"eq": eq, "neq": len(oks) - eq, "fail": 0}, **v, "equal": v["equal"] and eq == len(oks),
        "first_divergence_alone": [x.tokens.first for x in vs[0]],
        "first_prompt_row_diff_alone": [x.prompt_rows.first for x in vs[0]],
        "first_kv_diff_alone": [kv_position(x) for x in vs[0]],
        **_reruns(reruns),
    }


# ------------------------------------------------------------------------------------------------------ section

def run_section(params: StreamsParams | dict) -> dict:
    """The ``streams`` section from profile/notebook parameters.

    params (StreamsParams, or a dict of its fields): preset, device, dtype, prompts, prompt_max_tokens, steps,
    gen_tokens, deep_threshold, kernel_sets, and
    optionally mtp_k (2), stream_counts ([1, 2, 4]), prompt_cache_gib (1.0), stream_offset (2 steps),
    stream_prompt_tokens (None = a quarter of prompt_max_tokens, at most 256), prefill_path ("batched"), drafts
    (["mtp", "self"]), checkpoint (""), allow_unpinned (False), weights ("bf16": the model's projections, or
    "int4_g128" / "nvfp4"), kv_dtype ("bf16": what every run's KV cache stores, or "fp8_e4m3" / "fp8_e4m3_block").
    Returns:
        {"section": "streams", "data": {"drafted": [...], "resumed": [...], "concurrent": [...], "packed": [...],
        "settings": {...}}}
    Raises:
        ValueError: see section_params; unknown kernel set, preset, dtype or device.
    """
    p = section_params(params)   # rows name each set by its own name (a module:ATTR reference resolved)
    validate_sets(p)
    p = dataclasses.replace(p, kernel_sets=set_names(p.kernel_sets))
    w, tok = load_model(p.preset, p.device, p.dtype, p.checkpoint, p.weights)
    prompts = build_prompts(p.prompts, p.prompt_max_tokens, p.allow_unpinned, tok, w.cfg.vocab_size)
    data = {"drafted": [], "resumed": [], "concurrent": [], "packed": []}
    with progress_bar(len(p.kernel_sets) * (len(prompts) + 1), "streams", "cfg") as bar, \
            sharing_synthetic_weights():   # the MTP head's synthetic weights: drawn once for every drafted run
        for ks in p.kernel_sets:
            for pr in prompts:
                step = prompt_step(p.steps[0], pr.n_tokens)
                plain = plain_runs(w, pr, ks, p, step)
                data["drafted"] += drafted_rows(w, pr, ks, plain, p, step)
                if p.prompt_cache_gib > 0:  # 0 GiB disables the cache: nothing to resume, no rows
                    data["resumed"] += resumed_rows(w, pr, ks, plain, p, step)
                bar.update(1)
            data["concurrent"] += concurrent_rows(w, prompts, ks, p)
            data["packed"] += packed_rows(w, prompts, ks, p)
            bar.update(1)
    data["settings"] = _settings(w, p)
    return {"section": "streams", "prompts": [prompt_record(pr) for pr in prompts], "data": data}


def _settings(w, p) -> dict:
    mtp_source = engine(w, p.kernel_sets[0], p).load_mtp().source if "mtp" in p.drafts else None
    return {"reps": REPS, "prefill_path": p.prefill_path, "steps": p.steps, "gen_tokens": p.gen_tokens,
            "mtp_k": p.mtp_k, "mtp_source": mtp_source, "drafts": p.drafts,
            "prompt_cache_gib": p.prompt_cache_gib, "eviction": "LRU by bytes",
            "stream_counts": p.stream_counts, "stream_offset": p.stream_offset,
            "stream_prompt_tokens": p.stream_prompt_tokens, "batch_limit": ReferenceEngine.BATCH_LIMIT,
            "weights": p.weights, "kv_dtype": p.kv_dtype, "packed_plan": packed_plan(p)[0],
            "verify_plan": "batched (prompt kernels), k+1 rows per verify forward"}
