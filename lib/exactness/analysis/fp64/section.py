"""FP64 per-class receipt: how far each path's arithmetic is from exact, per kernel class, against a certified
FP64 reference.

One row per (class, path, kernel set, dtype, input set); per output element i with reference y_i, stored value
yhat_i, normaliser A_i (fp64/ref.py) and u_acc = 2^-24:

    eta_i            |yhat_i - y_i| / A_i (total error, including the final rounding to the stored dtype)
    eta_max_u, eta_p99_u, bias_u   max, 99th percentile and mean of eta (bias: signed) in units of u_acc
    pre_i            distance from y_i to the reals that round to yhat_i (ulp.distance_to_rounding_interval): the
                     smallest error the kernel's value can have had *before* its final rounding
    eta_over_gamma   max_i (pre_i / A_i) / gamma_{K_i}: for the GEMM classes this is the accumulation error
                     against Higham's bound (must be <= 1); for composite classes it also carries their
                     intermediate storage roundings and is reported for information
    eta_over_sqrtk_u max_i (pre_i / A_i) / (sqrt(K_i)·u_acc): against the probabilistic bound (Higham & Mary
                     2019), for information only (it assumes unbiased rounding errors)
    bound_use        max_i pre_i / beta_i (beta: the class's bound before the final rounding, fp64/ref.py)
    kappa            A_i / |y_i| (median, max over y_i != 0); ULP vs RN(y) in the stored dtype: % at 0, % at 1, max
    rmse             sqrt(mean (yhat - y)^2) (absolute, like the FlashAttention-3 paper's RMSE)
    bitwise_equal_share, max_ulp_vs_decode   over the sampled rows present in both this path and decode
    flips            router top-k sets / lm_head argmaxes that differ from the fp64 reference's choice on the same
                     inputs (min_flip_margin: the smallest reference margin among them; min_margin over all rows);
                     flips_vs_decode: rows whose choice differs from the decode path's
Verdict rule: ``uncertified`` when the reference failed certification; else ``exact`` when the path is not decode
and every sampled output's bytes equal decode's; else ``within bound`` when bound_use <= 1, i.e. for every output
there is a value within the class bound of the exact result whose rounding to the stored dtype is the stored
output (for GEMMs: |z - y| <= gamma_K·sum|x·w| for the fp32 value z before storage); else ``outside bound``.
Weights formats (``fp64_weights``, default the profile's ``weights``): each format runs the captured paths on the
preset's synthetic weights quantized to it (weights.synthetic_weights) and the synthetic cases of the classes whose
weights it replaces; every row names its ``weights``, and a quantized GEMM is judged against its dequantized
weights (fp64/ref.py). KV format (``kv_dtype``, the profile's): the captured runs store their KV cache in it and
the synthetic attention cases store their drawn caches in it; attention rows over an fp8 cache name it
(``kv_dtype``; rows over a bf16 cache carry no such field) and are judged against the cache's values as stored
(dequantized, fp64/ref.py kv64). A captured row's verdict speaks of the prompt positions it sampled only:
``sampled.position_list`` lists them (the evenly spaced ones plus any ``extra_positions``, e.g. the rows the kernel
contract flagged), and the verdict markdown names them.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from ...cache import KVFormat
from ...config import get_preset
from ...kernels import get_set, set_names
from ...kernels.registry import ClassNames
from ...engines.reference import ReferenceEngine
from ...params import Fp64Params
from ...progress import bar as progress_bar
from ...prompt_files import build_prompts, prompt_record
from ...weights import synthetic_weights
from . import synth
from .cert import certify
from .ref import CERT_MAX_ULPS, evaluate, gamma
from ...checkpoint import resolve_device
from ..contract.validate import validate_sets
from ..taps import TapRecorder
from .stats import HIST_EDGES, distinct, error_stats, make_row, pick_elements, ulp_hist
from ..ulp import U_ACC

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
CLASSES = ClassNames(lambda r: r.fp64 is not None)   # the classes with an FP64 evaluator, in class order
PATHS = ReferenceEngine.PATHS


def capture_plan(p: Fp64Params, extra_positions=()) -> dict:
    """Prompt, token count, step and sampled positions of the captured runs.

    The step is the first profile step >= deep_threshold (so that the deep path runs deep), else None (one chunk);
    the prompt is ``fp64_prompt`` (default: the profile's longest) cut to ``fp64_tokens`` (default: step or
    deep_threshold, plus 16, so that a deep segment and a batched tail both run); ``fp64_rows`` positions evenly
    spaced over the prompt, the last one included, plus ``extra_positions`` (ints; rows to judge besides, such as
    those the kernel contract flagged; ``fp64_extra_positions`` adds to them). Returns also ``extra``: the extra
    positions, sorted.

    Raises:
        ValueError: an extra position that is not an int in 0..P-1 (P: the captured prompt's tokens).
    """
    extra_positions = [*extra_positions, *p.fp64_extra_positions]
    step = next((s for s in p.steps if s >= p.deep_threshold), None)
    prompts = {pr.name: pr for pr in build_prompts(p.prompts, p.prompt_max_tokens,
                                                     vocab=get_preset(p.preset).vocab_size)}
    if p.fp64_prompt is not None and p.fp64_prompt not in prompts:
        raise ValueError(f"fp64_prompt {p.fp64_prompt!r} is not one of the run's prompts: {', '.join(prompts)}")
    name = p.fp64_prompt or max(prompts, key=lambda n: prompts[n].n_tokens)
    prompt = prompts[name]
    want = p.fp64_tokens or (max(step or 0, p.deep_threshold) + 16)
    P = min(prompt.n_tokens, int(want))
    R = min(int(p.fp64_rows), P)
    bad = [x for x in extra_positions if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < P]
    if bad:
        raise ValueError(f"extra fp64 positions {bad} are not ints in 0..{P - 1} (the captured prompt "
                         f"{name!r} has {P} tokens)")
    extra = sorted(set(extra_positions))
    positions = sorted({round(i * (P - 1) / max(R - 1, 1)) for i in range(R)} | set(extra))
    return {"prompt": name, "record": prompt_record(prompt), "ids": prompt.ids[:P], "tokens": P, "step": step,
            "positions": positions, "extra": extra}


def capture(w, plan: dict, kernel_sets, deep_threshold: int, kv_dtype: str = "bf16") -> tuple[TapRecorder, dict]:
    """Run every path of every kernel set on the plan's prompt (one generated token, our engine on ``w`` with a
    ``kv_dtype`` KV cache) under the tap recorder. On CUDA the decode steps that hold no sampled row replay from a
    CUDA graph, untapped (graphs.py: the tapped forward's bytes); the others run eagerly, tapped.

    Returns the recorder and path -> seconds of the tapped run.
    """
    rec, secs = TapRecorder(plan["positions"], w), {}
    for ks in kernel_sets:
        engine = ReferenceEngine(w, None, ks, deep_threshold=deep_threshold, kv_dtype=kv_dtype, graphs=True)
        for path in PATHS:
            t0 = time.perf_counter()
            with rec.run(path), engine.tapping(rec):
                engine.run(plan["ids"], 1, engine.configuration(path, plan["step"]))
            secs[f"{ks}/{path}"] = time.perf_counter() - t0
    return rec, secs


def _captured_rows(rec, p, plan, out, memo, weights: str = "bf16"):
    dtype = p.dtype
    for ks in p.kernel_sets:
        evs = {}
        for cls in CLASSES:
            for path in PATHS:
                samples = rec.samples.get((ks, path, cls))
                if not samples:
                    continue
                kv = {k[2]: v for k, v in rec.kv.items() if k[0] == ks and k[1] == path}
                if cls == "attention":
                    _check_kv(kv, p.kv_dtype)
                ev = evaluate(cls, samples, rec.params, kv)
                evs[path] = ev
                st = error_stats(ev)
                cert = certify(ev, pick_elements(ev, p.fp64_cert, 0, st["eta"]), rec.params, kv, memo)
                plans = {pl: n for (k0, p0, c0, pl), n in rec.calls.items() if (k0, p0, c0) == (ks, path, cls)}
                meta = {"class": cls, "path": path, "set": ks, "dtype": dtype, "input_set": "captured",
                        "weights": weights, **_kv_meta(cls, p.kv_dtype), **_kernel_meta(ks, cls, path),
                        "sampled": {"prompt": plan["prompt"], "positions": len(plan["positions"]),
                                    "position_list": list(plan["positions"]), "extra_positions": plan["extra"],
                                    "samples": len(samples), "outputs": int(ev.y.numel()), "certified": cert["n"],
                                    "plans": plans}}
                _emit(out, ev, evs.get("decode"), cert, meta, st)


def _check_kv(kv: dict, kv_dtype: str) -> None:
    """Refuse captured caches (layer -> (k, v)) not stored in ``kv_dtype``: uint8 for an fp8 format, else not.

    Raises:
        RuntimeError: naming the storage read and the kv_dtype asked for.
    """
    fp8 = KVFormat.of(kv_dtype).quantized
    bad = [t.dtype for pair in kv.values() for t in pair if (t.dtype == torch.uint8) != fp8]
    if bad:
        raise RuntimeError(f"the captured attention calls read a {bad[0]} KV cache, not one of kv_dtype {kv_dtype!r}")


def _kv_meta(cls: str, kv_dtype: str) -> dict:
    """The KV format an attention row over an fp8 cache was judged on; {} for other rows and bf16 caches."""
    return {"kv_dtype": kv_dtype} if cls == "attention" and kv_dtype != "bf16" else {}


def _kernel_meta(ks: str, cls: str, path: str) -> dict:
    """Kernel id and its registered one-line description (tiles, order) for a row."""
    spec = get_set(ks).decode[cls] if path == "decode" else get_set(ks).prompt[cls]
    return {"kernel": spec.name, "tiles": spec.doc}


def _emit(out, ev, dec, cert, meta, st=None):
    row, st = make_row(ev, dec, cert, meta, st)
    out["rows"].append(row)
    tag = "|".join(str(meta[k]) for k in ("class", "path", "set", "input_set", "dtype"))
    fmt = meta.get("weights", "bf16")
    out["hist"][tag + f"|K{row['K']}" + ("" if fmt == "bf16" else f"|{fmt}")] = ulp_hist(st["ulps"])
    Ks, k_values = ev.K, distinct(ev.K)
    if k_values.numel() > 8:         # K varies per row (attention): powers-of-two buckets
        Ks = 2 ** torch.ceil(torch.log2(ev.K.double())).long()
        k_values = distinct(Ks)
    for K in k_values.tolist():
        m = Ks == K
        out["by_k"].append({k: meta[k] for k in ("class", "path", "set", "input_set", "dtype", "weights")} |
                           {"K": K, "eta_max": float(st["eta"][m].max()), "pre_max": float(st["eta_pre"][m].max()),
                            "gamma": float(gamma(K)), "n": int(m.sum())})
    if meta["input_set"] == "captured":
        layers = torch.tensor([s.layer for s in ev.samples])[ev.sid]
        for L in distinct(layers).tolist():
            m = layers == L
            out["per_layer"].append({k: meta[k] for k in ("class", "path", "set", "weights")} |
                                    {"layer": L, "eta_max_u": float(st["eta"][m].max()) / U_ACC,
                                     "ulp_max": int(st["ulps"][m].max())})


def synthetic_cases(p: dict, cfg, weights: str = "bf16") -> list[tuple]:
    """(class, input set, K, dtype name) of the synthetic sweep: fp64_synth.default_cases in the profile dtype,
    plus the dense K sweep in float32 storage (where the fp32 accumulation error is not hidden by a bf16
    rounding) unless fp64_fp32_sweep is False. A quantized ``weights`` format keeps the cases of the classes whose
    weights it replaces (synth.QUANT_CLASSES), in the profile dtype."""
    base = synth.default_cases(cfg, int(p.fp64_k_max))
    if p.fp64_synth_classes:
        base = [c for c in base if c[0] in p.fp64_synth_classes]
    out = [(c, s, K, p.dtype) for c, s, K in base]
    if weights != "bf16":
        return [c for c in out if c[0] in synth.QUANT_CLASSES]
    if p.fp64_fp32_sweep and p.dtype != "float32":
        out += [(c, s, K, "float32") for c, s, K in base if c == "dense"]
    return out


def _synthetic_rows(p, cfg, dev, out, memo, weights: str = "bf16"):
    full = synthetic_cases(p, cfg)
    for cls, iset, K, dname in synthetic_cases(p, cfg, weights):
        n = full.index((cls, iset, K, dname))            # the bf16 case's seed: the same draws in every format
        case = synth.make_case(cls, iset, cfg, DTYPES[dname], dev, M=int(p.fp64_synth_rows), K=K, seed=n,
                               weights=weights, kv_dtype=p.kv_dtype if cls == "attention" else "bf16")
        evs = {}
        for ks in p.kernel_sets:
            for path in PATHS:
                if path == "deep" and cls not in synth.TILED:
                    continue
                samples = synth.case_samples(case, synth.run_case(case, ks, path), path)
                evs[(ks, path)] = evaluate(cls, samples, case.params, case.kv)
        first = next(iter(evs.values()))
        sts = {key: error_stats(e) for key, e in evs.items()}
        eta_all = torch.stack([st["eta"] for st in sts.values()]).amax(0)
        picks = pick_elements(first, p.fp64_cert, 0, eta_all)       # same inputs on every path: shared picks
        for (ks, path), ev in evs.items():
            cert = certify(ev, picks, case.params, case.kv, memo)
            meta = {"class": cls, "path": path, "set": ks, "dtype": dname, "input_set": iset,
                    "weights": weights, **_kv_meta(cls, case.kv_dtype), **_kernel_meta(ks, cls, path),
                    "sampled": {"rows": int(case.args[0].shape[0]), "outputs": int(ev.y.numel()),
                                "certified": cert["n"]}}
            _emit(out, ev, evs.get((ks, "decode")), cert, meta, sts[(ks, path)])


def run_section(params: Fp64Params | dict, extra_positions=()) -> dict:
    """The ``fp64`` receipt section.

    Args:
        params: the profile's fields (profiles.Profile.parameters()) plus optional fp64_rows (positions sampled per
            class, default 64), fp64_cert (elements certified per row, 12), fp64_tokens / fp64_prompt (captured
            prompt; see capture_plan), fp64_synthetic (run the synthetic input sets, True), fp64_k_max (largest
            synthetic K, 16384), fp64_synth_rows (rows per synthetic case, 128), fp64_fp32_sweep (dense K sweep
            also in float32 storage, True), fp64_synth_classes (restrict the synthetic classes; None = all),
            fp64_weights (weights formats to judge, captured and synthetic; None = the profile's ``weights``);
            kv_dtype (the profile's: the KV format of the captured runs and the synthetic attention caches).
        extra_positions: prompt positions to judge besides the evenly spaced ones (capture_plan), e.g. the rows
            the kernel contract flagged; every captured row's verdict then covers them.
    Returns:
        {"section": "fp64", "rows": [...], "hist": {...}, "by_k": [...], "per_layer": [...], "meta": {...}}.
    Raises:
        ValueError: a missing profile field or a bad value (named), an extra position outside the prompt.
        RuntimeError: the captured attention calls read a cache not stored in kv_dtype.
        ParamError: a set given by reference whose kernels fail on tiny inputs (contract.validate.validate_sets).
    """
    p = Fp64Params.from_dict(params)   # rows and taps name each set by its own name (a reference resolved)
    validate_sets(p)
    p = dataclasses.replace(p, kernel_sets=set_names(p.kernel_sets))
    dtype, dev = DTYPES[p.dtype], resolve_device(p.device)   # a clear error where CUDA is asked for but absent
    cfg = get_preset(p.preset)
    plan = capture_plan(p, extra_positions)
    out = {"section": "fp64", "rows": [], "hist": {}, "by_k": [], "per_layer": []}
    formats = p.weight_formats
    secs = {"tapped_runs": 0.0, "captured_refs": 0.0, "synthetic": 0.0, "runs": {}}
    with progress_bar(len(formats) * (3 if p.fp64_synthetic else 2), "fp64", "stage") as bar:
        for fmt in formats:
            memo: dict = {}    # certified exact values keyed by inputs: one table per weights format
            w = synthetic_weights(cfg, dtype, dev, weights=fmt)
            bar.set_postfix_str(f"tapped runs ({fmt})")
            t0 = time.perf_counter()
            rec, runs = capture(w, plan, p.kernel_sets, int(p.deep_threshold), p.kv_dtype)
            bar.update(1)
            bar.set_postfix_str(f"captured inputs vs FP64 ({fmt})")
            t1 = time.perf_counter()
            _captured_rows(rec, p, plan, out, memo, fmt)
            bar.update(1)
            t2 = time.perf_counter()
            if p.fp64_synthetic:
                bar.set_postfix_str(f"synthetic inputs vs FP64 ({fmt})")
                _synthetic_rows(p, cfg, dev, out, memo, fmt)
                bar.update(1)
            secs["tapped_runs"] += t1 - t0
            secs["captured_refs"] += t2 - t1
            secs["synthetic"] += time.perf_counter() - t2
            secs["runs"].update({(k if fmt == "bf16" else f"{k}/{fmt}"): v for k, v in runs.items()})
    out["meta"] = {"prompt": plan["prompt"], "prompt_record": plan["record"], "tokens": plan["tokens"], "step": plan["step"],
                   "positions": len(plan["positions"]), "position_list": list(plan["positions"]),
                   "extra_positions": plan["extra"], "cert_per_row": int(p.fp64_cert),
                   "cert_max_ulps": CERT_MAX_ULPS, "hist_edges": list(HIST_EDGES), "weights": formats,
                   "seconds": secs, **({"kv_dtype": p.kv_dtype} if p.kv_dtype != "bf16" else {})}
    return out


def check_certified(section: dict) -> int:
    """Raise when any row's reference failed certification (such a reference fails the receipt).

    Returns the number of rows checked. Raises:
        RuntimeError: listing the uncertified (class, path, set, input set) rows and their first failure.
    """
    rows = section if isinstance(section, list) else section["rows"]
    bad = [r for r in rows if not r["ref_certified"]]
    if bad:
        lines = [f"{r['class']}/{r['path']}/{r['set']}/{r['input_set']}: {(r.get('cert_failures') or ['-'])[0]}"
                 for r in bad[:10]]
        raise RuntimeError(f"{len(bad)} of {len(rows)} fp64 rows have an uncertified reference:\n" + "\n".join(lines))
    return len(rows)
