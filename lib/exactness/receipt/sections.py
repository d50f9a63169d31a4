"""The receipt's sections, described once, and their JSON files.

:data:`SECTIONS` is the one table of sections: its name in receipt.json, the analysis module that computes it
(``run_section(params) -> dict``), its view (``blocks(section)``: display blocks), its notebook, its parameters
class (params.py: the profile's common fields and the section's own), whether parts computed separately can be merged
and the function merging them (``(parts) -> section``), what preflight checks for it, its summary columns and how
the diff compares it. The command line, the receipt runner, preflight, the markdown renderer and the diff all read
it: a new section is its analysis module, its notebook and one entry here.

Each analysis returns one JSON-ready object ``{"section": "<name>", ...}``; notebooks write it to the path the runner
passes as ``out_json`` and may render a section computed elsewhere (``precomputed_json``, e.g. on the GPU machine).
"""
from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from ..files import write_json
from ..params import (BenchParams, Common, ContractParams, DumpsParams, Fp64Params, HashesParams, ParamError,
                     StreamsParams)


def _rows(obj: dict, *keys: str) -> list[dict]:
    """The dict rows of a section object under ``keys`` (top-level lists, or lists under ``data``), joined."""
    data = obj.get("data") if isinstance(obj.get("data"), dict) else {}
    return [r for k in keys for r in (obj.get(k) or data.get(k) or []) if isinstance(r, dict)]


@dataclass(frozen=True)
class Verdict:
    """One column of receipt.md's summary: per kernel set, n of N of a section's rows for which ``holds(row)``.

    Attributes:
        header: the column header.
        rows: the rows judged, from the section object (dict -> list of dict rows).
        holds: the check each row passes or fails.
        set_field: the row field that names its kernel set.
    """

    header: str
    rows: Callable[[dict], list[dict]]
    holds: Callable[[dict], bool]
    set_field: str = "set"


