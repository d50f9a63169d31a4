"""Checks that a run can run, made before anything runs: the checkpoint folder (it exists and its config.json
parses), that every section of the run takes the checkpoint it is given, that prompt + generated tokens and the
bench's cold-prefill lengths fit the model's ``max_positions``, that each kernel set named by reference runs on
tiny inputs, and that a commit stated for the record (EXACTNESS_GIT_SHA) is a full one; and that the engines under
test can be opened.

The receipt runner (``receipt.plan_parameters``) and the per-section command line (``cli.section_parameters``)
call :func:`check_run`, and :func:`probe_engines` where engines will run (each engine's model file header or
server answer); each check raises :class:`PreflightError` with one line naming the value and the limit.
"""
from __future__ import annotations

from ..config import ModelConfig, get_preset
from ..params import Common, ParamError
from .sections import SECTIONS


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
    takes = [n for n, s in SECTIONS.items() if s.takes_checkpoint]
    other = [s for s in sections if s not in takes]
    if other:
        raise PreflightError(
            f"checkpoint={params['checkpoint']!r} is given, but section(s) {', '.join(other)} compute on the "
            f"preset's synthetic weights, not on a checkpoint; run only sections that take it: "
            f"SECTIONS={','.join(s for s in sections if s in takes) or ','.join(takes)}")


def _first_set(params: dict, keys: tuple[str, ...]):
    """The value of the first of ``keys`` set (not None, not 0) in ``params``, else None."""
    return next((params[k] for k in keys if params.get(k)), None)


def check_lengths(params: dict, cfg: ModelConfig, tokenizer, model: str, sections: list[str]) -> None:
    """Refuse prompt + generated tokens past ``cfg.max_positions`` for the sections that generate
    (sections.Section.generated_by; prompts cut as Section.cut_by says; prompt files included), an ids prompt
    holding an id outside ``cfg.vocab_size`` (sections that read the prompts: Section.reads_prompts), and a
    section's own lengths (its params' ``check_lengths``: the bench's cold-prefill lengths).

    Raises:
        PreflightError: naming the prompt or length, the token counts, the limit and what would fit.
    """
    from ..prompt_files import PromptFileError, build_source, check_vocab, resolve

    limit = cfg.max_positions
    sources = resolve(params["prompts"]) if params.get("prompts") else []   # well formed: checked with the others
    known = [SECTIONS[s] for s in sections if s in SECTIONS and SECTIONS[s].on_reference(params)]
    try:   # a section run on engines checks each engine's own vocabulary when it opens
        if any(s.reads_prompts for s in known):
            check_vocab(sources, cfg.vocab_size, model)
    except PromptFileError as e:
        raise PreflightError(str(e)) from None
    for section in (s for s in known if s.generated_by):
        gen, cut = _first_set(params, section.generated_by), _first_set(params, section.cut_by)
        sizes = {s.name: build_source(s, cut, True, tokenizer).n_tokens for s in sources} if gen else {}
        for name, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:1]:   # the longest prompt binds
            if n + gen > limit:
                raise PreflightError(
                    f"{section.name}: prompt {name!r} has {n} tokens; with {gen} generated that is {n + gen} "
                    f"positions, past the max_positions={limit} of {model}; at most {max(limit - n, 0)} generated "
                    f"tokens fit, or cut the prompts with prompt_max_tokens")
        if section.params_class.check_lengths is not Common.check_lengths:   # a length of its own
            try:
                section.typed(params).check_lengths(limit, model)
            except ParamError as e:
                raise PreflightError(str(e)) from None


def check_kernel_sets(params: dict) -> None:
    """Every kernel set of ``params["kernel_sets"]`` named by reference called once per kernel on tiny inputs on the
    run's device (analysis.contract.validate.validate_sets).

    Raises:
        PreflightError: ``parameter kernel_sets: 'REF' is not allowed: kernel set ..., class ..., <role> kernel
            ...``, one line.
    """
    from ..analysis.contract.validate import validate_sets

    try:
        validate_sets(params)
    except ValueError as e:
        raise PreflightError(str(e)) from None


def probe_engines(params: dict, sections: list[str]) -> None:
    """For a run of the hash matrix given ``engine``: every engine spec of ``params["engine"]`` probed (engines.probe:
    a GGUF header, a model folder's config and weight headers, each given server's /v1/models and one greedy token).
    Not part of :func:`check_run`: a receipt rendered from precomputed sections runs no engine.

    Raises:
        PreflightError: ``engine 'SPEC': what failed``, one line.
    """
    if not any(s in SECTIONS and SECTIONS[s].selected_by == "engine" for s in sections):
        return
    from ..engines import probe

    specs = params.get("engine") or []
    for spec in specs.split() if isinstance(specs, str) else specs if isinstance(specs, list) else []:
        try:
            probe(spec)
        except ValueError as e:
            raise PreflightError(str(e)) from None


def check_stated_commit(environ=None) -> None:
    """The commit a caller states for a tree git cannot see (env.stated_commit_problem). ``environ``: the variables
    (default os.environ).

    Raises:
        PreflightError: a value the record cannot hold (one line).
    """
    import os

    from .env import stated_commit_problem
    problem = stated_commit_problem(os.environ if environ is None else environ)
    if problem:
        raise PreflightError(problem)


def check_run(params: dict, sections: list[str]) -> None:
    """Every check of this module for a run of ``sections`` with ``params`` (run after the type and value checks of
    the common fields).

    Raises:
        PreflightError: the first failed check, one line.
    """
    check_stated_commit()
    if params.get("checkpoint") or params.get("preset"):   # no model named: nothing to measure lengths against
        cfg, tokenizer, model = model_config(params)       # a missing or broken checkpoint is named first
        check_checkpoint_sections(params, sections)
        check_lengths(params, cfg, tokenizer, model, sections)
    else:
        check_checkpoint_sections(params, sections)
    check_kernel_sets(params)
