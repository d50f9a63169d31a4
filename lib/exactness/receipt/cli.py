"""Command line: ``python -m exactness <subcommand>``.

    receipts --profile P [--out DIR] [--param key=value ...]   run the notebooks, write one receipt run folder
    sections --profile P --out DIR [--sections a,b] [--param]   compute section JSONs in one process (GPU machine)
    merge --out bench.json A.json B.json ...                    join bench (or contract) sections computed per call
    env                                                         print the environment record as JSON
    profiles                                                    list the run profiles
    diff BASE PR [--out DIR]                                    what moved between two receipts (markdown; exit 1)
    comment BASE PR [--out FILE]                                the PR comment: PR's summary + what moved (fits)
    serve [--preset tiny] [--kernels K] [--path P] [--step N]   the reference engine behind an OpenAI API (serve.py)

Exit codes: 0 ok; 1 a receipt (or a section's JSON) was written but is marked failed (a notebook failed, an engine
failed mid-run, nothing was compared); 2 bad input, an engine's model file or server refused by its probe (nothing
written).
Every subcommand is one entry of ``SUBCOMMANDS``; each section of ``sections.SECTIONS`` adds its own
(:func:`analysis_command`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# One CPU thread unless the caller chose (as the Makefile does): tiny kernels gain nothing from threads and a second
# OpenMP thread spin-waits on a busy machine. Set before torch is imported; receipts record the count.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from .env import match_onednn_isa  # noqa: E402  (imports no torch)

match_onednn_isa()  # an emulated lower instruction set caps oneDNN too (env.match_onednn_isa), before torch loads

from ..profiles import DEFAULT_PROFILE, PROFILES, get_profile  # noqa: E402
from ..files import write_json  # noqa: E402
from .sections import SECTIONS, Section, forget_served, served_here  # noqa: E402

_REFERENCE = [n for n, s in SECTIONS.items() if "reference" in s.runs_on]   # a plain receipt run's sections


@dataclass(frozen=True)
class Subcommand:
    """One subcommand: ``add_arguments(parser)`` declares its options, ``handler(args) -> exit code`` runs it."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


def _profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"one of {', '.join(PROFILES)} (default %(default)s)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override one parameter; the value is read as YAML (steps=[64,100]); repeatable")


# ------------------------------------------------------------------------------------------------------ receipts

def _receipts_args(p: argparse.ArgumentParser) -> None:
    _profile_args(p)
    p.add_argument("--out", default=None, help="run folder (must not exist); default receipts/<UTC>-<sha>-<profile>")
    p.add_argument("--precomputed", default=None, help="folder of section JSONs computed elsewhere (hashes.json, "
                   "contract.json, fp64.json, streams.json, bench.json, optional env.json): render, don't compute")
    p.add_argument("--sections", default="", help="comma-separated sections to run (default: all of "
                   f"{','.join(_REFERENCE)}; with --engine: hashes)")
    p.add_argument("--engine", nargs="+", default=None, metavar="SPEC",
                   help="engines under test (reference, transformers:/path, openai:URL, llamacpp:/path.gguf, or a "
                   "YAML engine file): runs the hash matrix on them (same as --param engine=[...])")
    p.add_argument("--dumps", default=None, metavar="DIR", help="an engine's tensor dumps (docs/dumps.md): runs the "
                   "dumps section (kernel contract and FP64 from the dumps; same as --param dumps=DIR)")


def _receipts(args: argparse.Namespace) -> int:
    from .runner import run_receipts

    params = list(args.param) + ([f"engine={json.dumps(args.engine)}"] if args.engine else []) + (
        [f"dumps={json.dumps(args.dumps)}"] if args.dumps else [])
    result = run_receipts(args.profile, args.out, params, precomputed=args.precomputed,
                          sections=[x for x in args.sections.split(",") if x] or None)
    print(result.folder)
    return 0 if result.status == "ok" else 1


# ---------------------------------------------------------------------------------------------------- env, profiles

