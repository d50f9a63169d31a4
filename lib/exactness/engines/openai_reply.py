"""Reading one reply of an OpenAI-compatible server for the ``openai`` engine (engines/openai.py): a streamed one
(SSE chunks until ``data: [DONE]``) or a whole JSON reply, of ``/v1/completions`` (choice.text, choice.logprobs =
{tokens, token_logprobs, top_logprobs}) or ``/v1/chat/completions`` (delta / message .content, logprobs.content =
[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]), with ``token_ids`` where the server sends them.

Each failure is an EngineError naming the configuration, the URL and what happened: refused, an HTTP status with the
server's message, a body or chunk that is not JSON or has no choices, an error event, a stream closed early or cut
(no finish reason, or one other than ``length`` / ``stop``: llama.cpp's Python server ends a running stream with
[DONE] when a new request arrives unless launched with ``--interrupt_requests False``).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx
import torch

from ..exact import token_hash
from ..run import Run
from .base import EngineError
from .openai_checks import greedy_check, lost_facts

INTERRUPTED = ("interrupted; llama.cpp's Python server cuts a running stream when a new request arrives unless "
               "launched with --interrupt_requests False")


def one_line(s: str, n: int = 300) -> str:
    """``s`` on one line (whitespace runs collapsed), at most ``n`` characters."""
    return " ".join(str(s).split())[:n]


@dataclass
class Reply:
    """What one completion returned.

    ids: token ids (None where the server sent none); text: the text as received; raw: the tokens' bytes where
    every token came with chat ``bytes`` (else None; raw_lost once one came without); chosen: each token's
    logprob; tops: each token's top-N as ([(key, logprob)], keyed_by_text); top: the top-N as [(id, logprob)]
    best first where keys are ids (else None); empty: tokens whose text came back empty; chunks: content chunks;
    times: seconds from the request per token; usage, finish reason, system fingerprint, ``exactness_served``,
    the whole reply (non-streamed), notes for the receipt.
    """

    ids: list | None = None
    text: str = ""
    raw: bytearray | None = None
    raw_lost: bool = False
    chosen: list = field(default_factory=list)
    tops: list = field(default_factory=list)
    top: list | None = field(default_factory=list)
    empty: int = 0
    chunks: int = 0
    times: list = field(default_factory=list)
    usage: dict | None = None
    finish: str | None = None
    fingerprint: str | None = None
    served: dict | None = None
    body: dict | None = None
    notes: list = field(default_factory=list)

    @property
    def counted(self) -> int | None:
        """Tokens counted: ids, else logprob entries, else None."""
        return len(self.ids) if self.ids is not None else (len(self.chosen) if self.chosen else None)


def _key(k) -> int | None:
    if isinstance(k, str) and k.startswith("token_id:") and k[9:].lstrip("-").isdigit():
        return int(k[9:])
    return None


def _add_top(r: Reply, pairs: list, by_text: bool) -> None:
    ids = [_key(k) for k, _ in pairs]
    r.tops.append((pairs, by_text and any(i is None for i in ids)))
    if r.top is not None and all(i is not None for i in ids):
        r.top.append(sorted(((i, float(v)) for i, (_, v) in zip(ids, pairs)), key=lambda p: -p[1]))
    elif r.top is not None:
        r.top = None
        r.notes.append("top logprobs name tokens by text (no token_id:<id>): not mapped to ids")


def _legacy_logprobs(r: Reply, lp: dict) -> None:
    toks, lps, tops = lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    for i, t in enumerate(toks):
        r.chosen.append(lps[i] if i < len(lps) else None)
        r.empty += t == ""
        d = tops[i] if i < len(tops) else None
        _add_top(r, list(d.items()) if isinstance(d, dict) else [], True)


def _chat_logprobs(r: Reply, lp: dict) -> None:
    for e in lp.get("content") or []:
        if not isinstance(e, dict):
            continue
        b = e.get("bytes")
        if not r.raw_lost and isinstance(b, list) and all(isinstance(x, int) and 0 <= x < 256 for x in b):
            r.raw = (r.raw if r.chosen else bytearray()) + bytes(b)
        else:
            r.raw, r.raw_lost = None, True
        r.chosen.append(e.get("logprob"))
        r.empty += e.get("token") == "" and not b
        pairs = [(t.get("token"), t.get("logprob")) for t in e.get("top_logprobs") or [] if isinstance(t, dict)]
        _add_top(r, pairs, False)   # a list: no entry lost to a shared text


def add_choice(r: Reply, choice: dict, t: float, where: str) -> None:
    """Fold one choice (streamed chunk or whole reply, completions or chat) into ``r``, stamping its tokens."""
    text, ids = choice.get("text"), choice.get("token_ids")
    msg = choice.get("delta") or choice.get("message") or {}
    if text is None:
        text = msg.get("content") or ""
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        raise EngineError(f"{where}: malformed chunk: token_ids {one_line(ids, 100)!r} is not a list of ints")
    if (ids is None) != (r.ids is None) and r.times:
        raise EngineError(f"{where}: malformed stream: some chunks carry token_ids and some do not")
    r.text += text
    if ids is not None:
        r.ids = (r.ids or []) + ids
    before = len(r.chosen)
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        (_chat_logprobs if "content" in lp else _legacy_logprobs)(r, lp)
    r.chunks += bool(text)
    n = len(ids) if ids is not None else (len(r.chosen) - before or (1 if text else 0))
    r.times += [t] * n
    r.finish = choice.get("finish_reason") or r.finish


def _fold(r: Reply, obj: dict, t: float, where: str) -> None:
    if isinstance(obj, dict) and "error" in obj:
        raise EngineError(f"{where}: the server reported an error: {one_line(obj['error'])}")
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
        raise EngineError(f"{where}: malformed reply (no choices list): {one_line(obj, 200)!r}")
    r.fingerprint = obj.get("system_fingerprint") or r.fingerprint
    r.usage = obj.get("usage") or r.usage
    r.served = obj.get("exactness_served") or r.served   # only ``exactness serve`` sends it
    for choice in obj["choices"]:
        add_choice(r, choice, t, where)


def _chunks(resp: httpx.Response, where: str):
    for line in resp.iter_lines():
        if not line.startswith("data:"):
            continue   # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            raise EngineError(f"{where}: malformed chunk (not JSON): {data[:200]!r}") from None
    raise EngineError(f"{where}: the stream ended before data: [DONE] (the server closed it early)")


def http_error(resp: httpx.Response, url: str, where: str, hint=None) -> EngineError:
    """The EngineError of an HTTP error status, with the server's message on one line (and ``hint(text)``)."""
    text = one_line(resp.text, 400)
    return EngineError(f"{where}: HTTP {resp.status_code} from {url}: {text}{hint(text) if hint else ''}")


