"""Receipt runs: running the notebooks into one receipt (run folders: runfolder.py; the environment record: env.py;
a run's parameters and their checks: overrides.py).

A run executes each notebook of a profile with papermill into a hidden temporary folder beside the final one,
collects the section JSON each notebook wrote (through the lib) to its ``out_json`` parameter, assembles
``receipt.json``, renders ``receipt.md`` and ``receipt.html`` (see :mod:`exactness.receipt.render`), and renames the
temporary folder into place. A notebook that fails still yields a receipt, marked ``"status": "failed"``; so does a
section that judged its own run failed (its ``failures``: an engine error, a dropped stream, nothing compared), each
named in one console line. Engines that will run are probed before any folder is made (preflight.probe_engines).

Section JSON contract (what a notebook writes to ``out_json``): an object with ``"section": <name>``, stored in
receipt.json exactly as computed under ``receipt["sections"][<name>]``; an optional ``"failures"`` list of
``{"ename", "evalue"}`` marks the receipt failed (:func:`section_failures`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .env import REPO_ROOT, callers_import_path, environment, kernel_set_records
from .overrides import OUT_JSON, PARAMS, declared_parameters, parse_overrides, plan_parameters
from .preflight import probe_engines
from ..profiles import get_profile
from .runfolder import ReceiptError, remove_stale_temporaries, run_folder, sigterm_as_interrupt
from .sections import SECTIONS, section_of

SCHEMA = 2  # 2: sections stored as computed under receipt["sections"]
KERNEL_NAME = "exactness"
DEFAULT_NOTEBOOKS_DIR = REPO_ROOT / "notebooks"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class ReceiptRun:
    """Outcome of :func:`run_receipts`: the final run folder, ``"ok"`` or ``"failed"``, and the receipt dict."""

    folder: Path
    status: str
    receipt: dict


def _check_kernel(kernel_name: str) -> None:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(kernel_name)
    except NoSuchKernel:
        raise ReceiptError(f"Jupyter kernel {kernel_name!r} is not registered; run `make setup` (it runs python -m "
                           f"ipykernel install --sys-prefix --name {kernel_name}; with PY=another Python, it "
                           f"registers it in .deps/share/jupyter, which make puts on JUPYTER_PATH)") from None


# ------------------------------------------------------------------------------------------------------- the run

def _error_entry(nb: str, exc: BaseException) -> dict:
    """An ``errors`` item for notebook ``nb``: notebook, cell, ename, evalue, traceback (last 40 lines)."""
    tb = getattr(exc, "traceback", None)
    lines = "\n".join(tb).splitlines() if tb else None
    if lines is None:
        import traceback

        lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
    return {
        "notebook": nb,
        "cell": getattr(exc, "cell_index", None),
        "exec_count": getattr(exc, "exec_count", None),
        "ename": getattr(exc, "ename", None) or type(exc).__name__,
        "evalue": str(getattr(exc, "evalue", None) or exc),
        "traceback": [_ANSI.sub("", line) for line in lines[-40:]],
    }


def _execute(nb: str, src: Path, tmp: Path, params: dict, kernel_name: str, position: str = "") -> dict:
    """Run one notebook into ``tmp``; returns its ``notebooks`` entry (``error`` included when it failed).

    The kernel's stderr (the analyses' progress bars) is forwarded to this process's stderr as it arrives, so a
    long section shows which run it is on and its ETA; ``position`` (e.g. "2/5") prefixes the start line."""
    import papermill

    t0 = time.perf_counter()
    names = set(params) - {PARAMS} | set(params.get(PARAMS) or {})   # a section notebook's mapping, opened
    entry = {"name": nb, "file": f"{nb}.ipynb", "parameters": sorted(names)}
    print(f"[receipt] {position + ' ' if position else ''}running {nb} ...", file=sys.stderr, flush=True)
    try:
        papermill.execute_notebook(str(src), str(tmp / f"{nb}.ipynb"), parameters=params, kernel_name=kernel_name,
                                   cwd=str(src.parent), progress_bar=False, stderr_file=sys.stderr)
        entry["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 -- any failure becomes a visible receipt error
        entry["status"], entry["error"] = "failed", _error_entry(nb, exc)
    entry["seconds"] = round(time.perf_counter() - t0, 3)
    print(f"[receipt] {nb}: {entry['status']} ({entry['seconds']:.1f} s)", file=sys.stderr, flush=True)
    return entry


def add_section(sections: dict, obj: dict, notebook: str) -> None:
    """Put one section object (the contract in this module's docstring) into ``sections`` (name -> object) as is.

    Raises:
        ValueError: no ``section`` name, or a name already present.
    """
    name = obj.get("section") if isinstance(obj, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"{notebook}: section JSON must be an object with a 'section' name")
    if name in sections:
        raise ValueError(f"{notebook}: section name {name!r} is already used")
    sections[name] = obj


def _collect(tmp: Path, entries: list[dict], errors: list[dict]) -> dict:
    """Sections from every section JSON the notebooks wrote; a missing or bad one is appended to ``errors``."""
    sections: dict = {}
    for entry in entries:
        path = tmp / "sections" / f"{entry['name']}.json"
        if not path.is_file():
            if entry["status"] == "ok":
                errors.append({"notebook": entry["name"], "ename": "MissingSection",
                               "evalue": f"the notebook wrote no section JSON to sections/{path.name}"})
            continue
        try:
            add_section(sections, json.loads(path.read_text()), entry["name"])
        except ValueError as e:  # includes json.JSONDecodeError
            errors.append(_error_entry(entry["name"], e))
    return sections


def _write_outputs(receipt: dict, tmp: Path, notebook_files: list[Path]) -> None:
    """Write receipt.md, receipt.html and receipt.json (with ``summary``: the markdown summary lines that open
    receipt.md); a rendering failure marks the receipt failed."""
    from . import page, render

    try:
        receipt["summary"] = render.render_summary(receipt)
    except Exception as exc:  # noqa: BLE001 -- never lose the receipt to a renderer bug
        receipt["errors"].append(_error_entry("summary", exc))
        receipt["status"], receipt["summary"] = "failed", ""
    for name, fn in (("receipt.md", lambda: render.render_markdown(receipt)),
                     ("receipt.html", lambda: page.render_html(receipt, notebook_files))):
        try:
            text = fn()
        except Exception as exc:  # noqa: BLE001 -- never lose the receipt to a renderer bug
            receipt["errors"].append(_error_entry(name, exc))
            receipt["status"] = "failed"
            text = render.fallback_text(receipt, html=name.endswith(".html"))
        if name == "receipt.md" and receipt["summary"] and receipt["summary"] not in text:
            receipt["summary"] = render.compact_tables(receipt["summary"])   # as it stands in a compacted receipt.md
        (tmp / name).write_text(text, encoding="utf-8")
    (tmp / "receipt.json").write_text(json.dumps(receipt, indent=1, default=str) + "\n", encoding="utf-8")



def precomputed_parameters(folder: Path | str, per_nb: dict[str, dict], env: dict) -> dict:
    """Point each notebook at ``<folder>/<section>.json`` (written by ``python -m exactness <section> --out`` on
    another machine, e.g. the GPU) and return the receipt's env: the computing machine's ``env.json`` when the
    folder has one, with this machine's record under ``rendered_on``.

    Raises:
        ReceiptError: the folder or a notebook's section file is missing.
    """
    folder = Path(folder).absolute()
    missing = [f"{section_of(nb)}.json" for nb in per_nb
               if not (folder / f"{section_of(nb)}.json").is_file()]
    if not folder.is_dir() or missing:
        raise ReceiptError(f"precomputed folder {folder} lacks {', '.join(missing) or 'itself'}; "
                           f"expected one file per notebook: {', '.join(SECTIONS)} (.json)")
    for nb, params in per_nb.items():
        params["precomputed_json"] = str(folder / f"{section_of(nb)}.json")
    _check_precomputed_matches(folder, per_nb)
    if (folder / "env.json").is_file():
        computed = json.loads((folder / "env.json").read_text(encoding="utf-8"))
        return {**computed, "rendered_on": env}
    return env


def _check_precomputed_matches(folder: Path, per_nb: dict[str, dict]) -> None:
    """Refuse to render sections under a profile they were not computed with: a section that records its settings
    (``data.config``: the bench) against the profile's preset, device type and generated tokens (its typed
    parameters' ``gen_tokens``), and a CUDA profile against an env.json that saw no CUDA device.

    Raises:
        ReceiptError: naming what the folder holds and what the profile says.
    """
    given = {nb: p[PARAMS] if PARAMS in p else p for nb, p in per_nb.items()}
    want = next((p for p in given.values() if "preset" in p and "device" in p), None)
    if want is None:
        return
    dev_type = str(want["device"]).split(":")[0]
    for nb, params in given.items():
        file = folder / f"{section_of(nb)}.json"
        config = (json.loads(file.read_text(encoding="utf-8")).get("data") or {}).get("config")
        if not isinstance(config, dict) or not config:
            continue
        got = (config.get("preset"), str(config.get("device", "")).split(":")[0])
        if got != (want["preset"], dev_type):
            raise ReceiptError(f"{file} was computed with preset {got[0]!r} on {got[1]!r}, but this profile has "
                               f"preset {want['preset']!r} on {dev_type!r}; render with the profile it was "
                               f"computed with (e.g. --profile gpu)")
        gen = SECTIONS[section_of(nb)].typed(params).gen_tokens if PARAMS in per_nb[nb] else params.get("gen_tokens")
        if gen is not None and config.get("gen_tokens") not in (None, gen):
            raise ReceiptError(f"{file} was computed with {config['gen_tokens']} generated tokens, but the "
                               f"parameters say {gen}; pass the generated tokens it was computed with "
                               f"(--param bench_gen_tokens={config['gen_tokens']} for the bench)")
    env_file = folder / "env.json"
    if dev_type == "cuda" and env_file.is_file():
        if json.loads(env_file.read_text(encoding="utf-8")).get("cuda_available") is False:
            raise ReceiptError(f"{env_file} records a machine without CUDA, but this profile runs on cuda")


def run_receipts(profile: str, out: Path | str | None = None, overrides: dict | list[str] | None = None, *,
                 notebooks_dir: Path | str | None = None, notebooks: list[str] | None = None,
                 receipts_dir: Path | str | None = None, kernel_name: str = KERNEL_NAME,
                 precomputed: Path | str | None = None, sections: list[str] | None = None) -> ReceiptRun:
    """Run the notebooks of ``profile`` and write one run folder atomically.

    Args:
        profile: profile name (``profiles.PROFILES``).
        out: final run folder; default ``<receipts_dir>/<UTC time>-<git short sha>-<profile>``.
        overrides: parameter overrides, a dict or ``["key=value", ...]`` strings (see :func:`parse_overrides`).
        notebooks_dir: where the notebooks are (default: the repo's ``notebooks/``).
        notebooks: notebook names without ``.ipynb`` (default: :func:`run_notebooks`).
        receipts_dir: parent of default run folders (default: the repo's ``receipts/``).
        kernel_name: registered Jupyter kernel to run them with.
        precomputed: a folder of section JSONs computed elsewhere (see :func:`precomputed_parameters`); the
            notebooks render them instead of computing.
        sections: run only these sections (names in ``sections.SECTIONS``, run in its order); default all.

    Returns:
        :class:`ReceiptRun`; ``status`` is ``"failed"`` when any notebook, section or rendering failed, or a
        section judged its run failed (:func:`section_failures`: an engine error, nothing compared); the folder
        is still written and renamed into place, marked failed.

    Raises:
        ValueError: unknown profile; preflight.PreflightError (a ValueError): an engine whose model file or server
        fails its probe. ReceiptError: bad parameter, existing folder, missing notebook or kernel. All are raised
        before anything is written.
    """
    prof = get_profile(profile)
    if not isinstance(overrides, dict):
        overrides = parse_overrides(overrides)
    nb_dir = Path(notebooks_dir or DEFAULT_NOTEBOOKS_DIR).absolute()
    names = list(notebooks or _notebooks(prof.name, run_kinds(overrides), sections))
    if precomputed is None:   # first, before the notebooks are read: a dead server is named within seconds
        probe_engines({**prof.parameters(), **overrides}, [section_of(nb) for nb in names])
    per_nb = plan_parameters(prof.parameters(), overrides, declared_parameters(nb_dir, names))
    _check_kernel(kernel_name)
    env = environment()
    kinds = sorted(run_kinds(overrides) - {"reference"})   # an engines or dumps run is named so in its folder
    final = run_folder("-".join([profile, *kinds]), out, env, receipts_dir)
    if precomputed is not None:
        env = precomputed_parameters(precomputed, per_nb, env)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final.parent)
    with sigterm_as_interrupt():
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; a receipt folder is meant to be shared
            (tmp / "sections").mkdir()
            receipt = _run_in(tmp, prof, overrides, env, nb_dir, per_nb, kernel_name)
            if final.exists():  # os.rename would silently replace an empty directory
                raise ReceiptError(f"run folder {final} appeared during the run; nothing was written")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    for e in receipt["errors"]:   # the reason, not only the FAILED file's name
        print(_console_line(e), file=sys.stderr)
    print(f"[receipt] {receipt['status']}: {final}", file=sys.stderr, flush=True)
    return ReceiptRun(folder=final, status=receipt["status"], receipt=receipt)


def run_kinds(overrides: dict) -> set[str]:
    """What a run computes on (sections.Section.runs_on): the kinds whose parameter (Section.selected_by: the engines
    given by ``engine``, the dump set given by ``dumps``) the overrides set, else our reference engine."""
    kinds = {s.selected_kind for s in SECTIONS.values() if s.selected_by and overrides.get(s.selected_by)}
    return kinds or {"reference"}


def run_notebooks(profile: str, kinds: set[str] = frozenset({"reference"})) -> list[str]:
    """The notebooks a profile runs, in table order: the sections that run on ``kinds`` (run_kinds)."""
    get_profile(profile)
    return [s.notebook for s in SECTIONS.values() if set(s.runs_on) & set(kinds)]


def _notebooks(profile: str, kinds: set[str], sections: list[str] | None) -> list[str]:
    """The notebooks of a run (:func:`run_notebooks`), cut to ``sections`` when given.

    Raises:
        ReceiptError: an unknown section, or a section that does not run on the engines given (or the reverse).
    """
    names = run_notebooks(profile, kinds)
    if not sections:
        return list(names)
    unknown = [x for x in sections if x not in SECTIONS]
    if unknown:
        raise ReceiptError(f"unknown section(s) {', '.join(map(str, unknown))}; allowed: {', '.join(SECTIONS)}")
    other = [x for x in sections if SECTIONS[x].notebook not in names]
    if other:
        allowed = ", ".join(section_of(nb) for nb in names)
        why = ("they run our reference engine's kernels; for another engine use its tensor dumps (DUMPS=DIR)"
               if "reference" not in kinds else "it needs ENGINE=... or DUMPS=DIR")
        raise ReceiptError(f"section(s) {', '.join(other)} cannot run in this receipt: {why}; allowed: {allowed}")
    return [nb for nb in names if section_of(nb) in sections]


def _out_of_memory(entry: dict) -> str | None:
    """The error line of a notebook that failed for want of device memory (None for any other outcome)."""
    err = entry.get("error") or {}
    line = f"{err.get('ename')}: {err.get('evalue') or ''}".splitlines()[0]
    return line if entry.get("status") == "failed" and "out of memory" in line.lower() else None


def _execute_all(tmp: Path, nb_dir: Path, per_nb: dict[str, dict], kernel_name: str, side_by_side: int) -> list:
    """Every notebook's ``notebooks`` entry, in table order. With side_by_side > 1 the notebooks of untimed
    sections run that many at a time (threads waiting on their kernel processes); one that failed out of device
    memory there runs again alone (the others' memory is free then; its entry keeps the first error in
    ``retried_alone`` and that attempt's time in ``first_seconds``); then the timed ones run alone."""
    jobs = [(nb, {**p, OUT_JSON: str(tmp / "sections" / f"{nb}.json")}, f"{i}/{len(per_nb)}")
            for i, (nb, p) in enumerate(per_nb.items(), 1)]

    def run(job):
        nb, params, position = job
        return _execute(nb, nb_dir / f"{nb}.ipynb", tmp, params, kernel_name, position)

    timed = {nb for nb, _, _ in jobs if section_of(nb) in SECTIONS and SECTIONS[section_of(nb)].timed}
    shared = [j for j in jobs if j[0] not in timed] if side_by_side > 1 else []
    done = {}
    if shared:
        pool = ThreadPoolExecutor(max_workers=side_by_side)
        try:
            done = dict(zip((j[0] for j in shared), pool.map(run, shared)))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)   # an interrupt must not wait for the others
    for job in shared:
        first = _out_of_memory(done[job[0]])
        if first:
            print(f"[receipt] {job[0]} ran out of device memory side by side; running it again alone",
                  file=sys.stderr, flush=True)
            done[job[0]] = {**run(job), "retried_alone": first, "first_seconds": done[job[0]].get("seconds")}
    for job in jobs:
        if job[0] not in done:
            done[job[0]] = run(job)
    return [done[nb] for nb, _, _ in jobs]


def section_failures(sections: dict) -> list[dict]:
    """An ``errors`` item ({notebook, section, ename, evalue}) for each entry of a section's ``failures`` (what the
    section itself judged a failed run: an engine that failed, nothing compared), so the receipt is marked failed."""
    out = []
    for name, obj in sections.items():
        fails = obj.get("failures") if isinstance(obj, dict) else None
        for f in (x for x in (fails if isinstance(fails, list) else []) if isinstance(x, dict)):
            out.append({"notebook": SECTIONS[name].notebook if name in SECTIONS else None, "section": name,
                        "ename": f.get("ename"), "evalue": f.get("evalue")})
    return out


def head_and_tail(text: str, n: int = 300) -> str:
    """``text`` on one line, at most about ``n`` characters: its start and its end (where a server's log puts the
    error) joined by `` ... ``."""
    why = " ".join(text.split())
    return why if len(why) <= n else f"{why[:n // 2]} ... {why[-(n // 2):]}"


def _console_line(e: dict) -> str:
    """One console line for a receipt error: the section's failure as it is, or the notebook's error."""
    if e.get("section"):
        return f"[receipt] failed: {head_and_tail(str(e.get('evalue')))}"
    return f"[receipt] error in {e.get('notebook')}: {e.get('ename')}: {e.get('evalue')}"


def _run_in(tmp: Path, prof, overrides: dict, env: dict, nb_dir: Path, per_nb: dict[str, dict],
            kernel_name: str) -> dict:
    """Execute the notebooks into ``tmp``, assemble the receipt and write its files; returns the receipt."""
    params = {**prof.parameters(), **overrides}
    kinds = run_kinds(overrides)
    ran = {k for nb in per_nb if section_of(nb) in SECTIONS for k in SECTIONS[section_of(nb)].runs_on if k in kinds}
    env = {**env, "kernel_sets": params.get("kernel_sets") if "reference" in ran else None,
           "kernel_set_records": kernel_set_records(params.get("kernel_sets")) if "reference" in ran else None,
           "engines": params.get("engine") if "engines" in ran else None,
           "dumps": params.get("dumps") if "dumps" in ran else None}
    with callers_import_path():
        entries = _execute_all(tmp, nb_dir, per_nb, kernel_name, prof.side_by_side)
    errors = [e.pop("error") for e in entries if "error" in e]
    sections = _collect(tmp, entries, errors)
    errors += section_failures(sections)
    receipt = {"schema": SCHEMA, "status": "failed" if errors else "ok", "profile": prof.name, "runs_on": sorted(ran),
               "parameters": params, "env": env, "sections": sections, "errors": errors, "notebooks": entries,
               "side_by_side": prof.side_by_side}
    files = [tmp / e["file"] for e in entries if (tmp / e["file"]).is_file()]
    _write_outputs(receipt, tmp, files)
    if receipt["status"] != "ok":
        (tmp / "FAILED").write_text("".join(f"{e.get('notebook')}: {e.get('ename')}: {e.get('evalue')}\n"
                                            for e in receipt["errors"]), encoding="utf-8")
    return receipt