def _env(args: argparse.Namespace) -> int:
    from .env import environment

    print(json.dumps(environment(), indent=2))
    return 0


def _profiles(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from ..tables import parameter_text

    params = {name: prof.parameters() for name, prof in PROFILES.items()}
    keys = list(dict.fromkeys(k for p in params.values() for k in p if k != "profile"))
    rows = [[k] + [parameter_text(k, p[k]) if k in p else "(section default)" for p in params.values()]
            for k in keys]
    heads = ["parameter"] + [n + (" (default)" if n == DEFAULT_PROFILE else "") for n in params]
    print(tabulate(rows, headers=heads, disable_numparse=True))
    return 0


# ------------------------------------------------------------------------------------------------------ analysis

def analysis_command(section: Section) -> Subcommand:
    """The subcommand of one section: ``--profile P [--out file.json] [--param k=v ...]`` calls the section's
    ``run_section(params)`` with its typed parameters (the profile's updated by the overrides), and writes the
    returned dict as JSON (to stdout without ``--out``; the file is replaced atomically); exit 1 when the section
    lists ``failures`` (e.g. an engine that failed), each named on stderr.

    Override names must be profile fields or the section's own parameters; otherwise exit 2 naming the allowed ones.
    """
    def add(p: argparse.ArgumentParser) -> None:
        _profile_args(p)
        p.add_argument("--out", default=None, help="JSON file to write (default: stdout)")
        if section.from_dumps:
            p.add_argument("--dumps", default=None, metavar="DIR", help="compute it from an engine's tensor dumps "
                           "(docs/dumps.md) instead of our engine's kernels")

    def run(args: argparse.Namespace) -> int:
        if getattr(args, "dumps", None):
            module, _, fn = section.from_dumps.partition(":")
            _write_json(getattr(importlib.import_module(module), fn)(args.dumps), args.out)
            return 0
        params = section_parameters(args.profile, args.param, section.params, [section.name])
        obj = section.load().run_section(section.params_class.from_dict(params))
        _write_json(obj, args.out)
        return _failed(obj, section.name)

    return Subcommand(section.help, add, run)


def _failed(obj: dict, name: str) -> int:
    """1 when the section judged its own run failed (runner.section_failures, one stderr line each), else 0."""
    from .runner import head_and_tail, section_failures

    fails = section_failures({name: obj})
    for f in fails:
        print(f"[{name}] failed: {head_and_tail(str(f['evalue']))}", file=sys.stderr)
    return 1 if fails else 0


def section_parameters(profile: str, overrides: list[str], extra_params, sections: list[str] = ()) -> dict:
    """The profile's parameters updated by ``key=value`` overrides, checked (preflight.check_run) for a run of
    ``sections``.

    Raises:
        ReceiptError: an override name that is neither a profile field nor in ``extra_params`` (lists the allowed
            ones), a value of another type than the profile's (receipt.check_override_types), or a value a
            section's typed parameters refuse (receipt.check_section_values).
        ValueError: unknown profile; preflight.PreflightError: a checkpoint or length the run cannot use, an
            engine whose model file or server fails its probe (preflight.probe_engines).
    """
    from .preflight import check_run, probe_engines
    from .overrides import check_common_values, check_override_types, check_section_values, parse_overrides
    from .runfolder import ReceiptError

    params = get_profile(profile).parameters()
    parsed = parse_overrides(overrides)
    allowed = set(params) | set(extra_params)
    for key in parsed:
        if key not in allowed:
            raise ReceiptError(f"unknown parameter {key!r}; allowed: {', '.join(sorted(allowed))}")
    check_override_types(params, parsed)
    check_common_values({**params, **parsed})
    check_section_values({**params, **parsed}, list(sections))
    check_run({**params, **parsed}, list(sections))
    probe_engines({**params, **parsed}, list(sections))
    return {**params, **parsed}


def _sections_args(p: argparse.ArgumentParser) -> None:
    _profile_args(p)
    p.add_argument("--out", required=True, help="folder for env.json and <section>.json (created; files replaced)")
    p.add_argument("--sections", default=",".join(_REFERENCE),
                   help="comma-separated, run in this order (default %(default)s)")


def _sections(args: argparse.Namespace) -> int:
    """Every asked section in one process, sharing the synthetic weights' draw; a failing section writes
    ``<section>.error.txt`` (traceback) instead of its JSON and the others still run. Exit 1 if any failed."""
    import time
    import traceback

    from ..weights import sharing_synthetic_weights
    from .env import environment
    from .runfolder import ReceiptError
    names = [n for n in args.sections.split(",") if n]
    bad = [n for n in names if n not in SECTIONS]
    if not names:
        raise ReceiptError(f"no sections given; allowed: {', '.join(SECTIONS)} (comma-separated)")
    if bad:
        raise ReceiptError(f"unknown sections {bad!r}; allowed: {', '.join(SECTIONS)}")
    params = section_parameters(args.profile, args.param, [x for n in names for x in SECTIONS[n].params], names)
    out = Path(args.out)
    env = environment()
    _write_json(env, str(out / "env.json"))
    failed = []
    with sharing_synthetic_weights():
        for name in names:
            t0 = time.perf_counter()
            forget_served()                             # each section's record is of its own calls
            try:
                section = SECTIONS[name].load().run_section(SECTIONS[name].params_class.from_dict(params))
                section["provenance"] = _provenance(env, name, args, time.perf_counter() - t0)
                _write_json(served_here(section), str(out / f"{name}.json"))
                if _failed(section, name):
                    failed.append(name)
            except Exception:  # noqa: BLE001 -- record it, go on with the next section
                (out / f"{name}.error.txt").write_text(traceback.format_exc(), encoding="utf-8")
                failed.append(name)
                print(traceback.format_exc(), file=sys.stderr)
            print(f"[sections] {name}: {'FAILED' if name in failed else 'ok'} in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    return 1 if failed else 0


def _provenance(env: dict, name: str, args: argparse.Namespace, seconds: float) -> dict:
    """The record a section computed by ``sections`` carries (receipt.md lists it): machine, commit, command."""
    git = env.get("git") or {}
    cmd = " ".join(["python -m exactness sections", f"--profile {args.profile}", f"--sections {name}",
                    *[f"--param '{p}'" for p in args.param]])
    cc = env.get("compute_capability")
    state = {True: " (dirty)", False: " (clean)"}.get(git.get("dirty"), "")
    return {"computed_on": f"{env.get('device')} ({f'capability {cc}' if cc else 'no CUDA device'}), torch "
                           f"{env.get('torch')}, triton {env.get('triton') or 'not installed'}, {env.get('time_utc')}",
            "commit": f"{git.get('sha') or 'unknown'}{state}", "command": cmd,
            "notes": f"{seconds:.1f} s"}


def _merge_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the merged section JSON to write")
    mergeable = ", ".join(s.name for s in SECTIONS.values() if s.mergeable)
    p.add_argument("parts", nargs="+", help=f"section JSONs of one kind ({mergeable}), computed in separate "
                   "calls (one kernel set or dtype each), in table order")


def _merge(args: argparse.Namespace) -> int:
    """The parts' section merger (sections.Section.merger; exit 2 with the reason when they do not merge)."""
    parts = []
    for f in args.parts:
        try:
            parts.append(json.loads(Path(f).read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:   # missing file, not JSON
            raise ValueError(f"cannot read section part {f}: {e}") from None
    names = sorted({str(q.get("section")) for q in parts if isinstance(q, dict)})
    mergeable = [s.name for s in SECTIONS.values() if s.mergeable]
    if len(names) != 1 or names[0] not in mergeable:
        raise ValueError(f"the parts hold sections {names}; merge joins parts of one section, one of "
                         f"{', '.join(mergeable)}")
    _write_json(SECTIONS[names[0]].merger()(parts), args.out)
    return 0


def _write_json(obj, out: str | None) -> None:
    """``obj`` as JSON to stdout, or to the file ``out`` (files.write_json), naming it on stderr."""
    if out is None:
        sys.stdout.write(json.dumps(obj, indent=1, default=str) + "\n")
        return
    write_json(obj, out)
    print(f"wrote {out}", file=sys.stderr)


def _diff_module():
    from . import diff_cli  # the receipt diff (BASE PR [--out DIR])

    return diff_cli


def _comment_module():
    from . import comment  # comment.py: the pull-request comment (BASE PR [--out FILE])

    return comment


def _tiny_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="new folder for the model (transformers save_pretrained layout)")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="saved dtype")
    p.add_argument("--gguf", default=None, metavar="FILE", help="also write the model as GGUF for llama.cpp")


def _tiny(args: argparse.Namespace) -> int:
    from ..engines.tiny import save_tiny_qwen3_moe

    folder = save_tiny_qwen3_moe(args.out, seed=args.seed, dtype=args.dtype)
    print(folder)
    if args.gguf:
        from ..engines.gguf_export import export_gguf
        export_gguf(str(folder), args.gguf, dtype="bf16" if args.dtype == "bfloat16" else "f32")
        print(args.gguf)
    return 0


SUBCOMMANDS: dict[str, Subcommand] = {
    "receipts": Subcommand("run the notebooks of a profile into one receipt run folder", _receipts_args, _receipts),
    "env": Subcommand("print the environment record (git, versions, device, numerics flags) as JSON",
                      lambda p: None, _env),
    "profiles": Subcommand("list the run profiles", lambda p: None, _profiles),
    "sections": Subcommand("compute several section JSONs in one process (shared weights), e.g. on the GPU machine",
                           _sections_args, _sections),
    "merge": Subcommand("join bench or contract sections computed in separate calls into one section JSON",
                        _merge_args, _merge),
    "diff": Subcommand("compare two receipts: what moved, as markdown for a pull-request comment (exit 1: moved)",
                       lambda p: _diff_module().add_arguments(p), lambda args: _diff_module().run(args)),
    "comment": Subcommand("the pull-request comment: PR's summary and what moved against BASE, under GitHub's "
                          "comment limit", lambda p: _comment_module().add_arguments(p),
                          lambda args: _comment_module().run(args)),
    "serve": Subcommand("serve our engine behind an OpenAI-compatible API (options: python -m exactness serve -h)",
                        lambda p: p.add_argument("options", nargs=argparse.REMAINDER), lambda a: 2),
    "tiny-model": Subcommand("write a tiny random Qwen3-MoE model folder (and --gguf FILE) to try the engines on",
                             _tiny_args, _tiny),
    # ---- one analysis subcommand per section of sections.SECTIONS, added below
}

SUBCOMMANDS.update({s.name: analysis_command(s) for s in SECTIONS.values()})


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with one subparser per ``SUBCOMMANDS`` entry."""
    parser = argparse.ArgumentParser(prog="python -m exactness", description="Exactness receipts of LLM inference "
                                     "paths.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_handler=cmd.handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failed receipt, 2 bad input with a message on stderr)."""
    from .runfolder import ReceiptError

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:   # the server has its own parser (serve.build_parser)
        from ..engines.serve import main as serve_main
        return serve_main(argv[1:])
    from .runfolder import sigterm_as_interrupt

    args = build_parser().parse_args(argv)
    try:   # SIGTERM as Ctrl-C: engines' finally blocks stop the servers they launched
        with sigterm_as_interrupt():
            return args._handler(args)
    except (ReceiptError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:   # Ctrl-C, or SIGTERM during a receipt run (runfolder.sigterm_as_interrupt)
        print(f"stopped: {e or 'interrupted'}; nothing was written", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)   # the shell's status for a process ended by that signal


if __name__ == "__main__":
    sys.exit(main())
