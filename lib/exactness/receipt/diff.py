"""Receipt diff: what moved between two receipts, for a pull-request comment (the ``diff`` command: diff_cli.py).

BASE and PR are receipt folders (holding ``receipt.json``), ``receipt.json`` files, or folders of section JSONs
(``python -m exactness sections --out DIR``, a receipt's ``sections/``). Sections are read through
:func:`section` (the section object ``{"section", "rows"|"data", **extra}``, whatever the receipt's storage layout).
Rows of both receipts are matched by their identity (the key fields below), and for each matched pair:

    hashes     token hashes that moved, per (engine, prompt, configuration: kernels/path/step/offload for our
               engine's matrix); the equality flags (tokens ``equals_oracle``, ``prompt_logits_equal``,
               ``gen_logits_equal``, ``kv_equal``, ``rerun_equal``) that flipped; the engines' stream rows; engines
               whose identity differs beyond their software versions (ENGINE_SOFTWARE) are not compared
    contract   (class, set, dtype, device, weights) pairs whose mismatch count changed
    fp64       (set, class, path, dtype, input set, kernel, K) rows whose verdict changed
    streams    drafted / resumed / concurrent rows whose hashes or equality flags changed
    bench      figures whose median moved by more than their run-to-run spread (diff_bench.py)

Only like is compared with like: receipts of different profiles or weights (preset, checkpoint, its SHA-256 where
recorded) are not compared at all, a section whose own setting differs (the contract's sweep, the bench's device) is
not compared, and rows whose engine identity or inputs (prompt text, lengths) differ are not compared; each is named
in ``not_comparable`` with the reason, never dropped. Rows present in one receipt only are listed.

``moved`` (the command's exit status 1) is set when something moved, was present in one receipt only or could not
be compared; nothing moved means every row compared, all equal. Bench figures beyond their
spread are listed as speed changes and do not count as moved: two receipts of one commit made at different times of
a loaded machine differ in speed by more than one receipt's repeats do.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .render import section_object
from .sections import SECTIONS

FLAG_NAMES = {"equals_oracle": "tokens", "prompt_logits_equal": "prompt logits", "gen_logits_equal": "generated logits",
              "kv_equal": "KV cache", "rerun_equal": "rerun"}
HASH_KEY = ("engine", "prompt", "config", "kernels", "path", "step", "offload")
HASH_SAME = ("prompt_sha256", "prompt_tokens", "gen_tokens", "deep_threshold", "weights", "kv_dtype", "routing_groups")
CONTRACT_KEY = ("set", "class", "dtype", "device", "weights", "weights_format")
CONTRACT_SAME = ("sweep", "control_sweep", "preset")
FP64_KEY = ("set", "class", "path", "dtype", "input_set", "kernel", "K", "weights")
STREAM_KEYS = {"drafted": ("set", "prompt", "path", "step", "draft", "k"),
               "resumed": ("set", "prompt", "mode", "step", "split"),
               "concurrent": ("set", "streams", "offset", "step"),
               "packed": ("set", "streams", "plan")}
STREAM_SAME = ("prompt_tokens", "gen_tokens")
ENGINE_STREAM_KEY = ("check", "prompt", "config")
# Identity fields of an engine that name its software and settings: they may differ between compared receipts (a
# version bump is what a pull request may be about) and are listed for reading; any other field must be equal.
ENGINE_SOFTWARE = ("version", "transformers", "torch", "system_fingerprints", "configurations")
DEFAULTS = {"engine": "reference", "weights": "resident"}   # a field a row leaves out has this value


class DiffError(ValueError):
    """Bad input to the diff: a missing file, a file that is not JSON or not a receipt, an output that exists."""


# ------------------------------------------------------------------------------------------------------ loading

def load_sections(folder: Path) -> dict:
    """A folder of section JSONs (``python -m exactness sections --out DIR``: ``<section>.json`` per section, the
    machine's env.json) as a receipt without profile or parameters, so that two such folders compare as receipts."""
    found = {}
    for file in sorted(folder.glob("*.json")):
        if file.name == "env.json":
            continue
        try:
            obj = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DiffError(f"cannot read {file}: {e}") from None
        if isinstance(obj, dict) and isinstance(obj.get("section"), str):
            found[obj["section"]] = obj
    env = folder / "env.json"
    return {"schema": 2, "profile": None, "sections": found,
            "env": json.loads(env.read_text(encoding="utf-8")) if env.is_file() else {}}


def load_receipt(path: str | os.PathLike) -> dict:
    """The receipt at ``path``: a run folder holding ``receipt.json``, the file itself, or a folder of section
    JSONs (:func:`load_sections`).

    Raises:
        DiffError: the path does not exist, the folder has neither receipt.json nor a section JSON, the file is not
            JSON, or it is not a receipt (a JSON object with ``schema`` and ``profile``).
    """
    p = Path(path)
    if p.is_dir() and not (p / "receipt.json").is_file():
        receipt = load_sections(p)
        if receipt["sections"]:
            return receipt
    file = p / "receipt.json" if p.is_dir() else p
    if not file.is_file():
        raise DiffError(f"no receipt at {str(path)!r}: expected a receipt folder holding receipt.json, or a "
                        f"receipt.json file" + (f" ({file} does not exist)" if p.is_dir() else ""))
    try:
        receipt = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DiffError(f"cannot read {file}: {e}") from None
    if not isinstance(receipt, dict) or "schema" not in receipt or "profile" not in receipt:
        raise DiffError(f"{file} is not a receipt: expected a JSON object with 'schema' and 'profile' "
                        f"(python -m exactness receipts writes one)")
    return receipt


def section(receipt: dict, name: str) -> dict | None:
    """The section object ``{"section", "rows"|"data", **extra}`` of ``name``, or None where the receipt has none.

    Reads it through render.section_object where the receipt keeps its sections under ``sections`` (schema 2);
    a receipt of schema 1 kept each section's rows or data under ``receipt[name]`` and the rest under
    ``receipt[name + "_extra"]``, and the object is rebuilt from those."""
    if isinstance(receipt.get("sections"), dict):
        return section_object(receipt, name) if name in receipt["sections"] else None
    if name not in receipt:
        return None
    data = receipt[name]
    return {"section": name, "rows" if isinstance(data, list) else "data": data, **(receipt.get(f"{name}_extra") or {})}


def weights_of(receipt: dict) -> dict:
    """The weights a receipt ran: preset, checkpoint folder and, where recorded (``receipt["weights"]`` or the
    parameters), the checkpoint's SHA-256."""
    params = receipt.get("parameters") or {}
    recorded = receipt.get("weights") if isinstance(receipt.get("weights"), dict) else {}
    return {"preset": params.get("preset"), "checkpoint": params.get("checkpoint") or None,
            "checkpoint_sha256": recorded.get("sha256") or params.get("checkpoint_sha256")}


# --------------------------------------------------------------------------------------------------------- rows

def _get(row: dict, field: str):
    return row.get(field, DEFAULTS.get(field))


def _differs(a: dict, b: dict, fields) -> str | None:
    """"field a vs b" for each of ``fields`` whose values differ (joined by "; "), or None when all agree."""
    bad = [f"{f} {_get(a, f)!r} vs {_get(b, f)!r}" for f in fields if _get(a, f) != _get(b, f)]
    return "; ".join(bad) or None


def _keyed(rows: list, fields) -> dict[tuple, dict]:
    """Rows by their key (values of ``fields``); a repeated key gets its occurrence number appended."""
    out: dict[tuple, dict] = {}
    seen: dict[tuple, int] = {}
    for r in (r for r in rows or [] if isinstance(r, dict)):
        key = tuple(str(_get(r, f)) for f in fields)
        seen[key] = n = seen.get(key, 0) + 1
        out[key + ((f"#{n}",) if n > 1 else ())] = r
    return out


def match(result: dict, name: str, base_rows: list, pr_rows: list, key, label, same=(), engines=None):
    """Pairs (label, base row, PR row) of the rows both receipts hold, in BASE's order; rows in one receipt only
    go to ``result["only_base"]`` / ``["only_pr"]`` and pairs whose ``same`` fields or engine identity differ to
    ``result["not_comparable"]``, each as {section, what, why}."""
    b, p = _keyed(base_rows, key), _keyed(pr_rows, key)
    for side, mine, other in (("only_base", b, p), ("only_pr", p, b)):
        result[side] += [{"section": name, "what": label(r)} for k, r in mine.items() if k not in other]
    pairs = []
    for k in (k for k in b if k in p):
        why = _differs(b[k], p[k], same) or (engines(b[k]) if engines else None)
        if why:
            result["not_comparable"].append({"section": name, "what": label(b[k]), "why": why})
        else:
            pairs.append((label(b[k]), b[k], p[k]))
    result["compared"][name] = result["compared"].get(name, 0) + len(pairs)
    result["not_judged"] += _added_checks(name, pairs)
    return pairs


def _change(name: str, what: str, field: str, base, pr, **extra) -> dict:
    return {"section": name, "what": what, "field": field, "base": base, "pr": pr, **extra}


def _flag_fields(row: dict) -> list[str]:
    return [k for k, v in row.items() if (k in FLAG_NAMES or k == "equal" or k.endswith("_equal"))
            and (v is None or isinstance(v, bool))]


def _hash_fields(row: dict) -> list[str]:
    return [k for k, v in row.items() if (k == "hash" or k.endswith("_hash")) and isinstance(v, str)]


def row_changes(name: str, what: str, b: dict, p: dict, key: dict | None = None) -> list[dict]:
    """Changes between two matched rows: each hash-like field (``hash``, ``*_hash``) that moved (kind "hash") and
    each equality flag (``equals_oracle``, ``equal``, ``*_equal``; True, False or None) that flipped (kind "flag").
    A field BASE's row does not record is a check PR added, not a change (match lists it under ``not_judged``); one
    PR's row drops is a change."""
    extra = {"key": key} if key else {}
    out = [_change(name, what, f, b.get(f), p.get(f), kind="hash", **extra)
           for f in dict.fromkeys(_hash_fields(b) + _hash_fields(p)) if f in b and b.get(f) != p.get(f)]
    out += [_change(name, what, f, b.get(f), p.get(f), kind="flag", **extra)
            for f in dict.fromkeys(_flag_fields(b) + _flag_fields(p)) if f in b and b.get(f) != p.get(f)]
    return out


def _added_checks(name: str, pairs: list) -> list[dict]:
    """``not_judged`` entries, one per row and field, for the hash and flag fields a PR row records and its BASE row
    does not."""
    return [{"section": name, "what": what, "field": f, "why": "recorded by PR only: a check BASE did not make"}
            for what, b, p in pairs for f in dict.fromkeys(_hash_fields(p) + _flag_fields(p)) if f not in b]


# ----------------------------------------------------------------------------------------------------- sections

def configuration(row: dict) -> str:
    """A hash row's configuration: the engine's own name for it, or for our engine kernels, path@step, +offload."""
    if row.get("config"):
        return str(row["config"])
    step = f"@{row['step']}" if row.get("step") is not None else ""
    return f"{row.get('kernels')} {row.get('path')}{step}" + (" +offload" if row.get("offload") else "")


def identities(obj: dict) -> dict[str, dict]:
    """Engine label -> identity of a section's ``engines`` (a list of identities with ``spec``, or a mapping)."""
    found = obj.get("engines") or {}
    if isinstance(found, list):
        return {str(e.get("spec")): e for e in found if isinstance(e, dict)}
    return found if isinstance(found, dict) else {}


def _engine_check(b_obj: dict, p_obj: dict):
    """Per row: why its engine cannot be compared (its identity differs beyond ENGINE_SOFTWARE: another model,
    dtype, device...), or None."""
    b_id, p_id = identities(b_obj), identities(p_obj)

    def why(row: dict) -> str | None:
        e = str(_get(row, "engine"))
        if e not in b_id or e not in p_id:
            return None
        keys = [k for k in dict.fromkeys([*b_id[e], *p_id[e]])
                if k not in ENGINE_SOFTWARE and b_id[e].get(k) != p_id[e].get(k)]
        return f"engine {e} differs in {', '.join(keys)}" if keys else None
    return why


def _engine_context(b_obj: dict, p_obj: dict) -> list[dict]:
    """Software of an engine present in both that differs (versions, configuration settings): for reading."""
    b_id, p_id = identities(b_obj), identities(p_obj)
    return [{"what": f"engine {e}: {k}", "base": b_id[e].get(k), "pr": p_id[e].get(k)} for e in b_id if e in p_id
            for k in ENGINE_SOFTWARE if b_id[e].get(k) != p_id[e].get(k)]


def diff_hashes(result: dict, b: dict, p: dict, receipts=(), name: str = "hashes") -> None:
    """Moved token hashes and flipped oracle equalities of the ``hashes`` section's rows (one per engine, prompt and
    configuration) and of the engines' stream rows. A matrix of our engine and one of engines under test are not
    compared (their configurations are named differently: kernels path@step vs the engine's own names)."""
    kinds = ["engines under test" if isinstance(x.get("engines"), list) else "our engine" for x in (b, p)]
    if kinds[0] != kinds[1]:
        result["not_comparable"].append({"section": name, "what": "the whole section",
                                         "why": f"BASE ran on {kinds[0]}, PR on {kinds[1]}"})
        return

    def label(r):
        return f"{_get(r, 'engine')} · {r.get('prompt')} · {configuration(r)}"
    for what, rb, rp in match(result, name, b.get("rows"), p.get("rows"), HASH_KEY, label, HASH_SAME,
                              _engine_check(b, p)):
        key = {"engine": _get(rb, "engine"), "prompt": rb.get("prompt"), "configuration": configuration(rb)}
        result["changes"] += row_changes(name, what, rb, rp, key)
    result["context"] += _engine_context(b, p)
    bs, ps = b.get("streams") or {}, p.get("streams") or {}
    for e in (e for e in bs if e in ps and isinstance(bs[e], dict)):   # run on engines: label -> checks
        rows = lambda s: [r for part in ("drafted", "resumed", "concurrent") for r in s.get(part) or []]  # noqa
        for what, rb, rp in match(result, name, rows(bs[e]), rows(ps[e]), ENGINE_STREAM_KEY,
                                  lambda r, e=e: f"{e} · {r.get('check')} · {r.get('prompt')} · {r.get('config')}"):
            result["changes"] += row_changes(name, what, rb, rp)
    if b.get("bench") and p.get("bench"):
        result["not_judged"].append({"section": name, "what": "engine bench", "field": "every figure",
                                     "why": "one cold and one warm request per configuration: no run-to-run spread"})


def diff_contract(result: dict, b: dict, p: dict, receipts=()) -> None:
    """Contract pairs (resident and offloaded weights) whose mismatch count changed."""
    why = _differs(b, p, CONTRACT_SAME)
    if why:
        result["not_comparable"].append({"section": "contract", "what": "every pair", "why": why})
        return

    def label(r):
        off = " (offloaded weights)" if _get(r, "weights") != "resident" else ""
        return f"{r.get('set')} {r.get('class')} {r.get('dtype')} {r.get('device')}{off}"
    rows = lambda o: list(o.get("rows") or []) + list(o.get("offload_rows") or [])  # noqa: E731
    for what, rb, rp in match(result, "contract", rows(b), rows(p), CONTRACT_KEY, label):
        if rb.get("mismatches") != rp.get("mismatches"):
            result["changes"].append(_change("contract", what, "mismatches", rb.get("mismatches"),
                                             rp.get("mismatches"), kind="count",
                                             cases=[rb.get("cases"), rp.get("cases")]))


def diff_fp64(result: dict, b: dict, p: dict, receipts=()) -> None:
    """FP64 rows whose verdict changed (with bound_use of both, for reading)."""
    def label(r):
        return f"{r.get('set')} {r.get('class')} {r.get('path')} {r.get('dtype')} {r.get('input_set')} K={r.get('K')}"
    for what, rb, rp in match(result, "fp64", b.get("rows"), p.get("rows"), FP64_KEY, label):
        if rb.get("verdict") != rp.get("verdict"):
            result["changes"].append(_change("fp64", what, "verdict", rb.get("verdict"), rp.get("verdict"),
                                             kind="verdict", bound_use=[rb.get("bound_use"), rp.get("bound_use")]))


def diff_streams(result: dict, b: dict, p: dict, receipts=()) -> None:
    """Drafted, resumed and concurrent rows whose hashes or equality flags changed."""
    bd, pd = b.get("data") or {}, p.get("data") or {}
    for part, key in STREAM_KEYS.items():
        def label(r, part=part, key=key):
            return f"{part} · " + " ".join(f"{f}={r.get(f)}" for f in key if r.get(f) is not None)
        for what, rb, rp in match(result, "streams", bd.get(part), pd.get(part), key, label, STREAM_SAME):
            result["changes"] += row_changes("streams", what, rb, rp)


def diff_rows(result: dict, name: str, b: dict, p: dict, key: tuple[str, ...]) -> None:
    """A section without a comparison of its own (sections.Section.diff_keys): its ``rows`` matched by ``key``,
    hash-like fields that moved and equality flags that flipped (row_changes)."""
    def label(r):
        return " · ".join(f"{f}={_get(r, f)}" for f in key)
    for what, rb, rp in match(result, name, b.get("rows"), p.get("rows"), key, label):
        result["changes"] += row_changes(name, what, rb, rp)


def compare_section(result: dict, name: str, b: dict, p: dict, receipts: tuple[dict, dict]) -> None:
    """Compare two objects of section ``name`` into ``result``: the table's comparison (Section.diff), else its
    rows by Section.diff_keys, else the section is listed as not compared."""
    s = SECTIONS.get(name)
    fn = s.comparison() if s else None
    if fn is not None:
        fn(result, b, p, receipts)
    elif s is not None and s.diff_keys:
        diff_rows(result, name, b, p, s.diff_keys)
    else:
        result["not_comparable"].append({"section": name, "what": "the whole section",
                                         "why": "the diff has no comparison for this section"})


# ------------------------------------------------------------------------------------------------------ receipts

def _context(base: dict, pr: dict) -> list[dict]:
    """What differs besides the rows, for reading: status, commit, device, torch, and every parameter."""
    env = lambda r, k: (r.get("env") or {}).get(k)  # noqa: E731
    out = [{"what": "status", "base": base.get("status"), "pr": pr.get("status")},
           {"what": "commit", "base": ((base.get("env") or {}).get("git") or {}).get("sha"),
            "pr": ((pr.get("env") or {}).get("git") or {}).get("sha")},
           *[{"what": k, "base": env(base, k), "pr": env(pr, k)} for k in ("device", "torch")]]
    bp, pp = base.get("parameters") or {}, pr.get("parameters") or {}
    out += [{"what": f"parameter {k}", "base": bp.get(k), "pr": pp.get(k)} for k in dict.fromkeys([*bp, *pp])]
    return [c for c in out if c["base"] != c["pr"]]


def diff_receipts(base: dict, pr: dict, base_name: str = "BASE", pr_name: str = "PR") -> dict:
    """The diff of two receipts (dicts as in receipt.json), JSON-ready.

    Returns:
        {"base", "pr": the names given, "profile": [BASE's, PR's], "changes": [{section, what, field, base, pr,
        kind: hash|flag|count|verdict|figure, ...}], "only_base" / "only_pr": [{section, what}], "not_comparable":
        [{section, what, why}], "not_judged": [{section, what, field, why}] (bench figures without a spread),
        "within_spread": count of bench figures judged and not moved, "compared": {section: row pairs compared},
        "context": [{what, base, pr}] (status, commit, device, parameters that differ), "moved": bool}.
    """
    result = {"base": base_name, "pr": pr_name, "profile": [base.get("profile"), pr.get("profile")], "changes": [],
              "only_base": [], "only_pr": [], "not_comparable": [], "not_judged": [], "within_spread": 0,
              "compared": {}, "context": _context(base, pr)}
    wb, wp = weights_of(base), weights_of(pr)
    why = (f"profile {base.get('profile')!r} vs {pr.get('profile')!r}" if base.get("profile") != pr.get("profile")
           else _differs(wb, wp, list(wb)) and f"weights differ: {_differs(wb, wp, list(wb))}")
    stored = [n for r in (base, pr) if isinstance(r.get("sections"), dict) for n in r["sections"]]
    for name in dict.fromkeys([*SECTIONS, *stored]):
        b, p = section(base, name), section(pr, name)
        if b is None and p is None:
            continue
        if why:
            result["not_comparable"].append({"section": name, "what": "the whole section", "why": why})
        elif b is None or p is None:
            result["only_pr" if b is None else "only_base"].append({"section": name, "what": "the whole section"})
        else:
            compare_section(result, name, b, p, (base, pr))
    exact = [c for c in result["changes"] if c["section"] != "bench"]
    result["speed_moved"] = len(result["changes"]) - len(exact)
    result["moved"] = bool(exact or result["only_base"] or result["only_pr"] or result["not_comparable"])
    return result
