"""The ``bench`` section: serving speed and memory of each kernel set on the real prompts, defined below.

Runs, per kernel set (greedy, temperature 0, end-of-sequence ignored; prefill on ``bench_path`` at ``bench_step``):

    plain       each prompt ``bench_reps`` times through our engine's run: rep 0 is *cold* (the first request of that
                prompt since the model was loaded: first-touch, library initialisation), rep 1.. are *warm* (the
                identical repeat, prefilled again from scratch: the engine holds no prompt cache)
    drafted     the same through the engine's run_drafted (MTP head, k = MTP_K drafts), the head loaded once up
                front
    itl         each prompt ``bench_itl_reps`` more times (plain and drafted): decode tok/s median and ITL p50/p95
                over the pooled per-token gaps of those repetitions
    cold        exact token-id prompts of ``bench_cold_lengths`` tokens (code then docs ids, repeated as needed),
                ``bench_reps`` fresh requests each; a run qualifies as cold only if its prefill served every prompt
                row (nothing came from a cache), otherwise it is refused and not reported
    streams     1 and 2 concurrent streams of each prompt (run_concurrent, all joining at step 0), each stream
                compared with the plain run alone
    memory      peak device memory per run (torch.cuda.max_memory_allocated; None on CPU), and on CUDA the peak of
                a batched and a ``bench_path`` prefill of the longest prompt; the ring's reserved bytes (offload)

With ``bench_graphs`` (CUDA) the forwards after the prefill replay from CUDA graphs where their shape can be
captured: the plain replies' and the streams' decode steps, and the drafted runs' verify, decode and MTP head
forwards met more than once (the eager forwards' bytes). Each record's ``decode_graphs`` says whether a graph
served and, per shape, why not (a set's per-expert loop over several rows, offloaded experts, a shape met once).

Metrics: TTFT = seconds from the request to the first generated token; prefill tok/s = prompt tokens /
TTFT; decode tok/s = (generated - 1) / (time of last token - time of first token); mean ITL = that span /
(generated - 1); ITL p50/p95 = numpy.percentile (linear interpolation) of the gaps between consecutive tokens.
Drafted runs stamp every token of a verify round with the round's end, so their ITL p50 can be 0. The stamps are
the runs' own (Run.token_times: the greedy loop stamps each token after the device finished).
"""
from __future__ import annotations

from contextlib import ExitStack

import numpy as np
import torch

from ..config import get_preset
from ..engines.reference import ReferenceEngine
from .contract.validate import validate_sets
from ..offload import ExpertStore
from ..params import BenchParams
from ..progress import bar as progress_bar
from ..prompt_files import build_prompts, prompt_record
from ..prompts import build_prompt
from .merge import joined_records
from .bench_runner import MTP_K, Runner
from ..checkpoint import load_model, resolve_device

STREAM_COUNTS = (1, 2)   # concurrent streams
RING_SLOTS = 4           # expert ring slots when offload is on


# ------------------------------------------------------------------------------------------------- parameters

def bench_params(params: BenchParams | dict, max_positions: int | None = None) -> BenchParams:
    """The typed parameters of this section (BenchParams: defaults filled in, checked), and with
    ``max_positions`` (the model's) every cold length + gen_tokens within it.

    Raises:
        ValueError: bench_path not a path, bench_step not a positive int or None, bench_reps / bench_itl_reps
            / gen_tokens < 1, offload not a bool, a cold length < 2, or a cold length + gen_tokens above
            ``max_positions`` (names the length and the limit).
    """
    p = BenchParams.from_dict(params)
    if max_positions is not None:
        p.check_lengths(max_positions)
    return p


def exact_length_ids(n: int, sources: list[torch.Tensor]) -> torch.Tensor:
    """Token ids [n] int64 of exactly ``n`` tokens: the first source whole (BOS first), then the others without
    their leading BOS, then all sources again without BOS, until n ids.

    Raises:
        ValueError: n < 1 or sources empty.
    """
    if n < 1 or not sources:
        raise ValueError(f"need n >= 1 and at least one source, got n={n}, {len(sources)} sources")
    parts, have, first = [], 0, True
    while have < n:
        for s in sources:
            part = s if first else s[1:]
            first = False
            parts.append(part)
            have += part.numel()
    return torch.cat(parts)[:n].to(torch.int64)


# ----------------------------------------------------------------------------------------------------- section