@dataclass(frozen=True)
class Section:
    """One receipt section: every fact the command line, the runner, preflight, the renderer and the diff read.

    Attributes:
        name: its key in receipt.json and its subcommand (``python -m exactness <name>``).
        module: the analysis module: ``run_section(params) -> dict`` computes the section object (``params``: the
            section's params class, or a dict it is built from).
        notebook: the notebook (``notebooks/<notebook>.ipynb``) that computes or renders it in a receipt run.
        help: one line for the command line.
        params_class: its typed parameters (params.py); :attr:`params` are the names of its own fields.
        blocks: ``module:function`` giving a section object's view as display blocks (blocks.py),
            ``(section: dict) -> list[Block]``: its notebook shows them, receipt.md writes them (:meth:`renderer`);
            "" is the analysis module's ``blocks``.
        mergeable: parts computed in separate calls (one kernel set each) join with :attr:`merge`.
        merge: ``module:function`` joining those parts, ``(parts: list[dict]) -> dict``; "" is the analysis
            module's ``merge_sections``.
        runs_on: the kinds of run that compute it: ``reference`` (our engine's kernels: a plain receipt run),
            ``engines`` or ``dumps``; a receipt run given the parameter ``selected_by`` names is of the other kind
            (:attr:`selected_kind`) and runs the sections of that kind only.
        selected_by: the parameter whose value makes a receipt run of :attr:`selected_kind` ("" for a section that
            runs on ``reference`` only).
        from_dumps: ``module:function`` computing this section's check from a dump folder (the subcommand's
            ``--dumps DIR``), or "".
        timed: it reports speed, so a receipt run gives it the machine alone (profiles.Profile.side_by_side lets
            the other sections share it).
        takes_checkpoint: it computes on a ``checkpoint`` when given one (its params class has that field); the
            others draw synthetic inputs from the preset, so a run naming a checkpoint must leave them out.
        generated_by: the parameters giving the tokens it generates after each prompt, the first one set winning
            (empty: it generates none); prompt + generated tokens must fit the model's ``max_positions``
            (preflight.check_lengths).
        cut_by: the parameters giving its prompt cut (tokens), the first one set winning.
        reads_prompts: it feeds the run's prompts to our model, so their token ids must fit its vocabulary.
        summary: its columns in receipt.md's summary (one verdict per kernel set).
        diff: ``module:function`` comparing two of its objects, ``(result, base, pr, receipts) -> None``
            (diff.py's contract); "" compares the rows under ``rows`` matched by ``diff_keys``.
        diff_keys: the fields that name a row for the generic comparison (hash-like fields and equality flags
            compared); empty with no ``diff``: the diff lists the section as not compared.
    """

    name: str
    module: str
    notebook: str
    help: str
    params_class: type[Common] = Common
    blocks: str = ""
    mergeable: bool = False
    merge: str = ""
    runs_on: tuple[str, ...] = ("reference",)
    selected_by: str = ""
    from_dumps: str = ""
    timed: bool = False
    takes_checkpoint: bool = False
    generated_by: tuple[str, ...] = ()
    cut_by: tuple[str, ...] = ("prompt_max_tokens",)
    reads_prompts: bool = False
    summary: tuple[Verdict, ...] = ()
    diff: str = ""
    diff_keys: tuple[str, ...] = ()

    @property
    def selected_kind(self) -> str:
        """The kind of run its :attr:`selected_by` parameter makes ("" for none)."""
        return next((k for k in self.runs_on if k != "reference"), "") if self.selected_by else ""

    def on_reference(self, params: dict) -> bool:
        """Whether it computes on our engine with ``params``: it runs on ``reference`` and ``params`` leave its
        :attr:`selected_by` parameter unset."""
        return "reference" in self.runs_on and not (self.selected_by and params.get(self.selected_by))

    @property
    def params(self) -> tuple[str, ...]:
        """Parameter names it takes beyond the profile's fields: the fields of its params class."""
        return self.params_class.own_names()

    def load(self) -> ModuleType:
        """The analysis module (imported on first use: analyses import this module)."""
        return importlib.import_module(self.module)

    def typed(self, values: dict) -> Common:
        """Its typed parameters from ``values`` (a notebook's ``params``, or the profile's merged with overrides):
        the params class's defaults fill what ``values`` lacks (params.Common.from_dict).

        Raises:
            params.ParamError: a bad value, or a name no section takes.
        """
        return self.params_class.from_dict(values)

    def view(self) -> Callable[[dict], list]:
        """The function :attr:`blocks` names, or the analysis module's ``blocks``."""
        return _function(self.blocks) if self.blocks else self.load().blocks

    def renderer(self) -> Callable[[dict], str]:
        """receipt.md's text of a section object: its :meth:`view` as markdown (blocks.to_markdown)."""
        from ..blocks import to_markdown

        view = self.view()
        return lambda section: to_markdown(view(section))

    def merger(self) -> Callable[[list[dict]], dict] | None:
        """The function :attr:`merge` names, or the analysis module's ``merge_sections``; None if not
        :attr:`mergeable`."""
        if not self.mergeable:
            return None
        return _function(self.merge) if self.merge else self.load().merge_sections

    def comparison(self) -> Callable | None:
        """The function :attr:`diff` names, or None."""
        return _function(self.diff) if self.diff else None


def _function(ref: str) -> Callable:
    """The function ``ref`` = ``package.module:function`` names (imported on first use)."""
    module, _, fn = ref.partition(":")
    return getattr(importlib.import_module(module), fn)


_HASH_RUNS = lambda o: [r for r in _rows(o, "rows") if r.get("path") != "decode"]  # noqa: E731  (decode: the oracle)
_STREAM_ROWS = lambda o: _rows(o, "drafted", "resumed", "concurrent", "packed")  # noqa: E731

