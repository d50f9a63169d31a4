"""The ``hashes`` section: the hash matrix, one row per engine x configuration x prompt, each run against its
engine's oracle through one comparison (engines.compare: tokens, prompt-logit rows, generated-logit rows, KV bytes).

Without ``engine`` the matrix is our engine's, in full (below); with ``engine`` (engine specs: our ``reference``,
transformers, OpenAI-compatible servers, llama.cpp) it is each named engine's configurations, with their stream
equalities, bench, repeat test and the first op that broke (analysis/engines.py, markdown engines_md.py).

Our engine's matrix: every prompt x path x step size x kernel set (rows: engine ``reference``; the configuration
is kernels, path, step and offload). The oracle of a kernel set is its serial ``decode`` path. For each other run
the section records whether the generated tokens equal the oracle's (token hash), the first divergent generated
index with the oracle's top-1/top-2 logit margin there, whether every prompt row's logits, every generated row's
logits and the KV cache are byte-identical, and per-position max |logit difference| of prompt rows (binned) for the
plot. Rows record the model's weights setting, KV-cache dtype
and routing groups. Control runs (control_runs) repeat the matrix on a cut prompt: a step sweep, an fp32 control
and, with ``hash_features``, each engine feature (FEATURES: quantized weights, fp8 KV caches, grouped routing)
against that feature's own decode oracle; packed rows (packed_rows) prefill the prompts together in one forward.
With ``hash_graphs`` on a CUDA device the runs replay their decode steps from CUDA graphs (the oracle its prompt
rows too: graphs.GraphDecoder, the eager steps' bytes) and each row's ``graphs`` says whether a graph served and,
if not, why; ``graphs`` is None where graphs were not tried (hash_graphs off, a CPU device, the packed rows).
Tables, the plot and the view of both kinds: analysis/hashes_report.py (engines: engines_md.py).
"""
from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

from ..checkpoint import load_model
from ..engines.reference import ReferenceEngine
from ..exact import compare as exact_compare, token_hash
from ..progress import bar as progress_bar
from ..kernels import get_set
from .contract.validate import validate_sets
from ..params import HashesParams, check_offload_paths, offload_modes
from ..prompt_files import build_prompts, prompt_record
from ..prompts import build_prompt
from ..run import Run
from ..weights import weights_format
from .engines import DIFF_BINS, compare, oracle_runs, run_engines

def run_configs(steps, kernel_sets) -> list[tuple[str, str, int | None]]:
    """(kernel set, path, step) of one prompt's runs, each set's oracle first.

    Raises:
        ValueError: an empty step list or a step <= 0.
    """
    steps = list(steps)
    if not steps or any(not isinstance(s, int) or s <= 0 for s in steps):
        raise ValueError(f"steps must be a non-empty list of positive ints (tokens), got {steps!r}")
    out = []
    for ks in kernel_sets:
        out.append((ks, "decode", None))
        out += [(ks, p, s) for p in ("batched", "deep") for s in steps]
    return out


def _row(prompt, run: Run, seconds: float, w) -> dict:
    return {
        "engine": "reference", "prompt": prompt.name, "prompt_tokens": prompt.n_tokens, "prompt_sha256": prompt.sha256,
        "prompt_pin_ok": prompt.pin_ok, "path": run.path, "step": run.step, "kernels": run.kernels,
        "weights": weights_format(w), "kv_dtype": run.kv_dtype, "routing_groups": w.cfg.router_groups,
        "deep_threshold": run.deep_threshold if run.path == "deep" else None,
        "gen_tokens": int(run.gen_ids.numel()), "hash": token_hash(run.gen_ids), "served": run.served,
        "graphs": run.graphs_record(), "ttft_s": round(run.ttft_s, 4), "decode_s": round(run.decode_s, 4),
        "seconds": round(seconds, 3),
    }