def _not_run(engine: ReferenceEngine) -> dict:
    """Table -> "not run: ..." for the tables whose run kind the engine lacks (drafted, concurrent streams)."""
    need = {"drafted": "drafted", "streams": "concurrent"}
    return {k: f"not run: not available from this engine ({cap})" for k, cap in need.items()
            if cap not in engine.capabilities}


def _reps(runner_fn, n: int, bar) -> list[dict]:
    out = []
    for _ in range(n):
        out.append(runner_fn())
        bar.update(1)
    return out


def _prompt_rows(runner: Runner, prompts, ks: str, p: BenchParams, kind: str, bar) -> list[dict]:
    """One row per prompt: ``bench_reps`` requests (cold, then warm repeats) of ``kind`` (plain / drafted)."""
    fn = runner.plain if kind == "plain" else runner.drafted
    return [{"kernels": ks, "prompt": pr.name, "runs": _reps(lambda: fn(pr.ids, ks, p.gen_tokens),
                                                             p.bench_reps, bar)} for pr in prompts]


def _itl_rows(runner: Runner, prompts, ks: str, p: BenchParams, kinds, bar) -> list[dict]:
    rows = []
    for kind in kinds:
        fn = runner.plain if kind == "plain" else runner.drafted
        for pr in prompts:
            runs = _reps(lambda: fn(pr.ids, ks, p.gen_tokens), p.bench_itl_reps, bar)
            rows.append({"kernels": ks, "mode": kind, "prompt": pr.name, "runs": runs, **_pooled_itl(runs)})
    return rows


def _pooled_itl(runs: list[dict]) -> dict:
    """ITL p50/p95 (ms, numpy.percentile linear) over the gaps of all ``runs`` together; None without gaps."""
    gaps = np.concatenate([r["_gaps_ms"] for r in runs]) if runs else np.zeros(0)
    if not gaps.size:
        return {"itl_p50_ms": None, "itl_p95_ms": None}
    return {"itl_p50_ms": float(np.percentile(gaps, 50)), "itl_p95_ms": float(np.percentile(gaps, 95))}


def _stream_summary(streams: list[dict]) -> dict:
    """One concurrent run: aggregate tok/s = sum of the streams' decode tok/s, per-stream = their mean, max TTFT,
    mean ITL (mean over streams), ITL p95 over all streams' gaps, end-to-end tok/s = all generated tokens / the
    last token's time since the run started."""
    rates = [s["decode_tps"] for s in streams if s["decode_tps"] is not None]
    itls = [s["itl_mean_ms"] for s in streams if s["itl_mean_ms"] is not None]
    last = max(s["last_token_s"] for s in streams)
    return {"aggregate_tps": sum(rates) if rates else None, "per_stream_tps": float(np.mean(rates)) if rates else None,
            "ttft_max_s": max(s["ttft_s"] for s in streams), "itl_mean_ms": float(np.mean(itls)) if itls else None,
            "itl_p95_ms": _pooled_itl(streams)["itl_p95_ms"],
            "end_to_end_tps": sum(s["generated"] for s in streams) / last if last else None}


def _cold_rows(runner: Runner, sources, ks: str, p: BenchParams, bar) -> list[dict]:
    """Exact-length prompts; runs whose prefill did not serve every row are refused (kept as refused)."""
    rows = []
    for n in p.bench_cold_lengths:
        ids = exact_length_ids(n, sources)
        runs = _reps(lambda: runner.plain(ids, ks, p.gen_tokens), p.bench_reps, bar)
        refused = [i for i, r in enumerate(runs) if r["cache_state"] != "cold"]
        rows.append({"kernels": ks, "requested": n, "runs": runs, "qualified": not refused, "refused_reps": refused})
    return rows


def _stream_rows(runner: Runner, prompts, ks: str, p: BenchParams, alone: dict, bar) -> list[dict]:
    rows = []
    for pr in prompts:
        for n in STREAM_COUNTS:
            reps, errors = [], []
            for _ in range(p.bench_reps):
                try:
                    streams = runner.streams(pr.ids, n, ks, p.gen_tokens)
                    reps.append({"streams": streams, **_stream_summary(streams)})
                except RuntimeError as e:  # a failed run is reported, not hidden
                    errors.append(f"{type(e).__name__}: {e}")
                bar.update(1)
            ref = alone[(ks, pr.name)]
            eq = [bool(torch.equal(s["_gen_ids"], ref)) for rep in reps for s in rep["streams"]]
            rows.append({"kernels": ks, "prompt": pr.name, "streams": n, "reps": reps, "failed": len(errors),
                         "errors": errors, "equal_to_alone": sum(eq), "not_equal_to_alone": len(eq) - sum(eq)})
    return rows


