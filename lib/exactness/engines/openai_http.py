"""HTTP plumbing of the ``openai`` engine (engines/openai.py): servers the suite launches (started on a free port,
waited for, stopped by their own PID) and the reading of one streamed ``/v1/completions`` reply (SSE chunks until
``data: [DONE]``), each failure raised as EngineError naming the configuration, the URL and what happened."""
from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from .base import EngineError


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
        ep.proc = subprocess.Popen(shlex.split(ep.launch.format(port=port)), stdout=ep.log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise EngineError(f"{ep.where()}: cannot start {ep.launch!r}: {e}") from None
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
        os.unlink(ep.log.name)
        ep.log = None


# ------------------------------------------------------------------------------------------------------ streaming

@dataclass
class Reply:
    """What one streamed completion returned: ids (None where the server sent none), text, top-N per token (None
    where not asked or not mapped to ids), seconds from the request to each token, the last usage, the finish
    reason, the system fingerprint, the prefill plans served (``exactness serve`` only), notes for the receipt."""

    ids: list | None = None
    text: str = ""
    top: list | None = None
    times: list = field(default_factory=list)
    usage: dict | None = None
    finish: str | None = None
    fingerprint: str | None = None
    served: dict | None = None
    notes: list = field(default_factory=list)


def _top_ids(entry) -> list | None:
    """One ``{"token_id:<id>": logprob}`` dict -> [(id, logprob)] best first; None where a key is a plain string."""
    if not isinstance(entry, dict):
        return None
    out = []
    for k, v in entry.items():
        if not (isinstance(k, str) and k.startswith("token_id:") and k[9:].lstrip("-").isdigit()):
            return None
        out.append((int(k[9:]), float(v)))
    return sorted(out, key=lambda p: -p[1])


def _add_choice(r: Reply, choice: dict, t: float, where: str) -> None:
    """Fold one streamed choice into ``r``: its ids (or text only), its logprobs, one time stamp per token."""
    text, ids = choice.get("text"), choice.get("token_ids")
    if text is None:
        text = (choice.get("delta") or {}).get("content") or ""
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        raise EngineError(f"{where}: malformed chunk: token_ids {ids!r} is not a list of ints")
    if (ids is None) != (r.ids is None) and r.times:
        raise EngineError(f"{where}: malformed stream: some chunks carry token_ids and some do not")
    r.text += text
    if ids is not None:
        r.ids = (r.ids or []) + ids
    lp = choice.get("logprobs")
    if r.top is not None and isinstance(lp, dict):
        tops = [_top_ids(e) for e in lp.get("top_logprobs") or []]
        if any(x is None for x in tops):
            r.top = None
            r.notes.append("top logprobs are keyed by token strings (no token_id:<id>): not mapped to ids")
        else:
            r.top += tops
    n = len(ids) if ids is not None else (1 if text else 0)
    r.times += [t] * n
    r.finish = choice.get("finish_reason") or r.finish


def _chunks(resp: httpx.Response, where: str):
    """The JSON chunks of an SSE reply until ``data: [DONE]``.

    Raises:
        EngineError: a chunk that is not JSON or has no choices list, an error event, a stream that ends before
            [DONE].
    """
    for line in resp.iter_lines():
        if not line.startswith("data:"):
            continue   # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise EngineError(f"{where}: malformed chunk (not JSON): {data[:200]!r}") from None
        if isinstance(chunk, dict) and "error" in chunk:
            raise EngineError(f"{where}: the server reported an error mid-stream: {chunk['error']}")
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            raise EngineError(f"{where}: malformed chunk (no choices list): {data[:200]!r}")
        yield chunk
    raise EngineError(f"{where}: the stream ended before data: [DONE] (the server closed it early)")


def stream_completion(url: str, body: dict, timeout_s: float, where: str, want_top: bool) -> Reply:
    """POST ``body`` (stream: true) to ``url`` and read the reply, stamping each chunk's tokens.

    Raises:
        EngineError: refused connection, timeout, an HTTP error status (with the server's message), a server that
            closed the connection mid-stream, a malformed chunk; each names ``where`` and what happened.
    """
    r = Reply(top=[] if want_top else None)
    t0 = time.perf_counter()
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout_s)) as client, \
                client.stream("POST", url, json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise EngineError(f"{where}: HTTP {resp.status_code} from {url}: {resp.text[:500]}")
            for chunk in _chunks(resp, where):
                t = time.perf_counter() - t0
                r.fingerprint = chunk.get("system_fingerprint") or r.fingerprint
                r.usage = chunk.get("usage") or r.usage
                r.served = chunk.get("exactness_served") or r.served   # only ``exactness serve`` sends it
                for choice in chunk["choices"]:
                    _add_choice(r, choice, t, where)
    except httpx.ConnectError as e:
        raise EngineError(f"{where}: cannot connect to {url} (connection refused or no server): {e}") from None
    except httpx.TimeoutException as e:
        raise EngineError(f"{where}: no answer from {url} within {timeout_s} s ({type(e).__name__})") from None
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        raise EngineError(f"{where}: the server at {url} closed the connection mid-stream after "
                          f"{len(r.times)} tokens: {e}") from None
    return r
