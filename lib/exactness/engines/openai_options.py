"""Options of the ``openai`` engine (engines/openai.py documents them): the configurations -> Endpoints with their
api and sampling knobs, and the checks of each value (ValueError naming the value and what is allowed)."""
from __future__ import annotations

import os

from .base import Configuration
from .openai_checks import sampling_knobs
from .openai_http import Endpoint, launch_line

OPTIONS = ("configurations", "oracle", "model", "timeout_s", "launch_timeout_s", "token_ids", "top_logprobs",
           "sampling", "api", "prompt_logprobs", "stream", "cwd")
APIS = ("completions", "chat", "auto")
PLP_MODES = ("auto", "vllm", "echo", "off")
PROBE_S = 10.0


def choice(options: dict, key: str, allowed: tuple, default: str) -> str:
    v = options.get(key, default)
    if v not in allowed:
        raise ValueError(f"openai engine: {key} must be one of {', '.join(allowed)}, got {v!r}")
    return v


def endpoints(target: str, options: dict) -> list[Endpoint]:
    """The configurations option (or the target URL alone) -> Endpoints with their api and sampling knobs.

    Raises:
        ValueError: naming a bad entry (keys, names, a launch command without {port} or with other braces).
    """
    raw, api = options.get("configurations"), choice(options, "api", APIS, "completions")
    if raw is None:
        if not target.startswith(("http://", "https://")):
            raise ValueError(f"openai engine: target must be a base URL like http://127.0.0.1:8000/v1, got "
                             f"{target!r} (or give configurations)")
        raw = [{"name": "server", "base_url": target}]
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"openai engine: configurations must be a non-empty list, got {raw!r}")
    out = []
    for c in raw:
        core = {k: v for k, v in c.items() if k not in ("api", "sampling")} if isinstance(c, dict) else None
        ok = core is not None and set(core) in ({"name", "base_url"}, {"name", "launch"})
        if not ok or not all(isinstance(v, str) and v for v in core.values()):
            raise ValueError(f"openai engine: each configuration is {{name, base_url}} or {{name, launch}} "
                             f"(non-empty strings; optionally api, sampling), got {c!r}")
        Configuration(c["name"])   # validates the name
        if "launch" in c:
            _check_launch(c["name"], c["launch"])
        knobs = sampling_knobs(options.get("sampling"), c.get("sampling"))
        settings = {**core, "sampling": knobs, **({"api": c["api"]} if "api" in c else {})}
        out.append(Endpoint(c["name"], base_url=c.get("base_url", "").rstrip("/"), launch=c.get("launch", ""),
                            settings=settings, api=choice(c, "api", APIS, api), sampling=knobs,
                            cwd=_cwd(options) if "launch" in c else None))
    names = [e.name for e in out]
    if len(set(names)) != len(names):
        raise ValueError(f"openai engine: configuration names must be unique, got {names}")
    return out


def _cwd(options: dict) -> str | None:
    """The folder launch commands run in: the ``cwd`` option (an engine file's own folder), else the caller's."""
    cwd = options.get("cwd")
    if cwd is not None and not (isinstance(cwd, str) and os.path.isdir(cwd)):
        raise ValueError(f"openai engine: cwd must be an existing folder, got {cwd!r}")
    return cwd


def _check_launch(name: str, command: str) -> None:
    if "{port}" not in command:
        raise ValueError(f"openai engine: the launch command of {name!r} must contain {{port}}, got {command!r}")
    try:
        launch_line(command, 0)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"openai engine: the launch command of {name!r} may use {{port}} and {{python}} only, "
                         f"got {command!r} ({type(e).__name__}: {e})") from None


def seconds(options: dict, key: str, default: float) -> float:
    v = options.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"openai engine: {key} must be a positive number of seconds, got {v!r}")
    return float(v)