def _memory(runner: Runner, prompts, ks: str, p: BenchParams, bar) -> dict:
    """Peak of a batched and a bench-path prefill (1 token) of the longest prompt; None on CPU."""
    if runner.device.type != "cuda":
        return {"kernels": ks, "batched_peak_bytes": None, "path_peak_bytes": None, "extra_bytes": None}
    longest = max(prompts, key=lambda pr: pr.n_tokens)
    b = runner.plain(longest.ids, ks, 1, "batched")["peak_mem_bytes"]
    d = runner.plain(longest.ids, ks, 1)["peak_mem_bytes"]
    bar.update(2)
    return {"kernels": ks, "prompt": longest.name, "batched_peak_bytes": b, "path_peak_bytes": d,
            "extra_bytes": d - b}


def _n_runs(p: BenchParams, n_prompts: int, drafted: bool, streams: bool, cuda: bool) -> int:
    kinds = 2 if drafted else 1
    per_set = (kinds * n_prompts * (p.bench_reps + p.bench_itl_reps) + len(p.bench_cold_lengths)
               * p.bench_reps + (n_prompts * len(STREAM_COUNTS) * p.bench_reps if streams else 0)
               + (2 if cuda else 0))
    return per_set * len(p.kernel_sets)


def _load(p: BenchParams):
    """(weights for forward, expert store or None, tokenizer) as the ``offload`` parameter asks."""
    if not p.offload:
        w, tok = load_model(p.preset, p.device, p.dtype, p.checkpoint, p.weights)
        return w, None, tok
    device = resolve_device(p.device)
    w_host, tok = load_model(p.preset, "cpu", p.dtype, p.checkpoint, p.weights)
    store = ExpertStore(w_host, "offload", RING_SLOTS, device)
    return store.weights, store, tok


