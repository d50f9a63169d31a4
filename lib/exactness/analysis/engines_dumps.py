"""From a hash-matrix row to its cause: op dumps of an in-process engine and their contract (``engine_dumps``).

After an engine's hash matrix, for each configuration whose run differs from the oracle's (``on-differ``, or every
configuration with ``always``), the engine dumps the first such prompt op by op (the engine's ``dump`` method:
llama.cpp through ggml's eval callback, dumps/llamacpp.py; transformers its ``one-forward`` configuration through
dumps/hf_hooks.py, saying why not the others: ``dump_unavailable``) into ``<root>/<engine>/<configuration>``: the
configuration's prompt calls (prompt role) against the prompt token by token (decode role). The oracle is dumped
on the same prompt into ``<root>/<engine>/<oracle>`` where the engine can (its contract shows whether the decode
role stands for the oracle: 0 differing rows when the oracle runs token by token). Each set's contract
(contract/calls.py) is kept compact: totals and the first mismatch, and the first one with byte-equal inputs (the
first op that broke).

Bounds: prompts of at most MAX_TOKENS tokens are dumped (a longer one is refused in one line: cut the prompts with
``hash_max_tokens``); every layer and position of it is written. Engines without a ``dump`` method (OpenAI-
compatible servers, our reference engine) are recorded as not able to dump, with the reason.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

from ..dumps.format import DumpError
from ..params_engines import ENGINE_DUMPS_MODES as MODES
from .contract.calls import contract_of_calls

MAX_TOKENS = 256
FIELDS = ("class", "site", "prompt_kernel", "call_rows", "row", "pos", "token", "output", "element", "ulp",
          "prompt", "decode", "inputs_equal")
CANNOT = {"reference": "our engine's kernel-level cause is the contract section (make receipts without ENGINE)",
          "openai": "a server's kernels run in another process; give its tensor dumps (make receipts DUMPS=DIR)"}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[-80:] or "engine"


def _differs(row: dict) -> bool:
    return str(row.get("verdict", "")).startswith("differs")


def _targets(engine, rows: list[dict], prompts: dict, always: bool) -> dict[str, str]:
    """{configuration: the first prompt (of ``prompts``) whose run differs from the oracle's (any with ``always``)}."""
    out = {}
    for r in rows:
        if r["config"] != engine.oracle and r["prompt"] in prompts and (always or _differs(r)):
            out.setdefault(r["config"], r["prompt"])
    return out


def compact(contract: dict) -> dict:
    """The parts of a recorded-calls contract (contract.calls.contract_of_calls) the hash matrix run on engines keeps."""
    pick = (lambda f: None if f is None else {k: f.get(k) for k in FIELDS})
    return {"totals": contract["totals"], "first_mismatch": pick(contract.get("first_mismatch")),
            "first_origin": pick(contract.get("first_origin"))}


def _dump_one(engine, config: str, prompt: str, ids, folder: Path) -> dict:
    """Dump ``config`` on ``ids`` into ``folder`` and check its contract; {config, prompt, tokens, folder, status,
    ...compact contract} or with status "refused" / "failed" and the reason."""
    rec = {"config": config, "prompt": prompt, "prompt_tokens": len(ids), "folder": str(folder)}
    why = getattr(engine, "dump_unavailable", lambda _: None)(config)
    if why:
        return {**rec, "folder": None, "status": "not available", "reason": why}
    if len(ids) > MAX_TOKENS:
        return {**rec, "status": "refused", "reason": f"prompt {prompt!r} has {len(ids)} tokens; engine_dumps dumps "
                f"at most {MAX_TOKENS} (cut the prompts: hash_max_tokens={MAX_TOKENS})"}
    try:
        engine.dump(list(ids), config, folder)
        return {**rec, "status": "dumped", **compact(contract_of_calls(folder, progress=False))}
    except (ValueError, RuntimeError, OSError, DumpError) as e:
        return {**rec, "status": "failed", "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def engine_dumps(engine, label: str, prompts: dict, rows: list[dict], mode: str) -> dict:
    """The ``engine_dumps`` record of one engine: {"mode", "folder", "configs": [per configuration], "oracle": the
    oracle's record or None, "not_available": the reason an engine cannot dump, or None, "note"}. ``rows``: this
    engine's hash rows; ``prompts``: {name: ids}."""
    out = {"mode": mode, "folder": None, "configs": [], "oracle": None, "not_available": None, "note": None}
    if not callable(getattr(engine, "dump", None)):
        out["not_available"] = CANNOT.get(engine.kind, f"the {engine.kind} engine has no op dumps")
        return out
    if not rows:
        out["note"] = "not run: the hash matrix did not run (engine_repeat_only)"
        return out
    targets = _targets(engine, rows, prompts, mode == "always")
    if not targets:
        out["note"] = ("no dumps needed: every configuration's runs equal the oracle's" if not any(map(_differs, rows))
                       else "not dumped: the differing runs are of prompts without token ids (chat messages)")
        return out
    root = Path(mode) if mode not in MODES else Path(tempfile.mkdtemp(prefix="exactness-engine-dumps-"))
    base = root / _slug(label)
    out["folder"] = str(base)
    for config, prompt in targets.items():
        out["configs"].append(_dump_one(engine, config, prompt, prompts[prompt], base / _slug(config)))
    first = next(iter(targets.values()))
    out["oracle"] = _dump_one(engine, engine.oracle, first, prompts[first], base / _slug(engine.oracle))
    return out


def run_engine_dumps(engine, label: str, prompts: dict, p, section: dict) -> None:
    """With ``p.engine_dumps`` on: section["engine_dumps"][label] = engine_dumps(...); a failed dump is also an
    error of the engine (section["errors"]), so the receipt is failed, never ok."""
    if p.engine_dumps == "off":
        return
    rows = [r for r in section["rows"] if r["engine"] == label]
    rec = engine_dumps(engine, label, {k: v for k, v in prompts.items() if isinstance(v, list)}, rows,
                       p.engine_dumps)
    section.setdefault("engine_dumps", {})[label] = rec
    for r in [*rec["configs"], *([rec["oracle"]] if rec["oracle"] else [])]:
        if r["status"] == "failed":
            section["errors"].append({"engine": label, "error": f"engine_dumps {r['config']}: {r['reason']}"})


def _op(f: dict) -> str:
    ulp = f"{f['ulp']} ULP" if f.get("ulp") is not None else "not a float ULP"
    return (f"class `{f['class']}`, site `{f['site']}` ({f.get('prompt_kernel')}), call size M = {f['call_rows']}, "
            f"position {f['pos']}, output `{f.get('output')}` element {f.get('element')}: {f.get('prompt')} vs "
            f"{f.get('decode')} ({ulp})")


def line(r: dict) -> str:
    """One markdown line of a configuration's record: the first op that broke, with byte-equal inputs."""
    head = f"- **{r['config']}** (prompt `{r['prompt']}`, {r['prompt_tokens']} tokens)"
    if r["status"] != "dumped":
        return f"{head}: {r['status']}: {r['reason']}"
    t, o, f = r["totals"], r["first_origin"], r["first_mismatch"]
    counts = f"{t['mismatches']} of {t['paired']} paired rows differ, {t['origin_mismatches']} with byte-equal inputs"
    if o:
        return f"{head}: first op that broke: {_op(o)}, inputs byte-equal; {counts}. Dump set `{r['folder']}`."
    if f:
        return f"{head}: rows differ but none with byte-equal inputs; first mismatch: {_op(f)}; {counts}."
    return f"{head}: no op broke the contract ({counts})."


def render_md(dumps: dict) -> str:
    """receipt.md's block: one line per dumped configuration (and the oracle), or why an engine was not dumped."""
    out = ["### First op that broke (engine dumps)", "",
           "Each listed configuration's prompt calls were dumped op by op against the same prompt token by token "
           "(the decode role) and compared as bytes, row by row (docs/dumps.md).", ""]
    for label, rec in dumps.items():
        out.append(f"**{label}**:")
        if rec.get("not_available"):
            out.append(f"- not available from this engine: {rec['not_available']}")
        elif rec.get("note"):
            out.append(f"- {rec['note']}; 0 rows dumped")
        out += [line(r) for r in rec.get("configs") or []]
        if rec.get("oracle"):
            out.append(line({**rec["oracle"], "config": f"{rec['oracle']['config']} (oracle)"}))
        out.append("")
    return "\n".join(out).rstrip()
