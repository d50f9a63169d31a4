"""Typed parameters of the ``engines`` section (params.py holds the common fields and the other sections'): the
engine specs, the stream equalities and bench of each engine, the repeat test (the same request N times under load,
sent only to this machine's servers) and the first op that broke (engine_dumps)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .params import Common, ParamError, at_least, check_bool, positive_int

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


@dataclass(frozen=True, kw_only=True)
class EnginesParams(Common):
    """Engines under test (analysis/engines.py documents each parameter). ``engine`` lists engine specs
    (engines/__init__.py: ``reference``, ``transformers:/path``, ``openai:URL``, ``llamacpp:/path.gguf`` or a YAML
    engine file); the steps are each adapter's chunk sizes."""

    SECTION: ClassVar[str] = "engines"
    NEEDS: ClassVar[tuple[str, ...]] = ("device", "dtype", "prompts", "steps", "gen_tokens")

    engine: list[str] = field(default_factory=lambda: ["reference"])
    engine_max_tokens: int | None = None
    engine_streams: bool = True
    engine_bench: bool = False
    engine_cold_lengths: list[int] = field(default_factory=lambda: [256, 1024])
    engine_repeat: int = 0
    engine_repeat_concurrency: list[int] = field(default_factory=lambda: [1, 8])
    engine_repeat_prompt: str | None = None
    engine_repeat_tokens: int = 32
    engine_repeat_configs: list[str] = field(default_factory=list)
    engine_repeat_only: bool = False
    engine_dumps: str = "off"
    allow_unpinned: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        from .engines import parse_spec

        if isinstance(self.engine, str):
            object.__setattr__(self, "engine", self.engine.split())
        if not isinstance(self.engine, (list, tuple)) or not self.engine:
            raise ParamError(f"engine must be a non-empty list of engine specs, got {self.engine!r}; e.g. "
                             "[reference, 'transformers:/path/to/model', 'openai:http://127.0.0.1:8000/v1']")
        for spec in self.engine:
            try:
                parse_spec(spec)
            except ValueError as e:
                raise ParamError(str(e)) from None
        if self.engine_max_tokens is not None:
            at_least("engine_max_tokens", self.engine_max_tokens)
        check_bool("engine_streams", self.engine_streams)
        check_bool("engine_bench", self.engine_bench)
        _check_engine_dumps(self.engine_dumps)
        if not isinstance(self.engine_cold_lengths, (list, tuple)):
            raise ParamError(f"engine_cold_lengths must be a list of ints (tokens), got {self.engine_cold_lengths!r}")
        for n in self.engine_cold_lengths:
            at_least("every engine_cold_lengths entry", n, 2)
        self._check_repeat()

    def _check_repeat(self) -> None:
        """The repeat test's parameters (analysis/repeat.py): N >= 0, levels and tokens positive, a prompt of the
        run, configuration names as strings, only local servers loaded."""
        from .prompts import PROMPTS
        at_least("engine_repeat", self.engine_repeat, 0)
        at_least("engine_repeat_tokens", self.engine_repeat_tokens)
        check_bool("engine_repeat_only", self.engine_repeat_only)
        levels, configs = self.engine_repeat_concurrency, self.engine_repeat_configs
        if not isinstance(levels, (list, tuple)) or not levels or not all(positive_int(c) for c in levels):
            raise ParamError(f"engine_repeat_concurrency must be a non-empty list of ints >= 1 (requests in flight), "
                             f"got {levels!r}")
        if not isinstance(configs, (list, tuple)) or not all(isinstance(c, str) and c for c in configs):
            raise ParamError(f"engine_repeat_configs must be a list of configuration names, got {configs!r}")
        name, names = self.engine_repeat_prompt, list(self.prompts or [])
        if name is not None and (not isinstance(name, str) or (all(n in PROMPTS for n in names)
                                                             and name not in names)):
            raise ParamError(f"engine_repeat_prompt {name!r} is not a prompt of this run; allowed: "
                             f"{', '.join(map(str, names))} (default: the first)")
        if self.engine_repeat_only and not self.engine_repeat:
            raise ParamError("engine_repeat_only=true needs engine_repeat >= 1 (the number of requests); got 0")
        if self.engine_repeat:
            _local_servers(list(self.engine))

    @property
    def max_tokens(self) -> int | None:
        """This section's prompt cut: engine_max_tokens, else prompt_max_tokens."""
        return self.engine_max_tokens or self.prompt_max_tokens





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