def run_prompt(w, prompt, kernel_sets, steps, gen_tokens, deep_threshold, progress=None,
               store=None, offload_paths=("decode", "batched", "deep"), rerun: bool = False, *,
               kv_dtype: str = "bf16", oracles: dict | None = None, graphs: bool = False) -> list[dict]:
    """All runs of one prompt on our engine (one per kernel set, resident and offloaded), walked configuration by
    configuration against the oracle as any engine's are walked (engines.oracle_runs); rows as
    documented in the module docstring (``_curve`` holds the plot data).

    With an offload ``store`` (offload.ExpertStore) the runs of ``offload_paths`` are repeated with the experts in
    host memory, and each is compared with the resident oracle: offload must not change a byte. (Every offloaded
    run's generated tokens come from decode steps that fetch their experts from host memory, so leaving the
    ``decode`` path out of ``offload_paths`` still checks offloaded decode steps, over the reply only.)

    With ``rerun``, each set's first batched run is repeated once, identically, and its row gets ``rerun_equal``
    (tokens and every prompt-logit byte equal): the control that tells a set that is not run-to-run deterministic
    (so that no comparison of its runs, offload included, can separate a cause from noise) from one that is.

    Every run's KV cache stores ``kv_dtype`` (cache.KV_DTYPES). ``oracles``, when given, receives each set's
    decode oracle (a Run with its KV) under (prompt name, kernel set name), for later comparisons.
    ``graphs``: every run replays its decode steps from CUDA graphs where one serves.
    """
    offs = [False, True] if store is not None else [False]
    engines = {}   # our engine per (kernel set name, offloaded): resident, and with the experts in host memory
    for ks in kernel_sets:
        for off in offs:
            engines[(get_set(ks).name, off)] = ReferenceEngine(
                store.weights if off else w, None, ks, deep_threshold=deep_threshold, kv_dtype=kv_dtype,
                experts=store if off else None, graphs=graphs)
    rows, first = _run_modes(engines, w, prompt, kernel_sets, steps, gen_tokens, progress, offs, offload_paths,
                             oracles)
    for ks in (kernel_sets if rerun else []):
        row, run = first[get_set(ks).name]
        engine = engines[(get_set(ks).name, False)]
        again = engine.run(prompt.ids, gen_tokens, engine.configuration("batched", row["step"]), progress=progress)
        v = exact_compare(again, run)
        row["rerun_equal"] = v.tokens.equal and v.prompt_rows.equal
    return rows


def _run_modes(engines, w, prompt, kernel_sets, steps, gen_tokens, progress, offs, offload_paths, oracles=None):
    """run_prompt without the rerun control, on ``engines[(kernel set name, offloaded)]``: (rows, {kernel set
    name: (its first resident batched row, that Run without its KV)})."""
    rows, oracle, first = [], {}, {}
    for off in offs:
        for ks in kernel_sets:
            name = get_set(ks).name
            engine = engines[(name, off)]
            configs = [engine.configuration(path, step) for _, path, step in run_configs(steps, [ks])
                       if not off or path in offload_paths]   # resident: the decode oracle first

            def keep_kv(config, engine=engine):
                return engine.run(prompt.ids, gen_tokens, config, keep_kv=True, progress=progress)
            for _, run, ref, seconds in oracle_runs(engine, prompt.ids, gen_tokens, configs, run=keep_kv,
                                                     oracle=oracle.get(name) if off else None):
                row = {**_row(prompt, run, seconds, w), "offload": off}
                row.update(compare(run, ref, curve=True))
                if run is ref:
                    oracle[name] = run
                    if oracles is not None:
                        oracles[(prompt.name, name)] = run
                else:
                    run.kv = run.cache = None  # the oracle keeps its KV for the later runs' KV comparison
                    if run.path == "batched" and not off:
                        first.setdefault(name, (row, run))
                rows.append(row)
    return rows, first


def packed_rows(w, prompts: list, kernel_sets, gen_tokens: int, oracles: dict, kv_dtype: str = "bf16",
                progress=None) -> list[dict]:
    """The prompts prefilled packed together (our engine's run_packed, the batched plan, at most BATCH_LIMIT per
    forward) and decoded together, each compared with its decode oracle ``oracles[(prompt name, set name)]``
    (run_prompt's): tokens, prompt logits and KV bytes through compare(). Rows carry ``control`` "packed" and path
    "packed"."""
    rows, limit = [], ReferenceEngine.BATCH_LIMIT
    for ks in kernel_sets:
        engine = ReferenceEngine(w, None, ks, kv_dtype=kv_dtype)
        for a in range(0, len(prompts), limit):
            group = prompts[a:a + limit]
            t0 = time.perf_counter()
            runs = engine.run_packed([pr.ids for pr in group], gen_tokens, "batched", keep_kv=True)
            secs = time.perf_counter() - t0
            if progress is not None:
                progress.update(sum(pr.n_tokens + gen_tokens for pr in group))
            for pr, run in zip(group, runs):
                row = {**_row(pr, run, secs, w), "offload": False, "control": "packed",
                       "packed_prompts": [q.name for q in group]}
                rows.append({**row, **compare(run, oracles[(pr.name, run.kernels)], curve=True)})
    return rows


