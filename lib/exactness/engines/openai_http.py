"""HTTP plumbing of the ``openai`` engine (engines/openai.py): servers the suite launches (started on a free port,
waited for, stopped by their own PID) and GET /v1/models; each failure raised as EngineError naming the
configuration, the URL and what happened. A launch command's ``{port}`` is the free port, ``{python}`` the suite's
own Python (sys.executable), so ``{python} -m exactness serve ...`` runs in the suite's environment under make."""
from __future__ import annotations

import atexit
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from .base import EngineError
from .openai_reply import one_line


@dataclass
class Endpoint:
    """One configuration's server: its base URL (``http://host:port/v1``), the launch command and process where the
    suite started it, and the served model name once known."""

    name: str
    base_url: str = ""
    launch: str = ""
    proc: subprocess.Popen | None = None
    log: object = None
    model: str = ""
    fingerprint: str | None = None
    settings: dict = field(default_factory=dict)
    api: str = "completions"           # completions | chat | auto (resolved at the first request)
    sampling: dict = field(default_factory=dict)
    plp: str = "off"                   # prompt logprobs: auto | vllm | echo | off (auto resolved at first use)
    plp_why: str | None = None         # why auto resolved to off
    cwd: str | None = None             # the folder a launch command runs in (None: the caller's)

    def where(self) -> str:
        return f"openai engine, configuration {self.name!r} at {self.base_url or '(not started)'}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(ep: Endpoint, n: int = 1500) -> str:
    if ep.log is None:
        return ""
    ep.log.flush()
    with open(ep.log.name, encoding="utf-8", errors="replace") as fh:
        return fh.read()[-n:]


def launch_line(command: str, port: int) -> str:
    """``command`` with ``{port}`` and ``{python}`` (the suite's own Python, shell-quoted) filled in.

    Raises:
        KeyError, IndexError, ValueError: other braces in the command.
    """
    return command.format(port=port, python=shlex.quote(sys.executable))


def models(ep: Endpoint, timeout_s: float) -> list[str]:
    """The ids GET ``ep.base_url``/models lists.

    Raises:
        EngineError: refused, an HTTP error status, a body that is not JSON or lists no model (one line each).
    """
    url = ep.base_url + "/models"
    try:
        resp = httpx.get(url, timeout=timeout_s)
    except httpx.ConnectError as e:
        raise EngineError(f"{ep.where()}: GET {url}: connection refused or no server ({e})") from None
    except httpx.HTTPError as e:
        raise EngineError(f"{ep.where()}: GET {url}: {type(e).__name__}: {one_line(e)}") from None
    if resp.status_code >= 400:
        raise EngineError(f"{ep.where()}: GET {url}: HTTP {resp.status_code}: {one_line(resp.text)}")
    try:
        ids = [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise EngineError(f"{ep.where()}: GET {url} did not answer a model list (JSON with data[].id): "
                          f"{one_line(resp.text, 200)!r}") from None
    if not ids or not all(isinstance(i, str) for i in ids):
        raise EngineError(f"{ep.where()}: GET {url} lists no model: {one_line(resp.text, 200)!r}")
    return ids


def launch(ep: Endpoint, timeout_s: float) -> None:
    """Start ``ep.launch`` on a free port and wait until its /v1/models answers 200.

    Raises:
        EngineError: the command cannot start, exits, or does not answer within ``timeout_s`` (then it is stopped);
            the message carries the end of its output.
    """
    port = _free_port()
    ep.base_url = f"http://127.0.0.1:{port}/v1"
    ep.log = tempfile.NamedTemporaryFile("w+", prefix=f"openai-{ep.name}-", suffix=".log", delete=False)
    try:
        ep.proc = subprocess.Popen(shlex.split(launch_line(ep.launch, port)), stdout=ep.log, cwd=ep.cwd,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise EngineError(f"{ep.where()}: cannot start {ep.launch!r}: {e}") from None
    # its own session survives our process: stopped at exit too, should close() never run (a notebook kernel shut
    # down mid-cell, a signal turned into an exception outside the engine's try)
    atexit.register(stop, ep)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ep.proc.poll() is not None:
            raise EngineError(f"{ep.where()}: the launched server exited with status {ep.proc.returncode} before "
                              f"answering; its output ends:\n{_log_tail(ep)}")
        try:
            if httpx.get(ep.base_url + "/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(ep)
    raise EngineError(f"{ep.where()}: the launched server did not answer /v1/models within {timeout_s} s; its "
                      f"output ends:\n{_log_tail(ep)}")


def stop(ep: Endpoint) -> None:
    """Stop a server the suite launched, by its own PID (SIGTERM, then SIGKILL after 10 s)."""
    if ep.proc is not None and ep.proc.poll() is None:
        ep.proc.terminate()
        try:
            ep.proc.wait(10)
        except subprocess.TimeoutExpired:
            ep.proc.kill()
            ep.proc.wait(10)
    if ep.log is not None:
        ep.log.close()
        if os.path.exists(ep.log.name):
            os.unlink(ep.log.name)
        ep.log = None