def _strip(obj):
    """Drop the in-memory ``_gen_ids`` fields before JSON."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def run_section(params: BenchParams | dict) -> dict:
    """The ``bench`` section from profile/notebook parameters.

    params (BenchParams, or a dict of its fields): preset, device, dtype, prompts, prompt_max_tokens, gen_tokens
    (replaced by bench_gen_tokens when that is set), deep_threshold, kernel_sets,
    and (with defaults) bench_path, bench_step, bench_reps, bench_itl_reps, bench_cold_lengths, offload, checkpoint,
    allow_unpinned, weights ("bf16", "int4_g128", "nvfp4": the model's projections) and kv_dtype ("bf16",
    "fp8_e4m3", "fp8_e4m3_block": what every request's KV cache stores).
    Returns:
        {"section": "bench", "data": {"config", "not_run", "plain", "drafted", "itl", "cold", "streams",
        "memory", "offload"}}; every run record as in Runner; times in seconds, rates in tokens/s, ITL in ms,
        memory in bytes.
    Raises:
        ValueError: see bench_params (checked before the model loads for presets), unknown kernel set, prompt,
            preset, device or dtype; PromptPinError: prompt text unpinned.
    """
    p = BenchParams.from_dict(params)
    if not p.checkpoint:   # a preset's length limit is known before the model loads
        p.check_lengths(get_preset(p.preset).max_positions)
    validate_sets(p)   # an unknown set, or one failing on tiny inputs, before the model loads
    w, store, tok = _load(p)
    p.check_lengths(w.cfg.max_positions)
    prompts = build_prompts(p.prompts, p.prompt_max_tokens, p.allow_unpinned, tok, w.cfg.vocab_size)
    sources = [build_prompt(n, None, p.allow_unpinned, tok).ids for n in ("code", "docs")]
    engine = ReferenceEngine(w, tok, p.kernel_sets[0], deep_threshold=p.deep_threshold, draft_k=MTP_K,
                             kv_dtype=p.kv_dtype, experts=store, graphs=p.bench_graphs and w.device.type == "cuda")
    not_run = _not_run(engine)
    runner = Runner(engine, p)
    data = {k: [] for k in ("plain", "drafted", "itl", "cold", "streams", "memory")}
    total = _n_runs(p, len(prompts), "drafted" not in not_run, "streams" not in not_run, runner.device.type == "cuda")
    with ExitStack() as stack:
        bar = stack.enter_context(progress_bar(total, "bench", "run"))
        for ks in p.kernel_sets:
            _bench_set(runner, prompts, sources, ks, p, not_run, data, bar)
    data.update(config=_config(p, w, store), not_run=not_run, offload=store.info() if store else None)
    return {"section": "bench", "prompts": [prompt_record(pr) for pr in prompts], "data": _strip(data)}


MERGE_SAME = ("preset", "device", "dtype", "weights", "kv_dtype", "path", "step", "deep_threshold", "gen_tokens", "reps", "itl_reps",
              "cold_lengths", "offload", "mtp_k", "stream_counts", "device_name")


def merge_sections(parts: list[dict]) -> dict:
    """One bench section from sections computed per kernel set (e.g. ``--param 'kernel_sets=[fast]'`` and
    ``[invariant]`` in two device calls): every table's rows concatenated in the given order, ``kernel_sets`` joined.

    Each set's rows depend only on that set's runs (_bench_set), so the merge equals one run of both sets, except
    that each part's first request is "cold" in its own process (in one process the second set's cold runs follow
    the first set's warm-up). The parts' ``provenance`` records are joined field by field.

    Raises:
        ValueError: fewer than two parts, a part that is not a bench section, kernel sets that overlap, or parts
            whose configurations differ in anything but kernel_sets (names the field and both values).
    """
    if len(parts) < 2 or any(not isinstance(q, dict) or q.get("section") != "bench" for q in parts):
        raise ValueError(f"merging needs two or more bench sections, got {len(parts)} part(s)")
    configs = [q["data"]["config"] for q in parts]
    for c in configs[1:]:
        for key in MERGE_SAME:
            if c.get(key) != configs[0].get(key):
                raise ValueError(f"bench sections differ in {key}: {configs[0].get(key)!r} vs {c.get(key)!r}")
    sets = [ks for c in configs for ks in c["kernel_sets"]]
    twice = sorted({ks for ks in sets if sets.count(ks) > 1})
    if twice:
        raise ValueError(f"bench sections overlap in kernel sets {twice} (each set may come from one part only)")
    data = {k: [row for q in parts for row in q["data"][k]]
            for k in ("plain", "drafted", "itl", "cold", "streams", "memory")}
    data.update(config={**configs[0], "kernel_sets": sets},
                not_run={k: v for q in parts for k, v in (q["data"].get("not_run") or {}).items()},
                offload=next((q["data"]["offload"] for q in parts if q["data"].get("offload")), None))
    return {"section": "bench", "data": data, **joined_records(parts)}


def _bench_set(runner: Runner, prompts, sources, ks: str, p: BenchParams, not_run: dict, data: dict, bar) -> None:
    """Every table's runs for kernel set ``ks``, appended to ``data`` in place (order: plain, drafted, ITL
    repetitions, cold-cache lengths, streams, memory pair)."""
    kinds = ["plain"] + ([] if "drafted" in not_run else ["drafted"])
    for kind in kinds:
        data[kind] += _prompt_rows(runner, prompts, ks, p, kind, bar)
    data["itl"] += _itl_rows(runner, prompts, ks, p, kinds, bar)
    data["cold"] += _cold_rows(runner, sources, ks, p, bar)
    if "streams" not in not_run:
        alone = {(r["kernels"], r["prompt"]): r["runs"][0]["_gen_ids"] for r in data["plain"]}
        data["streams"] += _stream_rows(runner, prompts, ks, p, alone, bar)
    data["memory"].append(_memory(runner, prompts, ks, p, bar))


def _config(p: BenchParams, w, store) -> dict:
    return {"preset": p.preset, "device": str(w.device), "dtype": p.dtype, "weights": p.weights,
            "kv_dtype": p.kv_dtype, "kernel_sets": list(p.kernel_sets),
            "path": p.bench_path, "step": p.bench_step, "deep_threshold": p.deep_threshold,
            "gen_tokens": p.gen_tokens, "reps": p.bench_reps, "itl_reps": p.bench_itl_reps,
            "cold_lengths": list(p.bench_cold_lengths), "offload": p.offload, "mtp_k": MTP_K,
            "decode_graphs": bool(p.bench_graphs and w.device.type == "cuda"),
            "stream_counts": list(STREAM_COUNTS), "prompt_cache": "off (paths.generate holds no prompt cache)",
            "temperature": 0, "eos": "ignored", "weights_device_bytes": w.nbytes(),
            "ring_bytes": store.ring_bytes if store else 0,
            "device_name": torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else "cpu"}
