"""The ``streams`` section: drafted == plain, resumed == fresh, concurrent == alone == serial and packed == alone,
per kernel set.

Every configuration runs twice (``REPS``); ``reruns_equal`` says whether the repetitions are byte-identical, and
``equal`` is true only when every compared quantity matched in every repetition. Three quantities are compared
(QUANTITIES): the tokens, the logits bytes of every row the run produced (for drafted runs: every verified row, the
rows the tokens were chosen from) and the KV bytes of every written position; ``failed`` lists those that differed
and ``compared`` those the verdict rests on (all three, except drafted runs of a set that claims no exactness,
whose verdict stays on tokens):

    drafted     the drafted run (mtp.generate_drafted) against the plain run (paths.generate) on the same prefill
                path and step
    resumed     a request resumed from the prompt cache against a fresh request (logits: the prefilled tail rows
                and the generated rows); one row per mode (grid: resume on the step grid; any: resume off it)
    concurrent  each of N concurrent streams against its run alone (same prefill path) and against the serial
                no-draft oracle (paths.generate on ``decode``); logits of prompt and generated rows, KV of the
                stream's cache slot (read through model.tapping: the cache the attention kernels read)
    packed      the first N stream prompts prefilled packed into ONE forward (batch.run_packed, the plan of
                ``prefill_path``: batched, or deep) and decoded together, each against its prefill alone (one
                segment on the same plan); logits of prompt and generated rows, KV of its cache slot. N runs over
                the stream counts of at least 2 (one packed prompt is a prefill alone)

Choices stated in the receipt (``data["settings"]``): the prefill step is the profile's first step, or P // 3 for a
prompt of P <= step tokens (so that short prompts still have a grid); the grid resume point is the largest multiple
of the step below P (an earlier request of P - 1 tokens left it), the off-grid one is about P / 2 (an earlier request
of exactly that prefix); stream j's prompt is the profile's prompt j mod n cut to ``stream_prompt_tokens`` (default
a quarter of prompt_max_tokens, at most 256) minus 5·j tokens, and it joins after j·offset steps. Tables and
markdown: analysis/streams_report.py (re-exported here).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from ..batch import BATCH_LIMIT, run_packed, run_streams
from ..exact import bytes_equal, first_differing_row, kv_first_difference, token_hash
from ..model import tapping
from ..kernels import get_set, set_names
from ..receipt.params import StreamsParams
from ..mtp import generate_drafted, resolve_mtp
from ..paths import Schedule, generate
from ..progress import bar as progress_bar
from ..prompt_cache import PromptCache, generate_cached
from ..prompt_files import build_prompts, prompt_record
from ..weights import sharing_synthetic_weights
from .hashes import load_model
from .streams_report import (INTRO, concurrent_table, drafted_table, packed_table,  # noqa: F401  (its views)
                             render_md, resumed_table, settings_md, summary_rows, summary_table, verdict_md)

REPS = 2
STREAM_CUT = 5  # stream j's prompt is STREAM_CUT * j tokens shorter, so the streams' lengths differ
QUANTITIES = ("tokens", "logits", "kv")


# --------------------------------------------------------------------------------------------------- comparisons

def run_equal(a_ids, a_logits, b_ids, b_logits) -> bool:
    """Tokens and logits bytes equal."""
    return bool(torch.equal(a_ids, b_ids)) and bytes_equal(a_logits, b_logits)


def verdict(ok: dict[str, bool], strict: bool = True) -> dict:
    """Row fields from per-quantity outcomes ``ok`` (QUANTITIES -> equal in every repetition): ``compared`` (all
    QUANTITIES when ``strict``, else tokens only), ``equal`` (every compared quantity equal) and ``failed`` (every
    quantity that differed, compared or not, in QUANTITIES order)."""
    compared = list(QUANTITIES) if strict else ["tokens"]
    return {"equal": all(ok[q] for q in compared), "failed": [q for q in QUANTITIES if not ok[q]],
            "compared": compared}


class CacheTap:
    """Tap recorder (model.tapping) keeping, per layer, the KV tensors the attention kernels read (KVCache.k/v
    [S, T, Hkv, D], written in place): after the run they hold its cache, for runs that do not hand it back."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def record(self, cls, layer, args, **_):
        if cls == "attention":
            self.k[layer], self.v[layer] = args[1], args[2]

    def first_difference(self, slot: int, ref) -> int | None:
        """First position where this run's cache ``slot`` and slot 0 of KVCache ``ref`` differ in bytes in any
        layer's keys or values, over ref's written positions (exact.first_differing_row); None when equal."""
        n, layers = ref.lengths[0], sorted(self.k)
        ours = [self.k[i] for i in layers] + [self.v[i] for i in layers]
        firsts = [first_differing_row(x[slot, :n], y[0, :n]) for x, y in zip(ours, ref.k + ref.v)]
        return min((f for f in firsts if f is not None), default=None)


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


