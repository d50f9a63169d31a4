"""HTTP servers for the serve and openai-engine tests: a uvicorn server in a thread, and fake OpenAI-compatible
apps that misbehave (sleep, malformed chunk, error status, text only)."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse


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


def _chunk(text: str, ids=None) -> str:
    choice = {"index": 0, "text": text, "finish_reason": None}
    if ids is not None:
        choice["token_ids"] = ids
    return "data: " + json.dumps({"id": "x", "object": "text_completion", "choices": [choice]}) + "\n\n"


def fake_app(sleep_s: float = 2.0) -> FastAPI:
    """Misbehaving servers under one app, each at its own prefix (``/<kind>/v1``): ``sleepy`` answers after
    ``sleep_s``, ``malformed`` streams a chunk that is not JSON, ``status500`` answers 500, ``textonly`` streams
    text without token ids, ``noend`` streams one chunk and ends without [DONE]."""
    app = FastAPI()

    @app.get("/{kind}/v1/models")
    async def models(kind: str):
        return {"object": "list", "data": [{"id": f"fake-{kind}", "object": "model"}]}

    @app.post("/sleepy/v1/completions")
    async def sleepy():
        await asyncio.sleep(sleep_s)
        return {"choices": []}

    @app.post("/status500/v1/completions")
    async def status500():
        return JSONResponse({"error": {"message": "planted failure"}}, status_code=500)

    def sse(parts):
        async def gen():
            for p in parts:
                yield p
        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/malformed/v1/completions")
    async def malformed():
        return sse([_chunk("a", [97]), "data: {not json\n\n", "data: [DONE]\n\n"])

    @app.post("/textonly/v1/completions")
    async def textonly():
        return sse([_chunk("hé"), _chunk("llo"), "data: [DONE]\n\n"])

    @app.post("/noend/v1/completions")
    async def noend():
        return sse([_chunk("a", [97])])

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
