"""Engines under test: our reference engine and adapters for the engines users ship (base.py: the protocol).

An engine is named by a spec string: ``KIND:TARGET`` or the path of a YAML engine file.

    reference                          our engine on the profile's preset or checkpoint (engines/reference.py)
    transformers:/path/to/model        a local model folder loaded by transformers (engines/hf.py)
    openai:http://127.0.0.1:8000/v1    an OpenAI-compatible server (engines/openai.py)
    llamacpp:/path/model.gguf          llama.cpp through llama-cpp-python (engines/llamacpp.py)
    my-engine.yaml                     {kind: ..., target: ..., configurations: [...], oracle: ..., ...}

A YAML engine file holds the kind, its target and the adapter's options (each adapter documents its own: e.g. the
configurations to run, launch commands of servers, the oracle's name). Relative paths in it are the file's: a
relative target is taken from the file's folder, and launch commands run there. ``parse_spec`` checks a spec's form and
``probe`` what it names (a model file's header, a server's answer), both before anything runs.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from .base import CAPABILITIES, Configuration, Engine, EngineError, NotAvailable

# the package's public names
__all__ = ["CAPABILITIES", "ENGINE_KINDS", "Configuration", "Engine", "EngineError", "NotAvailable", "open_engine",
           "parse_spec", "probe"]

# kind -> "module:class"; each class has ``from_spec(target: str, options: dict) -> Engine``.
ENGINE_KINDS = {
    "reference": "exactness.engines.reference:ReferenceEngine",
    "transformers": "exactness.engines.hf:TransformersEngine",
    "openai": "exactness.engines.openai:OpenAIEngine",
    "llamacpp": "exactness.engines.llamacpp:LlamaCppEngine",
}


def parse_spec(spec: str) -> tuple[str, str, dict]:
    """``spec`` -> (kind, target, options from the YAML file or {}).

    Raises:
        ValueError: an unknown kind, a YAML file without ``kind`` or with unknown top-level keys' types; the
            message names the value and the allowed kinds.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"engine must be a non-empty string, got {spec!r}; allowed: "
                         f"{', '.join(ENGINE_KINDS)} as KIND[:TARGET], or a YAML engine file")
    if spec.endswith((".yaml", ".yml")):
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"engine file {spec!r} does not exist")
        options = yaml.safe_load(path.read_text()) or {}
        if not isinstance(options, dict) or "kind" not in options:
            raise ValueError(f"engine file {spec!r} must be a mapping with a 'kind' ({', '.join(ENGINE_KINDS)})")
        kind, target = options.pop("kind"), str(options.pop("target", ""))
        # paths in an engine file are the file's: a model target, and the folder its launch commands run in
        folder = path.resolve().parent
        if target and kind != "openai" and not Path(target).is_absolute():
            target = str(folder / target)
        if kind == "openai":
            options.setdefault("cwd", str(folder))
    else:
        kind, _, target = spec.partition(":")
        options = {}
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine kind {kind!r} in {spec!r}; allowed: {', '.join(ENGINE_KINDS)}")
    check_target(kind, target, options, spec)
    return kind, target, options


def _magic(path: Path) -> bytes:
    with path.open("rb") as fh:
        return fh.read(4)


def check_target(kind: str, target: str, options: dict, spec: str) -> None:
    """Refuse, before anything runs, a target the engine could not open: a model folder without config.json
    (reference with a checkpoint, transformers), a file that is not GGUF (llamacpp), a URL that is not http(s)
    (openai without configurations in its YAML file).

    Raises:
        ValueError: naming the spec, the target and what is allowed.
    """
    path = Path(target) if target else None
    if kind in ("reference", "transformers") and (target or kind == "transformers"):
        if path is None or not (path / "config.json").is_file():
            raise ValueError(f"engine {spec!r}: {target or '(no folder)'} is not a model folder (no config.json); "
                             f"allowed: {kind}:/path/to/model_folder")
    elif kind == "llamacpp":
        if path is None or not path.is_file() or _magic(path) != b"GGUF":
            raise ValueError(f"engine {spec!r}: {target or '(no file)'} is not a GGUF file; allowed: "
                             "llamacpp:/path/model.gguf (python -m exactness tiny-model DIR --gguf FILE writes one)")
    elif kind == "openai" and not options.get("configurations") and not target.startswith(("http://", "https://")):
        raise ValueError(f"engine {spec!r}: {target or '(no URL)'} is not a base URL; allowed: "
                         "openai:http://host:port/v1, or a YAML engine file with configurations")


def probe(spec: str, timeout_s: float | None = None) -> None:
    """Check, before anything runs, that what ``spec`` names can be opened and answers (engines/probes.py): a GGUF
    file's header and tensor index, a model folder's config.json and weight headers, each given server's
    /v1/models and one greedy streamed token (``timeout_s`` per request, default probes.PROBE_TIMEOUT_S).

    Raises:
        ValueError: one line, ``engine 'SPEC': what failed`` (a bad spec as parse_spec).
    """
    from .probes import PROBE_TIMEOUT_S, probe_target

    kind, target, options = parse_spec(spec)
    try:
        probe_target(kind, target, options, timeout_s or PROBE_TIMEOUT_S)
    except (ValueError, EngineError, OSError) as e:
        why = " ".join(str(e).split())   # one line: servers' messages and launch logs carry newlines
        raise ValueError(f"engine {spec!r}: {why[:400] + ' ...' if len(why) > 400 else why}") from None


def open_engine(spec: str, **common) -> Engine:
    """The engine ``spec`` names, built by its adapter's ``from_spec(target, options)``; ``common`` (the profile's
    device, dtype, steps, kernel_sets, ...) fills options the spec does not set.

    Raises:
        ValueError: a bad spec (parse_spec) or options the adapter refuses; ImportError: the adapter's library is
            not installed (the message says how to install it).
    """
    kind, target, options = parse_spec(spec)
    module, _, name = ENGINE_KINDS[kind].partition(":")
    mod = importlib.import_module(module)
    taken = getattr(mod, "OPTIONS", None)   # an adapter refuses names it does not take; pass it only those
    common = {k: v for k, v in common.items() if taken is None or k in taken}
    return getattr(mod, name).from_spec(target, {**common, **options})