def _schedule(p: StreamsParams, step: int) -> Schedule:
    """The section's prefill: ``prefill_path`` at ``step`` with the profile's deep threshold."""
    return Schedule(p.prefill_path, step, p.deep_threshold)


def resume_points(n_prompt: int, step: int) -> dict[str, int]:
    """mode -> resume position: grid = largest multiple of ``step`` below n_prompt (0 if none); any = about
    n_prompt / 2, moved off the grid when it falls on it (and below n_prompt)."""
    off = max(1, n_prompt // 2)
    if off % step == 0 and off + 1 < n_prompt:
        off += 1
    return {"grid": (n_prompt - 1) // step * step, "any": off}


# ------------------------------------------------------------------------------------------------------ drafted

def drafted_rows(w, prompt, ks: str, plain: list, p: StreamsParams, step: int) -> list[dict]:
    """One row per draft source: drafted (REPS runs) against ``plain`` (REPS paths.generate runs, cache kept)."""
    rows = []
    for draft in p.drafts:
        t0 = time.perf_counter()
        runs = [generate_drafted(w, prompt.ids, p.gen_tokens, ks, _schedule(p, step), k=p.mtp_k, draft=draft,
                                 keep_cache=True, kv_dtype=p.kv_dtype) for _ in range(REPS)]
        ref, pairs = plain[0], list(zip(runs, plain))  # repetition i against plain repetition i
        div = next((first_differing_row(r.gen_ids, q.gen_ids) for r, q in pairs
                    if not torch.equal(r.gen_ids, q.gen_ids)), None)
        kv = [kv_first_difference(r.cache, q.cache) for r, q in pairs]
        ok = {"tokens": all(torch.equal(r.gen_ids, q.gen_ids) for r, q in pairs),
              "logits": all(bytes_equal(r.gen_logits, q.gen_logits) for r, q in pairs),
              "kv": all(d is None for d in kv)}
        s = runs[0].stats
        rows.append({
            "set": ks, "prompt": prompt.name, "prompt_tokens": prompt.n_tokens, "gen_tokens": p.gen_tokens,
            "path": p.prefill_path, "step": step, "draft": draft if draft == "mtp" else "self (sanity)",
            "mtp_source": runs[0].mtp_source, "k": p.mtp_k, "plain_hash": token_hash(ref.gen_ids),
            "drafted_hash": token_hash(runs[0].gen_ids), "drafted_hashes": [token_hash(r.gen_ids) for r in runs],
            **verdict(ok, get_set(ks).claims_exact), "first_divergence": div,
            "logits_bytes_equal": ok["logits"],
            "first_logits_row_diff": first_differing_row(runs[0].gen_logits, ref.gen_logits),
            "kv_bytes_equal": ok["kv"], "first_kv_position_diff": next((d for d in kv if d is not None), None),
            "proposed": s.proposed, "accepted": s.accepted, "acceptance_rate": s.acceptance_rate,
            "rounds": s.rounds, **_reruns(_drafted_reruns(runs, plain)),
            "seconds": round(time.perf_counter() - t0, 3),
        })
    return rows


def _reruns(detail: dict) -> dict:
    """Row fields: ``reruns`` (which runs repeated byte-identically) and ``reruns_equal`` (all of them did)."""
    return {"reruns": detail, "reruns_equal": all(detail.values())}


def _drafted_reruns(runs, plain) -> dict:
    same = all(run_equal(r.gen_ids, r.gen_logits, runs[0].gen_ids, runs[0].gen_logits) for r in runs)
    same &= all(r.stats == runs[0].stats for r in runs)
    return {"plain": all(run_equal(r.gen_ids, r.gen_logits, plain[0].gen_ids, plain[0].gen_logits) for r in plain),
            "drafted": same}


# ------------------------------------------------------------------------------------------------------ resumed

def resumed_rows(w, prompt, ks: str, fresh: list, p: StreamsParams, step: int) -> list[dict]:
    """One row per prompt-cache mode: a request resumed from the cache (REPS runs) against ``fresh``."""
    P, rows = prompt.n_tokens, []
    for mode, split in resume_points(P, step).items():
        t0 = time.perf_counter()
        pc = PromptCache(p.prompt_cache_gib, mode, step)
        earlier = P - 1 if mode == "grid" else split
        if split > 0:
            generate_cached(w, pc, prompt.ids[:earlier], 1, ks, _schedule(p, step), kv_dtype=p.kv_dtype)
        runs = [generate_cached(w, pc, prompt.ids, p.gen_tokens, ks, _schedule(p, step), keep_cache=True,
                                kv_dtype=p.kv_dtype) for _ in range(REPS)]
        rows.append(_resumed_row(prompt, ks, mode, split, earlier, step, runs, fresh, pc, p))
        rows[-1]["seconds"] = round(time.perf_counter() - t0, 3)
    return rows


def _resumed_row(prompt, ks, mode, split, earlier, step, runs, fresh, pc, p) -> dict:
    ref, r0, pairs = fresh[0], runs[0], list(zip(runs, fresh))  # repetition i against fresh repetition i
    tail = [f.prompt_logits[r.resumed_from:] for r, f in pairs]
    tok = all(torch.equal(r.gen_ids, f.gen_ids) for r, f in pairs)
    tail_eq = all(bytes_equal(r.tail_logits, t) for r, t in zip(runs, tail))
    gen_eq = all(bytes_equal(r.gen_logits, f.gen_logits) for r, f in pairs)
    kv = [kv_first_difference(r.cache, f.cache) for r, f in pairs]
    row_diff = first_differing_row(r0.tail_logits, tail[0])
    v = verdict({"tokens": tok, "logits": tail_eq and gen_eq, "kv": all(d is None for d in kv)})
    planned = all(r.resumed_from == split for r in runs)
    reruns = {"fresh": all(run_equal(f.gen_ids, f.gen_logits, ref.gen_ids, ref.gen_logits) for f in fresh),
              "resumed": all(run_equal(r.gen_ids, r.gen_logits, r0.gen_ids, r0.gen_logits) and r.resumed_from ==
                             r0.resumed_from and bytes_equal(r.tail_logits, r0.tail_logits) for r in runs)}
    return {
        "set": ks, "prompt": prompt.name, "prompt_tokens": prompt.n_tokens, "gen_tokens": p.gen_tokens,
        "mode": mode, "step": step, "split": split, "on_grid": split > 0 and split % step == 0,
        "earlier_request_tokens": earlier if split > 0 else None,
        "resumed_from": [r.resumed_from for r in runs], "tail_rows": prompt.n_tokens - r0.resumed_from,
        "fresh_hash": token_hash(ref.gen_ids), "resumed_hash": token_hash(r0.gen_ids),
        "tokens_equal": tok, "tail_logits_equal": tail_eq, "gen_logits_equal": gen_eq,
        "kv_bytes_equal": all(d is None for d in kv), **v, "equal": v["equal"] and planned,
        "failed": v["failed"] + ([] if planned else ["resume point"]),
        "first_divergence": first_differing_row(r0.gen_ids, ref.gen_ids),
        "first_tail_row_diff": None if row_diff is None else r0.resumed_from + row_diff,
        "first_kv_position_diff": kv[0], **_reruns(reruns),
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
    step = p.steps[0]
    alone = [[generate(w, ids, p.gen_tokens, ks, _schedule(p, step), keep_cache=True, kv_dtype=p.kv_dtype)
              for _ in range(REPS)] for _, ids in sp]
    serial = [[generate(w, ids, p.gen_tokens, ks, Schedule("decode"), keep_cache=True, kv_dtype=p.kv_dtype)
               for _ in range(REPS)] for _, ids in sp]
    rows = []
    for N in p.stream_counts:
        t0 = time.perf_counter()
        runs, errors = [], []
        for _ in range(REPS):
            try:
                with tapping(CacheTap()) as tap:
                    runs.append((run_streams(w, [ids for _, ids in sp[:N]], p.gen_tokens, ks, _schedule(p, step),
                                             offset=p.stream_offset, kv_dtype=p.kv_dtype), tap))
            except RuntimeError as e:  # a run that fails is reported, not hidden (bad input still raises)
                errors.append(f"{type(e).__name__}: {e}")
        rows.append(_concurrent_row(ks, N, sp[:N], step, runs, errors, alone, serial, p))
        rows[-1]["seconds"] = round(time.perf_counter() - t0, 3)
    return rows


def _same(s, ref) -> bool:
    return run_equal(s.gen_ids, s.gen_logits, ref.gen_ids, ref.gen_logits) and bytes_equal(s.prompt_logits,
                                                                                          ref.prompt_logits)


def _stream_ok(run, tap: CacheTap, j: int, ref) -> dict[str, bool]:
    """Stream j of a concurrent run against ``ref`` (a paths.generate result with its cache): per quantity."""
    s = run.streams[j]
    return {"tokens": bool(torch.equal(s.gen_ids, ref.gen_ids)),
            "logits": bytes_equal(s.gen_logits, ref.gen_logits) and bytes_equal(s.prompt_logits, ref.prompt_logits),
            "kv": tap.first_difference(j, ref.cache) is None}


def _counts(runs, refs, N, n_fail) -> tuple[dict, dict]:
    """eq / neq / fail over streams x repetitions (repetition i against the reference's repetition i; a stream is
    equal when tokens, logits and KV bytes all are), and per quantity whether it held for every stream and rep."""
    oks = [_stream_ok(r, tap, j, refs[j][i]) for i, (r, tap) in enumerate(runs) for j in range(N)]
    eq = sum(all(o.values()) for o in oks)
    return ({"eq": eq, "neq": len(runs) * N - eq, "fail": n_fail * N},
            {q: all(o[q] for o in oks) for q in QUANTITIES})


def _first_divs(r0, refs, N) -> list | None:
    """Per stream: first generated index where repetition 0 differs from the reference's repetition 0."""
    return [first_differing_row(r0.streams[j].gen_ids, refs[j][0].gen_ids) for j in range(N)] if r0 else None


def _first_kv(run0, refs, N) -> list | None:
    """Per stream: first KV position where repetition 0's cache slot differs from the reference's repetition 0."""
    return [run0[1].first_difference(j, refs[j][0].cache) for j in range(N)] if run0 else None


def _concurrent_row(ks, N, sp, step, runs, errors, alone, serial, p) -> dict:
    (a, ok_a), (s, ok_s) = _counts(runs, alone, N, len(errors)), _counts(runs, serial, N, len(errors))
    v = verdict({q: ok_a[q] and ok_s[q] for q in QUANTITIES})
    run0 = runs[0] if runs else None
    r0 = run0[0] if run0 else None
    runs = [r for r, _ in runs]
    reruns = {"concurrent": bool(runs) and not errors and all(_same(r.streams[j], r0.streams[j]) for r in runs
                                                               for j in range(N)),
              "alone": all(_same(x, refs[0]) for refs in alone[:N] for x in refs),
              "serial": all(_same(x, refs[0]) for refs in serial[:N] for x in refs)}
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
        "failed_vs": {"alone": verdict(ok_a)["failed"], "serial": verdict(ok_s)["failed"]},
        "first_divergence_alone": _first_divs(r0, alone, N), "first_divergence_serial": _first_divs(r0, serial, N),
        "first_kv_diff_alone": _first_kv(run0, alone, N), "first_kv_diff_serial": _first_kv(run0, serial, N),
        **_reruns(reruns),
        "steps": r0.steps if r0 else None, "max_batch_rows": r0.max_batch_rows if r0 else None,
    }


# ------------------------------------------------------------------------------------------------------- packed

def packed_plan(p: StreamsParams) -> tuple[str, Schedule]:
    """(the packed forward's plan, the schedule of a prefill alone on that plan in one segment)."""
    if p.prefill_path == "deep":
        return "deep", Schedule("deep", None, 1)
    return "batched", Schedule("batched", None, p.deep_threshold)


def packed_rows(w, prompts: list, ks: str, p: StreamsParams) -> list[dict]:
    """One row per stream count N >= 2: the first N stream prompts packed into one prefill (REPS runs of
    batch.run_packed) against each prompt's prefill alone (REPS paths.generate runs, cache kept)."""
    counts = [n for n in p.stream_counts if n >= 2]
    if not counts:
        return []
    sp = stream_prompts(prompts, max(counts), p.stream_prompt_tokens)
    plan, alone_sched = packed_plan(p)
    alone = [[generate(w, ids, p.gen_tokens, ks, alone_sched, keep_cache=True, kv_dtype=p.kv_dtype)
              for _ in range(REPS)] for _, ids in sp]
    rows = []
    for N in counts:
        t0 = time.perf_counter()
        runs = [run_packed(w, [ids for _, ids in sp[:N]], p.gen_tokens, ks, plan, keep_cache=True,
                           kv_dtype=p.kv_dtype) for _ in range(REPS)]
        rows.append(_packed_row(ks, N, sp[:N], plan, runs, alone, p))
        rows[-1]["seconds"] = round(time.perf_counter() - t0, 3)
    return rows


def _packed_ok(r, ref) -> dict[str, bool]:
    """One packed prompt's run against its run alone ``ref``: per quantity."""
    return {"tokens": bool(torch.equal(r.gen_ids, ref.gen_ids)),
            "logits": bytes_equal(r.prompt_logits, ref.prompt_logits) and bytes_equal(r.gen_logits, ref.gen_logits),
            "kv": kv_first_difference(r.cache, ref.cache) is None}


def _packed_row(ks, N, sp, plan, runs, alone, p) -> dict:
    oks = [_packed_ok(run[j], alone[j][i]) for i, run in enumerate(runs) for j in range(N)]
    v = verdict({q: all(o[q] for o in oks) for q in QUANTITIES})
    r0, eq = runs[0], sum(all(o.values()) for o in oks)
    reruns = {"packed": all(_same(r[j], r0[j]) for r in runs for j in range(N)),
              "alone": all(_same(x, refs[0]) for refs in alone[:N] for x in refs)}
    return {
        "set": ks, "streams": N, "plan": plan, "gen_tokens": p.gen_tokens, "kv_dtype": p.kv_dtype,
        "stream_prompts": [{"prompt": name, "tokens": int(ids.numel())} for name, ids in sp],
        "packed_rows": r0[0].served["packed"]["rows"],
        "hashes": [token_hash(r.gen_ids) for r in r0], "alone_hashes": [token_hash(a[0].gen_ids) for a in alone[:N]],
        "equal_to_alone": {"eq": eq, "neq": len(oks) - eq, "fail": 0}, **v, "equal": v["equal"] and eq == len(oks),
        "first_divergence_alone": [first_differing_row(r.gen_ids, a[0].gen_ids) for r, a in zip(r0, alone)],
        "first_prompt_row_diff_alone": [first_differing_row(r.prompt_logits, a[0].prompt_logits)
                                        for r, a in zip(r0, alone)],
        "first_kv_diff_alone": [kv_first_difference(r.cache, a[0].cache) for r, a in zip(r0, alone)],
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
    p = dataclasses.replace(p, kernel_sets=set_names(p.kernel_sets))
    w, tok = load_model(p.preset, p.device, p.dtype, p.checkpoint, p.weights)
    prompts = build_prompts(p.prompts, p.prompt_max_tokens, p.allow_unpinned, tok, w.cfg.vocab_size)
    data = {"drafted": [], "resumed": [], "concurrent": [], "packed": []}
    with progress_bar(len(p.kernel_sets) * (len(prompts) + 1), "streams", "cfg") as bar, \
            sharing_synthetic_weights():   # the MTP head's synthetic weights: drawn once for every drafted run
        for ks in p.kernel_sets:
            for pr in prompts:
                step = prompt_step(p.steps[0], pr.n_tokens)
                plain = [generate(w, pr.ids, p.gen_tokens, ks, _schedule(p, step), keep_cache=True,
                                  kv_dtype=p.kv_dtype) for _ in range(REPS)]
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
    mtp_source = resolve_mtp(w).source if "mtp" in p.drafts else None
    return {"reps": REPS, "prefill_path": p.prefill_path, "steps": p.steps, "gen_tokens": p.gen_tokens,
            "mtp_k": p.mtp_k, "mtp_source": mtp_source, "drafts": p.drafts,
            "prompt_cache_gib": p.prompt_cache_gib, "eviction": "LRU by bytes",
            "stream_counts": p.stream_counts, "stream_offset": p.stream_offset,
            "stream_prompt_tokens": p.stream_prompt_tokens, "batch_limit": BATCH_LIMIT,
            "weights": p.weights, "kv_dtype": p.kv_dtype, "packed_plan": packed_plan(p)[0],
            "verify_plan": "batched (prompt kernels), k+1 rows per verify forward"}
