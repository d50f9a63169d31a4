"""The receipt's sections, described once, and their JSON files.

:data:`SECTIONS` is the one table of sections: its name in receipt.json, the analysis module that computes it
(``run_section(params) -> dict``) and renders it (``render_md(section) -> str``), its notebook, its parameters class
(params.py: the profile's common fields and the section's own), and whether parts computed separately can be merged
(``merge_sections(parts)``). The command line, the receipt runner and the markdown renderer all read it.

Each analysis returns one JSON-ready object ``{"section": "<name>", ...}``; notebooks write it to the path the runner
passes as ``out_json`` and may render a section computed elsewhere (``precomputed_json``, e.g. on the GPU machine).
"""
from __future__ import annotations

import importlib
import json
import os
import tempfile
from dataclasses import dataclass
from types import ModuleType

from .params import BenchParams, Common, ContractParams, DumpsParams, Fp64Params, HashesParams, StreamsParams
from .params_engines import EnginesParams


@dataclass(frozen=True)
class Section:
    """One receipt section.

    Attributes:
        name: its key in receipt.json and its subcommand (``python -m exactness <name>``).
        module: the analysis module: ``run_section(params) -> dict`` computes the section object (``params``: the
            section's params class, or a dict it is built from),
            ``render_md(section: dict) -> str`` renders it as GitHub markdown.
        notebook: the notebook (``notebooks/<notebook>.ipynb``) that computes or renders it in a receipt run.
        help: one line for the command line.
        params_class: its typed parameters (params.py); :attr:`params` are the names of its own fields.
        mergeable: parts computed in separate calls (one kernel set each) join with ``module.merge_sections``.
        runs_on: what the section computes on: ``reference`` (our engine's kernels: a plain receipt run),
            ``engines`` (the engines named by the ``engine`` parameter) or ``dumps`` (the dump set named by
            ``dumps``); a receipt run given ``engine`` or ``dumps`` runs the sections of those kinds only.
        from_dumps: ``module:function`` computing this section's check from a dump folder (the subcommand's
            ``--dumps DIR``), or "".
        timed: it reports speed, so a receipt run gives it the machine alone (profiles.Profile.side_by_side lets
            the other sections share it).
    """

    name: str
    module: str
    notebook: str
    help: str
    params_class: type[Common] = Common
    mergeable: bool = False
    runs_on: str = "reference"
    from_dumps: str = ""
    timed: bool = False

    @property
    def params(self) -> tuple[str, ...]:
        """Parameter names it takes beyond the profile's fields: the fields of its params class."""
        return self.params_class.own_names()

    def load(self) -> ModuleType:
        """The analysis module (imported on first use: analyses import this module)."""
        return importlib.import_module(self.module)


SECTIONS: dict[str, Section] = {s.name: s for s in (
    Section("hashes", "exactness.analysis.hashes", "10_output_hashes", "token hashes of every path -> section JSON",
            HashesParams),
    Section("contract", "exactness.analysis.contract.check", "20_kernel_contract",
            "kernel contract: prompt rows vs decode bytes for every pair -> section JSON", ContractParams,
            mergeable=True, from_dumps="exactness.dumps:dump_contract"),
    Section("fp64", "exactness.analysis.fp64.section", "30_fp64_per_class",
            "FP64 per-class accumulation receipt -> section JSON", Fp64Params, from_dumps="exactness.dumps:dump_fp64"),
    Section("streams", "exactness.analysis.streams", "40_streams",
            "drafted == plain, resumed == fresh, concurrent == alone == serial -> section JSON", StreamsParams),
    Section("bench", "exactness.analysis.bench", "50_bench",
            "the bench tables (TTFT, tok/s, ITL, streams, memory) -> section JSON", BenchParams, mergeable=True,
            timed=True),
    Section("engines", "exactness.analysis.engines", "60_engines",
            "engines under test (--param engine=[...]): hash matrix, stream equalities -> section JSON",
            EnginesParams, runs_on="engines", timed=True),
    Section("dumps", "exactness.dumps.section", "70_dumps",
            "kernel contract and FP64 of an engine's tensor dumps (--param dumps=DIR) -> section JSON", DumpsParams,
            runs_on="dumps"),
)}


def section_of(notebook: str) -> str:
    """The section name a notebook writes; a notebook outside the table (a test fixture) names its own."""
    return next((s.name for s in SECTIONS.values() if s.notebook == notebook), notebook)


def write_json(obj, path: str) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically: a hidden temporary file beside it, renamed into place,
    so a reader never sees half a file (values JSON cannot hold are written as their ``str``)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(obj, indent=1, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save_section(section: dict, path: str) -> None:
    """Write ``section`` as JSON to ``path`` (:func:`write_json`); "" writes nothing.

    Raises:
        ValueError: ``section`` lacks its "section" name.
    """
    if not path:
        return
    if not isinstance(section, dict) or "section" not in section:
        raise ValueError("a section object must be a dict with a 'section' name")
    write_json(section, path)


def load_section(path: str, name: str) -> dict:
    """Read a section JSON written by save_section (or by ``python -m exactness <name> --out``).

    Raises:
        ValueError: the file holds another section than ``name``.
    """
    with open(path) as fh:
        section = json.load(fh)
    if section.get("section") != name:
        raise ValueError(f"{path} holds section {section.get('section')!r}, expected {name!r}")
    return section


PROVENANCE_FIELDS = ("computed_on", "commit", "command", "notes")


def join_provenance(parts: list[dict]) -> dict | None:
    """The ``provenance`` records of section parts computed in separate calls, joined field by field (" | " between
    distinct values, in part order); None when no part carries one. Used by the merges of per-call sections."""
    provs = [q["provenance"] for q in parts if isinstance(q.get("provenance"), dict)]
    if not provs:
        return None
    return {k: " | ".join(dict.fromkeys(str(p.get(k)) for p in provs if p.get(k) is not None))
            for k in PROVENANCE_FIELDS}
