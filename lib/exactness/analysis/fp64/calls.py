"""FP64 reference error of recorded calls (a source of kernel calls, analysis/calls.py: a dump set of any engine, ours
included), per kernel class, with the suite's evaluators (ref.py): every recorded row becomes a taps.Sample built from
the call's own inputs, weights and outputs, so the error is the kernel's on exactly the inputs it was given.

Per class: elements evaluated, eta_max_u (max |yhat - y| / A in units of 2^-24), bound_use (max over elements of
the distance from y to the reals rounding to yhat, divided by the class bound beta: <= 1 is within bound), the
number of elements over their bound, the ULP distance to the correctly rounded reference (max), and the worst
element's location (call, role, site, position, element). The tensor names the evaluators need are the ones
docs/dumps.md recommends per class; a class whose calls lack them is listed under ``skipped`` with the reason.
report.render_calls_md renders the result.
"""
from __future__ import annotations

import torch

from ...dumps.reader import Call, DumpSet
from ...exact import bytes_equal
from ...progress import bar as progress_bar
from ..calls import open_calls
from ..taps import Sample
from .ref import FP64_CLASSES, evaluate
from .stats import error_stats

# class -> (sample data name <- dump tensor name, from part); weights: sample tag suffix <- weight argument
NEEDS = {
    "dense": ({"x": ("inputs", "x"), "y": ("outputs", "y")}, {"": "w"}),
    "lm_head": ({"x": ("inputs", "x"), "y": ("outputs", "y")}, {"": "w"}),
    "router": ({"x": ("inputs", "x"), "y": ("outputs", "logits"), "idx": ("outputs", "idx"),
                "g": ("outputs", "weights")}, {"": "w"}),
    "expert_gate_up": ({"x": ("inputs", "x"), "y": ("outputs", "y")}, {".gate": "w_gate", ".up": "w_up"}),
    "expert_down": ({"x": ("inputs", "x"), "y": ("outputs", "y")}, {".down": "w_down"}),
    "moe_combine": ({"y": ("inputs", "y"), "g": ("inputs", "g"), "out": ("outputs", "y")}, {}),
    "attention": ({"q": ("inputs", "q"), "o": ("outputs", "y")}, {}),
    "rmsnorm": ({"x": ("inputs", "x"), "y": ("outputs", "y")}, {"": "w"}),
    "rope": ({"x": ("inputs", "x"), "y": ("outputs", "y")}, {}),
    "residual": ({"a": ("inputs", "a"), "b": ("inputs", "b"), "y": ("outputs", "y")}, {}),
}
SINGLE_WEIGHT = ("dense", "lm_head", "router", "rmsnorm")   # any one weight argument name will do (HF: "weight")


def _missing(c: Call) -> str | None:
    data, wts = NEEDS[c.cls]
    lack = [f"{part[:-1]} {n!r}" for part, n in data.values() if n not in c.refs[part]]
    if c.cls in SINGLE_WEIGHT:
        lack += [] if len(c.weights) == 1 else ["exactly one weight"]
    else:
        lack += [f"weight {w!r}" for w in wts.values() if w not in c.weights]
    if c.cls == "attention":
        lack += [f"fixed {n!r}" for n in ("k_cache", "v_cache") if n not in c.refs["fixed"]]
    if c.cls in ("rmsnorm", "rope", "router"):
        key = {"rmsnorm": "eps", "rope": "theta", "router": "top_k"}[c.cls]
        lack += [] if key in c.meta else [f"meta {key!r}"]
    return ", ".join(lack) or None


def _samples(ds: DumpSet, c: Call, params: dict, kv: dict, loaded: dict) -> list[Sample]:
    """The call's dumped rows as Samples of layer = call id (so that each call is its own group); ``loaded``: weight
    name -> tensor, read once per source."""
    data, wts = NEEDS[c.cls]
    t = {p: ds.tensors(c, p) for p in ("inputs", "outputs", "fixed")}
    for suffix, arg in wts.items():
        name = next(iter(c.weights.values())) if c.cls in SINGLE_WEIGHT else c.weights[arg]
        if name not in loaded:
            loaded[name] = ds.weight(name)
        params[(c.id, "t" + suffix)] = loaded[name]
    if c.cls == "attention":
        kv[c.id] = (t["fixed"]["k_cache"], t["fixed"]["v_cache"])
    out = []
    for k, (_, _, pos, _) in enumerate(c.rows):
        d = {name: t[part][n][k] for name, (part, n) in data.items()}
        if c.cls == "moe_combine" and "shared" in t["inputs"]:
            d["shared"] = t["inputs"]["shared"][k]
        if c.cls == "lm_head" and bytes_equal(d["y"].to(d["x"].dtype).to(d["y"].dtype), d["y"]):
            d["y"] = d["y"].to(d["x"].dtype)    # fp32 logits that widen the storage dtype: judged in it
        out.append(Sample(c.cls, c.id, "t", pos, c.role, d, dict(c.meta)))
    return out


def _class_row(cls: str, calls: list[Call], ds: DumpSet, loaded: dict) -> dict:
    params, kv, samples, where = {}, {}, [], []
    for c in calls:
        s = _samples(ds, c, params, kv, loaded)
        samples += s
        where += [(c, k) for k in range(len(s))]
    ev = evaluate(cls, samples, params, kv)
    st = error_stats(ev)
    use = torch.nan_to_num(st["use"], nan=float("inf"))
    i = int(torch.argmax(use))
    c, k = where[int(ev.sid[i])]
    return {"class": cls, "calls": len(calls), "rows": len(samples), "elements": st["n"],
            "eta_max_u": st["eta_max_u"], "bound_use": st["bound_use"], "over_bound": int((use > 1).sum()),
            "ulp_max": st["ulp_max"], "ulp0_pct": st["ulp0_pct"],
            "worst": {"call": c.id, "role": c.role, "site": c.site, "row": c.rows[k][0], "pos": c.rows[k][2],
                      "element": int(ev.j[i])}}


def fp64_of_calls(source, progress: bool = True) -> dict:
    """FP64 reference error per class of the recorded outputs of ``source`` (a dump folder or a DumpSet:
    calls.open_calls; see the module docstring).

    Returns:
        {"section": "dump_fp64", "folder", "engine", "rows": per class with an evaluator and the names it needs
        {class, calls, rows, elements, eta_max_u, bound_use, over_bound, ulp_max, ulp0_pct, worst: {call, role,
        site, pos, row, element}}, "skipped": [{class, reason}]}.
    Raises:
        DumpError: an invalid dump set. TypeError: not a source of kernel calls.
    """
    ds = open_calls(source)
    rows, skipped, loaded = [], [], {}
    classes = [c for c in FP64_CLASSES if any(k.cls == c for k in ds.calls)]
    bar = progress_bar(len(classes), "dump fp64", "class") if progress else None
    for cls in classes:
        calls = [c for c in ds.calls if c.cls == cls]
        why = next((f"{c.label()} lacks {m}" for c in calls if (m := _missing(c))), None)
        if why:
            skipped.append({"class": cls, "reason": why})
        else:
            rows.append(_class_row(cls, calls, ds, loaded))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return {"section": "dump_fp64", "folder": ds.folder, "engine": ds.engine, "rows": rows, "skipped": skipped}

