"""HTTP servers for the serve and openai-engine tests: a uvicorn server in a thread, and fake OpenAI-compatible
apps that misbehave (sleep, malformed chunk, error status, garbage, text only or lossy, cut streams, a chosen token
below the top-1, chat only, prompt logprobs)."""
from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


def free_port() -> int:
    """A local TCP port nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """``app`` served by uvicorn on 127.0.0.1 in a daemon thread; a context manager (started, then stopped)."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on port {self.port}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _chunk(text: str, ids=None, finish=None, logprobs=None, usage=None) -> str:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    if logprobs is not None:
        choice["logprobs"] = logprobs
    obj = {"id": "x", "object": "text_completion", "choices": [choice]}
    if usage is not None:
        obj["usage"] = usage
    return "data: " + json.dumps(obj) + "\n\n"


def _lp(tok: int, lp: float, top: dict) -> dict:
    """One token's legacy logprobs entry with ``token_id:<id>`` names."""
    return {"tokens": [f"token_id:{tok}"], "token_logprobs": [lp],
            "top_logprobs": [{f"token_id:{i}": v for i, v in top.items()}], "text_offset": [0]}


DONE = "data: [DONE]\n\n"
# vLLM's prompt_logprobs of a 4-token prompt [256, 97, 98, 99]: rows 1..3; "plpbad" moves row 2 by one ulp
PLP = [None, {"97": {"logprob": -1.5, "rank": 2, "decoded_token": "a"},
              "5": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}},
       {"98": {"logprob": -0.25, "rank": 1, "decoded_token": "b"}},
       {"99": {"logprob": -2.0, "rank": 3, "decoded_token": "c"},
        "7": {"logprob": -0.75, "rank": 1, "decoded_token": "y"}}]


def _chat_entry(tok: int, lp: float, top: dict) -> dict:
    e = lambda i, v: {"token": chr(i), "logprob": v, "bytes": [i]}   # noqa: E731
    return {**e(tok, lp), "top_logprobs": [e(i, v) for i, v in top.items()]}


def fake_app(sleep_s: float = 2.0) -> FastAPI:
    """Misbehaving servers under one app, each at its own prefix (``/<kind>/v1``): ``sleepy`` answers after
    ``sleep_s``, ``malformed`` streams a chunk that is not JSON, ``status500`` answers 500, ``garbage`` answers
    bodies that are not JSON (models too), ``textonly`` streams text without token ids, ``lossy`` text with U+FFFD
    and a completion count other than asked, ``noend`` streams one chunk and ends without [DONE], ``interrupted``
    ends with [DONE] and no finish reason (as llama.cpp's Python server cuts a stream), ``abort`` finishes "abort",
    ``notgreedy`` returns a second token whose logprob is below its row's top-1, ``chatonly`` answers 404 on
    /v1/completions and serves /v1/chat/completions (logprobs with bytes), ``plp`` / ``plpbad`` answer vLLM's
    prompt_logprobs (plpbad: row 2 one ulp off)."""
    app = FastAPI()

    @app.get("/{kind}/v1/models")
    async def models(kind: str):
        if kind == "garbage":
            return PlainTextResponse("<html>not json")
        return {"object": "list", "data": [{"id": f"fake-{kind}", "object": "model"}]}

    @app.post("/sleepy/v1/completions")
    async def sleepy():
        await asyncio.sleep(sleep_s)
        return {"choices": []}

    @app.post("/status500/v1/completions")
    async def status500():
        return JSONResponse({"error": {"message": "planted failure"}}, status_code=500)

    @app.post("/garbage/v1/completions")
    async def garbage():
        return PlainTextResponse("<html>not json")

    def sse(parts):
        async def gen():
            for p in parts:
                yield p
        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/malformed/v1/completions")
    async def malformed():
        return sse([_chunk("a", [97]), "data: {not json\n\n", DONE])

    @app.post("/textonly/v1/completions")
    async def textonly():
        return sse([_chunk("hé"), _chunk("llo", finish="length"), DONE])

    @app.post("/lossy/v1/completions")
    async def lossy():
        use = {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
        return sse([_chunk("h\ufffd"), _chunk("i", finish="length", usage=use), DONE])

    @app.post("/noend/v1/completions")
    async def noend():
        return sse([_chunk("a", [97])])

    @app.post("/interrupted/v1/completions")
    async def interrupted():
        return sse([_chunk("a", [97]), DONE])

    @app.post("/abort/v1/completions")
    async def abort():
        return sse([_chunk("a", [97]), _chunk("", [], finish="abort"), DONE])

    @app.post("/notgreedy/v1/completions")
    async def notgreedy(request: Request):
        body = await request.json()
        if body.get("prompt_logprobs") or body.get("echo"):
            return JSONResponse({"error": {"message": "not served"}}, status_code=400)
        n = body.get("max_tokens", 1)
        toks = [(97, -0.5, {97: -0.5, 98: -1.0}), (99, -2.0, {98: -0.25, 99: -2.0}), (97, -0.5, {97: -0.5})]
        parts = [_chunk(chr(t), [t], "length" if i == n - 1 else None, _lp(t, lp, top))
                 for i, (t, lp, top) in enumerate((toks * n)[:n])]
        return sse(parts + [DONE])

    @app.post("/chatonly/v1/completions")
    async def chatonly_completions():
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    @app.post("/chatonly/tokenize")
    async def chatonly_tokenize(request: Request):
        return {"tokens": list((await request.json())["prompt"].encode("utf-8"))}

    @app.post("/chatonly/v1/chat/completions")
    async def chatonly(request: Request):
        body = await request.json()
        n, user = body.get("max_tokens", 1), body["messages"][-1]["content"]
        toks = [(ord(c), -0.5, {ord(c): -0.5}) for c in (user * n)[:n]]   # echoes the last message's text
        lp = {"content": [_chat_entry(*t) for t in toks]}
        text = "".join(chr(t) for t, _, _ in toks)
        if not body.get("stream"):
            return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                                 "finish_reason": "length"}]}
        parts = [{"choices": [{"index": 0, "delta": {"content": chr(t)}, "finish_reason": None,
                               "logprobs": {"content": [e]}}]} for (t, _, _), e in zip(toks, lp["content"])]
        parts[-1]["choices"][0]["finish_reason"] = "length"
        return sse(["data: " + json.dumps(p) + "\n\n" for p in parts] + [DONE])

    @app.post("/{kind}/v1/completions")
    async def plp(kind: str, request: Request):
        body = await request.json()
        rows = json.loads(json.dumps(PLP))
        if kind == "plpbad":
            rows[2]["98"]["logprob"] = math.nextafter(-0.25, 0.0)
        ch = {"index": 0, "text": "a", "token_ids": [97], "finish_reason": "length"}
        if body.get("prompt_logprobs"):
            ch["prompt_logprobs"] = rows
        if body.get("stream"):
            return sse([_chunk("a", [97], "length"), DONE])
        return {"choices": [ch], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}

    return app