def complete(url: str, body: dict, timeout_s: float, where: str, hint=None) -> Reply:
    """POST ``body`` to ``url`` and read the reply (streamed where body["stream"]), stamping each token.

    Raises:
        EngineError: see the module docstring; an HTTP 404/405 carries ``status`` on the exception.
    """
    r, t0 = Reply(), time.perf_counter()
    try:
        with httpx.Client(timeout=httpx.Timeout(timeout_s)) as client, \
                client.stream("POST", url, json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                e = http_error(resp, url, where, hint)
                e.status = resp.status_code
                raise e
            if body.get("stream"):
                for chunk in _chunks(resp, where):
                    _fold(r, chunk, time.perf_counter() - t0, where)
            else:
                resp.read()
                try:
                    r.body = resp.json()
                except ValueError:
                    raise EngineError(f"{where}: {url} answered with a body that is not JSON: "
                                      f"{one_line(resp.text, 200)!r}") from None
                _fold(r, r.body, time.perf_counter() - t0, where)
    except httpx.ConnectError as e:
        raise EngineError(f"{where}: cannot connect to {url} (connection refused or no server): {e}") from None
    except httpx.TimeoutException as e:
        raise EngineError(f"{where}: no answer from {url} within {timeout_s} s ({type(e).__name__})") from None
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        raise EngineError(f"{where}: the server at {url} closed the connection mid-stream after "
                          f"{len(r.times)} tokens: {e}") from None
    if r.finish not in ("length", "stop"):
        raise EngineError(f"{where}: the reply from {url} ended after {len(r.times)} of {body.get('max_tokens')} "
                          f"tokens with finish_reason {r.finish!r} ({INTERRUPTED})")
    return r


def generation(config: str, r: Reply, max_tokens: int, top_n: int) -> Run:
    """A Reply -> Run: gen_ids from the token ids, else the tokens' chat ``bytes``, else the UTF-8 bytes of
    the text as received (what it may have lost in ``info["lost"]``); ``greedy`` checked where logprobs came."""
    info = {"finish_reason": r.finish, "usage": r.usage, "system_fingerprint": r.fingerprint, "notes": r.notes}
    if r.served is not None:
        info["served"] = r.served
    if r.ids is not None:
        data, info["gen_ids_are"] = r.ids, "token ids"
    elif r.raw is not None:
        data, info["gen_ids_are"] = list(r.raw), "bytes of the generated tokens (the logprobs' bytes)"
    else:
        data = list(r.text.encode("utf-8", "surrogatepass"))
        info["gen_ids_are"] = "utf-8 bytes of the returned text (the server returned no token ids)"
        lost = lost_facts(r.text, r.usage, max_tokens, r.counted, r.chunks, r.empty)
        if lost:
            info["lost"] = lost
    ids = torch.tensor(data, dtype=torch.int64)
    if r.ids is None:
        info["text_hash"] = token_hash(ids)
    n = r.counted if r.counted is not None else len(r.times)
    if n != max_tokens:
        info["notes"].append(f"asked for {max_tokens} tokens, the server returned {n} (finish_reason {r.finish!r})")
    known = (r.usage or {}).get("completion_tokens")
    known = len(r.ids) if r.ids is not None else known if isinstance(known, int) else \
        max_tokens if r.finish == "length" else None
    greedy, info["greedy_check"] = greedy_check(r.chosen, r.tops, top_n, known)
    times = r.times
    return Run(config=config, gen_ids=ids, top_logprobs=r.top if r.top else None,
               ttft_s=times[0] if times else 0.0, decode_s=times[-1] - times[0] if times else 0.0,
               token_times=times or None, info=info, greedy=greedy)
