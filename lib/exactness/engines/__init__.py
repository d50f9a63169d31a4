"""Engines under test: our reference engine and adapters for the engines users ship (base.py: the protocol).

An engine is named by a spec string: ``KIND:TARGET`` or the path of a YAML engine file.

    reference                          our engine on the profile's preset or checkpoint (engines/reference.py)
    transformers:/path/to/model        a local model folder loaded by transformers (engines/hf.py)
    openai:http://127.0.0.1:8000/v1    an OpenAI-compatible server (engines/openai.py)
    llamacpp:/path/model.gguf          llama.cpp through llama-cpp-python (engines/llamacpp.py)
    my-engine.yaml                     {kind: ..., target: ..., configurations: [...], oracle: ..., ...}

A YAML engine file holds the kind, its target and the adapter's options (each adapter documents its own: e.g. the
configurations to run, launch commands of servers, the oracle's name).
"""
from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from .base import CAPABILITIES, Configuration, Engine, EngineError, Generation, NotAvailable  # noqa: F401

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
    else:
        kind, _, target = spec.partition(":")
        options = {}
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine kind {kind!r} in {spec!r}; allowed: {', '.join(ENGINE_KINDS)}")
    return kind, target, options


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