SECTIONS: dict[str, Section] = {s.name: s for s in (
    Section("hashes", "exactness.analysis.hashes", "10_output_hashes",
            "hash matrix: every engine x configuration x prompt against its oracle (--param engine=[...]: the "
            "engines named) -> section JSON", HashesParams, blocks="exactness.analysis.hashes_report:blocks",
            runs_on=("reference", "engines"), selected_by="engine", takes_checkpoint=True,
            generated_by=("gen_tokens",),
            cut_by=("hash_max_tokens", "prompt_max_tokens"), reads_prompts=True,
            summary=(Verdict("runs with the oracle's tokens", _HASH_RUNS, lambda r: r.get("equals_oracle"), "kernels"),
                     Verdict("runs with the oracle's prompt-logit + KV bytes", _HASH_RUNS,
                             lambda r: r.get("prompt_logits_equal") and r.get("kv_equal"), "kernels")),
            diff="exactness.receipt.diff:diff_hashes"),
    Section("contract", "exactness.analysis.contract.check", "20_kernel_contract",
            "kernel contract: prompt rows vs decode bytes for every pair -> section JSON", ContractParams,
            blocks="exactness.analysis.contract.report:blocks",
            mergeable=True, merge="exactness.analysis.contract.combine:merge_sections",
            from_dumps="exactness.analysis.contract.calls:contract_of_calls",
            summary=(Verdict("contract pairs byte-exact", lambda o: _rows(o, "rows", "offload_rows"),
                             lambda r: r.get("mismatches") == 0),),
            diff="exactness.receipt.diff:diff_contract"),
    Section("fp64", "exactness.analysis.fp64.section", "30_fp64_per_class",
            "FP64 per-class accumulation receipt -> section JSON", Fp64Params,
            blocks="exactness.analysis.fp64.report:blocks",
            from_dumps="exactness.analysis.fp64.calls:fp64_of_calls",
            reads_prompts=True,
            summary=(Verdict("FP64 rows outside bound", lambda o: _rows(o, "rows"),
                             lambda r: "outside" in str(r.get("verdict"))),),
            diff="exactness.receipt.diff:diff_fp64"),
    Section("streams", "exactness.analysis.streams", "40_streams",
            "drafted == plain, resumed == fresh, concurrent == alone == serial -> section JSON", StreamsParams,
            blocks="exactness.analysis.streams_report:blocks",
            takes_checkpoint=True, generated_by=("gen_tokens",), reads_prompts=True,
            summary=(Verdict("stream equalities holding", _STREAM_ROWS, lambda r: r.get("equal")),),
            diff="exactness.receipt.diff:diff_streams"),
    Section("bench", "exactness.analysis.bench", "50_bench",
            "the bench tables (TTFT, tok/s, ITL, streams, memory) -> section JSON", BenchParams,
            blocks="exactness.analysis.bench_tables:blocks", mergeable=True,
            timed=True, takes_checkpoint=True, generated_by=("bench_gen_tokens", "gen_tokens"), reads_prompts=True,
            diff="exactness.receipt.diff_bench:diff_bench"),
    Section("dumps", "exactness.analysis.dumps_section", "70_dumps",
            "kernel contract and FP64 of an engine's tensor dumps (--param dumps=DIR) -> section JSON", DumpsParams,
            runs_on=("dumps",), selected_by="dumps"),
)}


def notebook_params(name: str, params: dict) -> Common:
    """The typed parameters section ``name``'s notebook runs with, from its ``params`` mapping (what the receipt
    runner injects): the profile ``params["profile"]`` names (default profiles.DEFAULT_PROFILE) updated by
    ``params``, the section's params class filling the rest: the values ``python -m exactness <name> --profile P``
    computes with.

    Raises:
        ValueError: an unknown profile; params.ParamError: a bad value or a name no section takes.
    """
    from ..profiles import DEFAULT_PROFILE, get_profile

    if not isinstance(params, dict):
        raise ParamError(f"params must be a mapping of parameter names to values, got {params!r}")
    return SECTIONS[name].typed({**get_profile(params.get("profile") or DEFAULT_PROFILE).parameters(), **params})


def section_of(notebook: str) -> str:
    """The section name a notebook writes; a notebook outside the table (a test fixture) names its own."""
    return next((s.name for s in SECTIONS.values() if s.notebook == notebook), notebook)


def save_section(section: dict, path: str) -> None:
    """Write ``section`` as JSON to ``path`` (files.write_json); "" writes nothing. Where the fast set made CUDA
    calls in this process, the section carries what served them under "fast_cuda" (served_here).

    Raises:
        ValueError: ``section`` lacks its "section" name.
    """
    if not path:
        return
    if not isinstance(section, dict) or "section" not in section:
        raise ValueError("a section object must be a dict with a 'section' name")
    write_json(served_here(section), path)


def forget_served() -> None:
    """Forget what served the fast set's CUDA kernels so far in this process (fast_cuda.STATUS back to "untried"):
    the next section's calls try each kernel again, and its record is of its own calls."""
    mod = sys.modules.get("exactness.kernels.fast_cuda")
    if mod is not None:
        mod.STATUS.update(dict.fromkeys(mod.STATUS, "untried"))


def served_here(section: dict) -> dict:
    """``section`` with "fast_cuda" (fast_cuda.served: each of the fast set's CUDA kernels, "ok" or why its torch
    fallback served) where the fast set made CUDA calls in this process; else, or where the section carries its
    own record (computed elsewhere), ``section`` as it is."""
    mod = sys.modules.get("exactness.kernels.fast_cuda")       # never imported: the fast set ran nothing here
    served = mod.served() if mod is not None else {}
    return {**section, "fast_cuda": served} if served and "fast_cuda" not in section else section


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