# A server that sends one chunk and then dies (the process exits mid-stream); run as a script with the port.
DYING_SERVER = '''
import os, sys, json, time
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "dying"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        data = ('data: ' + json.dumps({"choices": [{"index": 0, "text": "a", "token_ids": [97]}]}) + '\\n\\n').encode()
        self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))
        self.wfile.flush()
        time.sleep(0.2)
        os._exit(1)

HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


def _greedy_reply(n: int, stream: bool, upto: int | None = None):
    """``n`` tokens (ids 97, 98, ... 'a', 'b', ...) with token ids and top logprobs (the chosen one first), the last
    with finish_reason length: SSE chunks and [DONE], or one JSON object; ``upto`` cuts a stream after that many
    chunks without [DONE] (a dropped stream)."""
    choices = []
    for i in range(n):
        t = 97 + i % 26
        choices.append({"index": 0, "text": chr(t), "token_ids": [t], "finish_reason": "length" if i == n - 1 else None,
                        "logprobs": {"tokens": [chr(t)], "token_logprobs": [-0.01],
                                     "top_logprobs": [{f"token_id:{t}": -0.01, f"token_id:{t + 1}": -5.0}]}})
    usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
    if not stream:
        whole = {"index": 0, "text": "".join(c["text"] for c in choices), "finish_reason": "length",
                 "token_ids": [c["token_ids"][0] for c in choices],
                 "logprobs": {k: [c["logprobs"][k][0] for c in choices] for k in ("tokens", "token_logprobs",
                                                                                  "top_logprobs")}}
        return JSONResponse({"id": "x", "object": "text_completion", "choices": [whole], "usage": usage})
    parts = ["data: " + json.dumps({"id": "x", "object": "text_completion", "choices": [c]}) + "\n\n"
             for c in choices]
    parts = parts[:upto] if upto is not None else parts + [
        "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n", "data: [DONE]\n\n"]

    async def gen():
        for p in parts:
            yield p
    return StreamingResponse(gen(), media_type="text/event-stream")


def failing_app() -> FastAPI:
    """OpenAI-compatible servers for the failure tests, each at ``/<kind>/v1`` (with ``/<kind>/tokenize``): ``good``
    answers every completion greedily (_greedy_reply); ``flaky`` answers a one-token request (the probe) so and
    drops every longer stream after one chunk; ``badmodels`` answers GET /models with a body that is not JSON;
    ``garbage`` answers completions 200 with a body that is not JSON."""
    app = FastAPI()

    @app.get("/badmodels/v1/models")
    async def bad_models():
        return PlainTextResponse("<html>not a model list")

    @app.get("/{kind}/v1/models")
    async def models(kind: str):
        return {"object": "list", "data": [{"id": f"fake-{kind}", "object": "model"}]}

    @app.post("/{kind}/tokenize")
    async def tokenize(kind: str, request: Request):
        body = await request.json()
        return {"tokens": list(str(body.get("prompt", "")).encode("utf-8"))[:64] or [1]}

    @app.post("/{kind}/v1/completions")
    async def completions(kind: str, request: Request):
        body = await request.json()
        n, stream = int(body.get("max_tokens") or 16), bool(body.get("stream"))
        if kind == "garbage":
            return PlainTextResponse('{"choices": [oops', media_type="application/json")
        return _greedy_reply(n, stream, upto=1 if kind == "flaky" and n > 1 else None)

    return app
