"""Checks that a run can run, made before anything runs: the checkpoint folder (it exists and its config.json
parses), that every section of the run takes the checkpoint it is given, and that prompt + generated tokens and the
bench's cold-prefill lengths fit the model's ``max_positions``; and that the engines under test can be opened.

The receipt runner (``receipt.plan_parameters``) and the per-section command line (``cli.section_parameters``)
call :func:`check_run`, and :func:`probe_engines` where engines will run (each engine's model file header or
server answer); each check raises :class:`PreflightError` with one line naming the value and the limit.
"""
from __future__ import annotations

from ..config import ModelConfig, get_preset

# Sections that compute on the checkpoint they are given. The others (the kernel contract and the FP64 receipt)
# draw their inputs from the synthetic weights of the preset, so a run that names a checkpoint must leave them out.
CHECKPOINT_SECTIONS = ("hashes", "streams", "bench")


class PreflightError(ValueError):
    """A run's parameters that cannot run; raised before anything runs or is written."""


def model_config(params: dict) -> tuple[ModelConfig, object, str]:
    """(config, tokenizer or None for the byte tokenizer, a name for messages) of the model the run would load:
    the checkpoint's config.json when ``checkpoint`` is set (no tensor is read), else the preset's.

    Raises:
        PreflightError: the checkpoint folder is missing, has no config.json, or config.json is bad (one line).
    """
    path = params.get("checkpoint") or ""
    if not path:
        return get_preset(params["preset"]), None, f"preset {params['preset']}"
    from ..checkpoint import CheckpointError, read_config, tokenizer_for

    try:
        cfg, _ = read_config(str(path))
        return cfg, tokenizer_for(str(path), cfg), f"checkpoint {path}"
    except CheckpointError as e:
        raise PreflightError(f"checkpoint={path!r}: {e}") from None


def check_checkpoint_sections(params: dict, sections: list[str]) -> None:
    """Refuse a run that names a checkpoint and includes a section that would not compute on it.

    Raises:
        PreflightError: naming the sections that do not take a checkpoint and the ones that do.
    """
    if not params.get("checkpoint"):
        return
    other = [s for s in sections if s not in CHECKPOINT_SECTIONS]
    if other:
        raise PreflightError(
            f"checkpoint={params['checkpoint']!r} is given, but section(s) {', '.join(other)} compute on the "
            f"preset's synthetic weights, not on a checkpoint; run only sections that take it: "
            f"SECTIONS={','.join(s for s in sections if s in CHECKPOINT_SECTIONS) or ','.join(CHECKPOINT_SECTIONS)}")


def check_lengths(params: dict, cfg: ModelConfig, tokenizer, model: str, sections: list[str]) -> None:
    """Refuse prompt + generated tokens past ``cfg.max_positions`` for the sections that generate (hashes,
    streams, bench; prompts cut to ``hash_max_tokens`` / ``prompt_max_tokens`` as those sections cut them; prompt
    files included), an ids prompt holding an id outside ``cfg.vocab_size``, and bench cold-prefill lengths + its
    generated tokens past it.

    Raises:
        PreflightError: naming the prompt or length, the token counts, the limit and what would fit.
    """
    from ..prompt_files import PromptFileError, build_source, check_vocab, resolve

    limit = cfg.max_positions
    sources = resolve(params["prompts"]) if params.get("prompts") else []   # well formed: checked with the others
    try:   # the engines section checks each engine's own vocabulary when it opens
        if set(sections) & {"hashes", "streams", "bench", "fp64"}:
            check_vocab(sources, cfg.vocab_size, model)
    except PromptFileError as e:
        raise PreflightError(str(e)) from None
    gens = {"hashes": params.get("gen_tokens"), "streams": params.get("gen_tokens"),
            "bench": params.get("bench_gen_tokens") or params.get("gen_tokens")}
    for section in (s for s in sections if gens.get(s) is not None):
        gen = gens[section]
        cut = (params.get("hash_max_tokens") if section == "hashes" else None) or params.get("prompt_max_tokens")
        sizes = {s.name: build_source(s, cut, True, tokenizer).n_tokens for s in sources}
        for name, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:1]:   # the longest prompt binds
            if n + gen > limit:
                raise PreflightError(
                    f"{section}: prompt {name!r} has {n} tokens; with {gen} generated that is {n + gen} positions, "
                    f"past the max_positions={limit} of {model}; at most {max(limit - n, 0)} generated tokens fit, "
                    f"or cut the prompts with prompt_max_tokens")
    if "bench" in sections:
        from .params import BenchParams, ParamError

        try:
            BenchParams.from_dict(params).check_lengths(limit, model)
        except ParamError as e:
            raise PreflightError(str(e)) from None


def probe_engines(params: dict, sections: list[str]) -> None:
    """For a run of the engines section: every engine spec of ``params["engine"]`` probed (engines.probe: a GGUF
    header, a model folder's config and weight headers, each given server's /v1/models and one greedy token).
    Not part of :func:`check_run`: a receipt rendered from precomputed sections runs no engine.

    Raises:
        PreflightError: ``engine 'SPEC': what failed``, one line.
    """
    if "engines" not in sections:
        return
    from ..engines import probe

    specs = params.get("engine") or []
    for spec in specs.split() if isinstance(specs, str) else specs if isinstance(specs, list) else []:
        try:
            probe(spec)
        except ValueError as e:
            raise PreflightError(str(e)) from None


def check_run(params: dict, sections: list[str]) -> None:
    """Every check of this module for a run of ``sections`` with ``params`` (run after the type and value checks of
    the common fields).

    Raises:
        PreflightError: the first failed check, one line.
    """
    if params.get("checkpoint") or params.get("preset"):   # no model named: nothing to measure lengths against
        cfg, tokenizer, model = model_config(params)       # a missing or broken checkpoint is named first
        check_checkpoint_sections(params, sections)
        check_lengths(params, cfg, tokenizer, model, sections)
    else:
        check_checkpoint_sections(params, sections)