class Control(NamedTuple):
    """One set of control runs: its label (the rows' ``control``), storage dtype, prompt, step sizes, and the
    model it runs: weights setting, KV-cache dtype and routing groups ((n_groups, topk_groups), None = the
    model's own routing)."""

    label: str
    dtype: str
    prompt: object
    steps: list[int]
    weights: str
    kv_dtype: str
    routing: tuple[int, int] | None = None


# hash_features: label -> (weights, kv_dtype, routing groups); None keeps the profile's setting. The routing
# control keeps 1 of 4 groups: a group scores by its best logit, so keeping top_k or more groups never changes
# the picks, while keeping one forces every pick into the best group.
FEATURES = {"weights int4_g128": ("int4_g128", None, None), "weights nvfp4": ("nvfp4", None, None),
            "kv fp8_e4m3": (None, "fp8_e4m3", None), "kv fp8_e4m3_block": (None, "fp8_e4m3_block", None),
            "grouped routing 4/1": (None, None, (4, 1))}


def control_runs(p: HashesParams, prompts: list, tokenizer) -> list[Control]:
    """The control runs, each on ``hash_sweep_prompt`` cut to ``hash_sweep_tokens`` tokens and renamed
    ``<name>[:<n>]`` (plus `` <label>`` after the sweep) so that its rows stand apart from the full runs: the step
    sweep (steps at tile and block boundaries, in the profile's model), the fp32 control (the profile's steps in
    float32) and, with ``hash_features``, the profile's steps on each FEATURES model (quantized weights, an fp8 KV
    cache, grouped routing), each against the decode oracle of that same model."""
    if not p.hash_sweep_steps and not p.hash_fp32_control and not p.hash_features:
        return []
    pr = build_prompt(p.hash_sweep_prompt, p.hash_sweep_tokens, p.allow_unpinned, tokenizer)
    pr = dataclasses.replace(pr, name=f"{pr.name}[:{pr.n_tokens}]")
    out = [Control("step sweep", p.dtype, pr, list(p.hash_sweep_steps), p.weights, p.kv_dtype)
           ] if p.hash_sweep_steps else []
    if p.hash_fp32_control:
        out.append(Control("fp32 control", "float32", dataclasses.replace(pr, name=f"{pr.name} fp32"),
                           list(p.steps), p.weights, p.kv_dtype))
    for label, (weights, kv, routing) in (FEATURES.items() if p.hash_features else ()):
        out.append(Control(label, p.dtype, dataclasses.replace(pr, name=f"{pr.name} {label}"), list(p.steps),
                           weights or p.weights, kv or p.kv_dtype, routing))
    return out


def control_model(p: HashesParams, c: Control, w):
    """The weights a control runs on: ``w`` (the profile's) when dtype and weights setting match, else loaded
    anew; with ``c.routing`` a copy whose config routes in groups (same tensors).

    Raises:
        ValueError: the model's experts cannot form those groups (config.ModelConfig names why).
    """
    if c.dtype != p.dtype or c.weights != p.weights:
        w = load_model(p.preset, p.device, c.dtype, p.checkpoint, c.weights)[0]
    if c.routing is not None:
        w = dataclasses.replace(w, cfg=w.cfg.replace(n_groups=c.routing[0], topk_groups=c.routing[1]))
    return w


