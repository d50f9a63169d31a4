"""The checks of the hash matrix's engine parameters (params.HashesParams holds the fields): the engine specs, the
stream equalities and bench of each engine, the repeat test (the same request N times under load, sent only to this
machine's servers) and the first op that broke (engine_dumps)."""
from __future__ import annotations

from .params_check import ParamError, at_least, check_bool, positive_int

ENGINE_DUMPS_MODES = ("off", "on-differ", "always")   # engine_dumps, or a folder (analysis/engines_dumps.py)


def _check_engine_dumps(value) -> None:
    """Refuse ``engine_dumps`` unless it is one of ENGINE_DUMPS_MODES or a folder: an existing one, or a path with a
    ``/`` that is not a file (so that a misspelt mode is not taken for a folder)."""
    from pathlib import Path

    folder = isinstance(value, str) and value not in ENGINE_DUMPS_MODES and value != "" and (
        Path(value).is_dir() or ("/" in value and not Path(value).is_file()))
    if not isinstance(value, str) or not (value in ENGINE_DUMPS_MODES or folder):
        raise ParamError(f"engine_dumps={value!r} is not allowed; allowed: {', '.join(ENGINE_DUMPS_MODES)}, or a "
                         "folder (a path with '/': on-differ, writing there)")


ENGINE_FIELDS = ("engine", "engine_streams", "engine_bench", "engine_cold_lengths", "engine_repeat",
                 "engine_repeat_concurrency", "engine_repeat_prompt", "engine_repeat_tokens", "engine_repeat_configs",
                 "engine_repeat_only", "engine_dumps")


def check_engine_fields(p) -> None:
    """Refuse bad engine fields of the hash matrix's parameters ``p`` (params.HashesParams): each spec of
    ``engine`` parses (engines/__init__.py; a string is split on whitespace: the caller stores the list), the stream,
    bench, dumps and repeat settings have the types and ranges analysis/hashes.py documents.

    Raises:
        ParamError: naming the bad value and what is allowed.
    """
    from .engines import parse_spec

    if not isinstance(p.engine, (list, tuple)):
        raise ParamError(f"engine must be a list of engine specs, got {p.engine!r}; e.g. "
                         "[reference, 'transformers:/path/to/model', 'openai:http://127.0.0.1:8000/v1']")
    for spec in p.engine:
        try:
            parse_spec(spec)
        except ValueError as e:
            raise ParamError(str(e)) from None
    check_bool("engine_streams", p.engine_streams)
    check_bool("engine_bench", p.engine_bench)
    _check_engine_dumps(p.engine_dumps)
    if not isinstance(p.engine_cold_lengths, (list, tuple)):
        raise ParamError(f"engine_cold_lengths must be a list of ints (tokens), got {p.engine_cold_lengths!r}")
    for n in p.engine_cold_lengths:
        at_least("every engine_cold_lengths entry", n, 2)
    _check_repeat(p)


def _check_repeat(p) -> None:
    """The repeat test's parameters (analysis/repeat.py): N >= 0, levels and tokens positive, a prompt of the run,
    configuration names as strings, only local servers loaded."""
    from .prompts import PROMPTS
    at_least("engine_repeat", p.engine_repeat, 0)
    at_least("engine_repeat_tokens", p.engine_repeat_tokens)
    check_bool("engine_repeat_only", p.engine_repeat_only)
    levels, configs = p.engine_repeat_concurrency, p.engine_repeat_configs
    if not isinstance(levels, (list, tuple)) or not levels or not all(positive_int(c) for c in levels):
        raise ParamError(f"engine_repeat_concurrency must be a non-empty list of ints >= 1 (requests in flight), "
                         f"got {levels!r}")
    if not isinstance(configs, (list, tuple)) or not all(isinstance(c, str) and c for c in configs):
        raise ParamError(f"engine_repeat_configs must be a list of configuration names, got {configs!r}")
    name, names = p.engine_repeat_prompt, list(p.prompts or [])
    if name is not None and (not isinstance(name, str) or (all(n in PROMPTS for n in names) and name not in names)):
        raise ParamError(f"engine_repeat_prompt {name!r} is not a prompt of this run; allowed: "
                         f"{', '.join(map(str, names))} (default: the first)")
    if p.engine_repeat_only and not p.engine_repeat:
        raise ParamError("engine_repeat_only=true needs engine_repeat >= 1 (the number of requests); got 0")
    if p.engine_repeat:
        _local_servers(list(p.engine))


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")   # the only hosts the repeat test sends load to


def check_local(url: str, where: str) -> None:
    """Raise ParamError unless ``url``'s host is this machine (LOCAL_HOSTS); ``where`` names the engine."""
    from urllib.parse import urlsplit
    host = urlsplit(url).hostname or ""
    if host not in LOCAL_HOSTS:
        raise ParamError(f"engine_repeat: {where} is at {url!r}: the repeat test sends load only to servers on "
                         f"this machine (hosts {', '.join(LOCAL_HOSTS)}), not to {host or 'no host'!r}")


def _local_servers(specs: list[str]) -> None:
    """check_local on every openai spec's target or configured base_url (launched servers are local)."""
    from .engines import parse_spec
    for spec in specs:
        kind, target, options = parse_spec(spec)
        confs = options.get("configurations")
        if kind == "openai":
            for url in ([c["base_url"] for c in confs if isinstance(c, dict) and c.get("base_url")] if confs
                        else [target]):
                check_local(url, f"engine {spec!r}")