def run_section(params: HashesParams | dict) -> dict:
    """The ``hashes`` section from profile/notebook parameters: with ``engine``, the engines' matrix
    (engines.run_engines documents it and its parameters); else our engine's, below.

    params: HashesParams, or a dict of its fields (built with HashesParams.from_dict): preset, device, dtype,
    prompts, prompt_max_tokens (int|None), steps, gen_tokens, deep_threshold, kernel_sets, optional checkpoint
    ("" = synthetic), allow_unpinned (False), hash_offload (False, True or [False, True]: True repeats runs with
    the experts in host memory, offload.ExpertStore), hash_offload_paths (the paths repeated offloaded, default all
    three), hash_sweep_steps (extra steps at tile and block boundaries, e.g. [63, 64, 65, 127, 128, 129], run on
    hash_sweep_prompt cut to hash_sweep_tokens tokens, so that a fault that appears only at some call sizes shows end
    to end), hash_fp32_control (the profile's steps again in float32 on that cut prompt: bf16 storage hides many
    reduction-order changes that fp32 exposes; control rows carry ``control``), hash_max_tokens (int|None: cuts
    the prompts of this section only, default prompt_max_tokens; the serial oracle costs one decode step per prompt
    token), hash_graphs (True: on a CUDA device every run replays its decode steps, the oracle's prompt rows
    included, from CUDA graphs, the eager steps' bytes, and its row's ``graphs`` records whether a graph served and
    why not; on a CPU device graphs are never tried and ``graphs`` is None), hash_rerun (True: repeat each set's
    first batched run once and record ``rerun_equal`` on its row, see run_prompt), weights ("bf16", "int4_g128" or
    "nvfp4": the model's projections), kv_dtype ("bf16", "fp8_e4m3" or "fp8_e4m3_block": what every run's KV cache
    stores),
    hash_features (False: the control runs of FEATURES on the cut prompt, each against its own model's decode
    oracle, and the prompts packed into one prefill (packed_rows) against their oracles). Rows record weights,
    kv_dtype and routing_groups.
    Returns:
        {"section": "hashes", "rows": [...], "curves": [{prompt, kernels, path, step, bin_width, max_abs_diff}]}.
    Raises:
        ValueError: bad preset/device/dtype/steps/kernel set/prompt name; PromptPinError: prompt text unpinned.
    """
    p = HashesParams.from_dict(params)   # refuses bad values before any work
    validate_sets(p)   # and a set that is unknown or fails on tiny inputs
    if p.engine:
        return run_engines(p)
    off_paths = (list(ReferenceEngine.PATHS) if p.hash_offload_paths is None
                 else check_offload_paths(p.hash_offload_paths))
    max_tokens = p.max_tokens
    w, tok = load_model(p.preset, p.device, p.dtype, p.checkpoint, p.weights)
    prompts = build_prompts(p.prompts, max_tokens, p.allow_unpinned, tok, w.cfg.vocab_size)
    for pr in prompts:
        if pr.n_tokens + p.gen_tokens > w.cfg.max_positions:
            raise ValueError(f"prompt {pr.name!r} has {pr.n_tokens} tokens; with {p.gen_tokens} generated it "
                             f"exceeds max_positions={w.cfg.max_positions}")
    store = None
    if True in offload_modes(p.hash_offload):
        from ..offload import ExpertStore
        store = ExpertStore(w.to(device="cpu"), "offload", device=w.device)
    configs = run_configs(p.steps, p.kernel_sets)
    rerun = p.hash_rerun
    n_runs = (len(configs) + (sum(c[1] in off_paths for c in configs) if store else 0)
              + (len(p.kernel_sets) if rerun else 0))
    tokens = n_runs * sum(pr.n_tokens + p.gen_tokens for pr in prompts)   # rows through the model
    controls = control_runs(p, prompts, tok)
    tokens += sum(len(run_configs(c.steps, p.kernel_sets)) * (c.prompt.n_tokens + p.gen_tokens) for c in controls)
    tokens += len(p.kernel_sets) * sum(pr.n_tokens + p.gen_tokens for pr in prompts) if p.hash_features else 0
    rows, oracles = [], {}
    graphs = p.hash_graphs and w.device.type == "cuda"
    with progress_bar(tokens, "hash matrix", "token") as bar:
        for pr in prompts:
            rows += run_prompt(w, pr, p.kernel_sets, p.steps, p.gen_tokens, p.deep_threshold, bar, store,
                               off_paths, rerun, kv_dtype=p.kv_dtype, oracles=oracles, graphs=graphs)
        if p.hash_features:
            rows += packed_rows(w, prompts, p.kernel_sets, p.gen_tokens, oracles, p.kv_dtype, bar)
        oracles.clear()   # their caches are no longer needed
        for c in controls:
            rows += [{**r, "control": c.label}
                     for r in run_prompt(control_model(p, c, w), c.prompt, p.kernel_sets, c.steps, p.gen_tokens,
                                         p.deep_threshold, bar, kv_dtype=c.kv_dtype, graphs=graphs)]
    curves = [{"prompt": r["prompt"], "kernels": r["kernels"], "path": r["path"], "step": r["step"],
               "offload": r["offload"],
               "bin_width": max(1, -(-r["prompt_tokens"] // DIFF_BINS)), "max_abs_diff": r.pop("_curve")}
              for r in rows]
    return {"section": "hashes", "prompts": [prompt_record(pr) for pr in prompts], "rows": rows,
            "curves": [c for c in curves if c["max_abs_diff"] is not None]}
