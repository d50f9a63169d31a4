"""``python -m exactness serve``: our reference engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

    GET  /v1/models             the served model (its name, max_model_len)
    POST /v1/completions        prompt as token ids or a string; greedy only; stream or not; logprobs=N
    POST /v1/chat/completions   minimal: the messages' contents joined by newlines, run as one completion
    POST /tokenize, /detokenize text <-> ids with the served tokenizer (the request shapes vLLM uses)

Every run is the in-process one: prefill by ``paths.prefill`` on the configured Schedule, then
``paths.decode_step`` per token, the kernel set's argmax choosing each token, into a KV cache sized as
``paths.generate`` sizes it, so a served run's tokens equal
``paths.generate(w, ids, max_tokens, kernels, Schedule(path, step, deep_threshold))``'s while end-of-sequence is
ignored (``ignore_eos: true``; otherwise the reply stops after the EOS token, finish_reason ``stop``).

Greedy only: ``temperature`` absent or 0 (any other value is refused with 400 naming it); ``n`` 1; no ``stop``
strings; no ``echo``. Each choice carries the generated ids in ``token_ids`` (every streamed chunk carries its own
token's id), as vLLM and SGLang do with ``return_token_ids``. With ``return_tokens_as_token_ids: true`` the
logprobs' token strings are ``token_id:<id>`` (vLLM's convention), so top-N entries map to exact ids; otherwise they
are the decoded texts (which may collide, e.g. every lone byte of a multi-byte character decodes to U+FFFD).
Log-probabilities are ``log_softmax`` of the fp32 logit row the token was chosen from. The last reply of a run
(the non-streamed reply, or the streamed chunk with ``usage``) carries ``exactness_served``: plan -> segments and rows
the prefill actually ran (so a deep configuration that never ran deep shows).

Requests are served one at a time: one worker thread runs every generation, in arrival order; a concurrent request
waits for the one before it (no batching). A streaming client that disconnects stops its run at the next token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..cache import KV_DTYPES, KVCache, KVFormat
from ..config import BYTE_VOCAB
from ..kernels import KernelSet, get_set
from ..kernels.quant import WEIGHT_FORMATS
from ..paths import PATHS, Schedule, _served, check_run_args, decode_step, prefill
from ..tokenizer import ByteTokenizer
from ..weights import Weights, weights_format

_END = object()


@dataclass
class Served:
    """The served model and how it runs.

    Attributes:
        name: the model name /v1/models reports and requests may name.
        w: the weights; tokenizer: encodes string prompts (None: only token-id prompts are taken).
        kernels: the kernel set; schedule: prefill path, step and deep threshold.
        kv_dtype: what the KV cache stores (cache.KV_DTYPES).
        worker: the single thread every generation runs on (requests served one at a time).
    """

    name: str
    w: Weights
    tokenizer: object | None
    kernels: KernelSet
    schedule: Schedule
    kv_dtype: str = "bf16"
    worker: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="serve"))

    @property
    def fingerprint(self) -> str:
        """``system_fingerprint`` of every reply: kernel set, path, step, deep threshold, dtype, device, then the
        weights setting and KV-cache dtype."""
        s = self.schedule
        return (f"exactness:{self.kernels.name}:{s.path}:{s.step or 'all'}:{s.deep_threshold}:"
                f"{str(self.w.dtype).removeprefix('torch.')}:{self.w.device}:{weights_format(self.w)}:"
                f"{self.kv_dtype}")


class RequestError(ValueError):
    """A request refused with an HTTP status (400 bad value, 404 unknown model); the message names the value."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass
class Job:
    """One parsed completion request: ids [P] int64, max_tokens, top-N logprobs (0: none), stop at EOS or not;
    ``served`` is filled by the run."""

    ids: torch.Tensor
    max_tokens: int
    logprobs: int
    ignore_eos: bool
    stream: bool
    id_strings: bool
    chat: bool = False
    served: dict = field(default_factory=_served)   # plan -> {"segments", "rows"} the prefill ran


@dataclass
class Step:
    """One generated token: its id, (token_logprob, [(id, logprob)] top-N best first) or None, finish reason."""

    token: int
    logprobs: tuple | None
    finish: str | None


# ---------------------------------------------------------------------------------------------------- generation

def _top(row: torch.Tensor, n: int, token: int) -> tuple | None:
    """row [1, V] fp32 -> (logprob of ``token``, top-n (id, logprob) pairs best first), or None for n = 0."""
    if not n:
        return None
    lp = torch.log_softmax(row.float(), dim=-1)[0]
    vals, idx = torch.topk(lp, n)
    return float(lp[token]), [(int(i), float(v)) for i, v in zip(idx.tolist(), vals.tolist())]


def run_steps(m: Served, job: Job, cancelled: threading.Event):
    """Yield one Step per generated token, exactly as paths.generate computes them (see the module docstring).

    Raises:
        ValueError: lengths past the model (paths.check_run_args).
    """
    w, ks, sched = m.w, m.kernels, m.schedule
    P = int(job.ids.numel())
    check_run_args(w, P, job.max_tokens)
    cache = KVCache(w.cfg, P + max(job.max_tokens, 1), 1, w.dtype, w.device, m.kv_dtype)
    last = prefill(w, cache, job.ids, ks, sched, served=job.served).logits[-1:]
    slots = torch.zeros(1, dtype=torch.int64, device=w.device)
    tok = None
    for i in range(job.max_tokens):
        if i:
            last = decode_step(w, cache, tok, torch.tensor([P + i - 1], device=w.device), slots, ks)
        tok = ks.fn("argmax", sched.role if i == 0 else "decode")(last)
        t = int(tok.reshape(-1)[0])
        eos = not job.ignore_eos and t == w.cfg.eos_id
        finish = "stop" if eos else ("length" if i == job.max_tokens - 1 else None)
        yield Step(t, _top(last, job.logprobs, t), finish)
        if eos or cancelled.is_set():
            return


async def steps_async(m: Served, job: Job):
    """The Steps of ``job`` as an async iterator, computed on the served worker thread; closing it early (a client
    gone) stops the run at the next token. An exception of the run is raised here."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def work():
        try:
            for s in run_steps(m, job, cancelled):
                loop.call_soon_threadsafe(q.put_nowait, s)
            loop.call_soon_threadsafe(q.put_nowait, _END)
        except Exception as e:  # noqa: BLE001 -- handed to the request's coroutine
            loop.call_soon_threadsafe(q.put_nowait, e)

    loop.run_in_executor(m.worker, work)
    try:
        while (item := await q.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        cancelled.set()


# ------------------------------------------------------------------------------------------------------ requests

def _int(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key, default)
    v = default if v is None else v
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(f"{key} must be an int in [{lo}, {hi}], got {v!r}", key)
    return v


def _greedy(body: dict) -> None:
    """Refuse anything but greedy sampling, naming the value."""
    t = body.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t != 0):
        raise RequestError(f"temperature must be 0 (this server decodes greedily only), got {t!r}", "temperature")
    if body.get("n", 1) not in (1, None):
        raise RequestError(f"n must be 1 (one greedy choice), got {body['n']!r}", "n")
    if body.get("top_p", 1) not in (1, None):
        raise RequestError(f"top_p must be 1 (greedy decoding), got {body['top_p']!r}", "top_p")
    if body.get("stop"):
        raise RequestError(f"stop sequences are not supported, got {body['stop']!r}", "stop")
    if body.get("echo"):
        raise RequestError("echo is not supported", "echo")


def prompt_ids(m: Served, prompt) -> torch.Tensor:
    """A prompt (token ids, or a string for the tokenizer) -> ids [P] int64.

    Raises:
        RequestError: an empty prompt, ids outside the vocabulary, a string with no tokenizer, a batch of prompts.
    """
    V = m.w.cfg.vocab_size
    if isinstance(prompt, str):
        if m.tokenizer is None:
            raise RequestError("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        ids = m.tokenizer.encode(prompt).to(torch.int64)
    elif isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        bad = [i for i in prompt if not 0 <= i < V]
        if bad:
            raise RequestError(f"token ids must be in [0, {V}), got {bad[:5]}", "prompt")
        ids = torch.tensor(prompt, dtype=torch.int64)
    else:
        raise RequestError("prompt must be one string or one list of token ids (one prompt per request), got "
                           f"{type(prompt).__name__}", "prompt")
    if ids.numel() == 0:
        raise RequestError("the prompt is empty; at least one token is needed", "prompt")
    return ids


def parse_job(m: Served, body, chat: bool = False) -> Job:
    """A completions (or chat) request body -> Job.

    Raises:
        RequestError: a body that is not an object, another model's name (404), a non-greedy setting, a bad prompt,
            max_tokens / logprobs out of range, lengths past the model's max_positions.
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    if body.get("model") not in (None, m.name):
        raise RequestError(f"model {body['model']!r} is not served here; served: {m.name!r}", "model", 404)
    _greedy(body)
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not all(isinstance(x, dict) and isinstance(x.get("content"), str)
                                                 for x in msgs):
            raise RequestError("messages must be a list of {role, content: string}", "messages")
        if body.get("logprobs"):
            raise RequestError("logprobs are served on /v1/completions only", "logprobs")
        ids = prompt_ids(m, "\n".join(x["content"] for x in msgs))
    else:
        ids = prompt_ids(m, body.get("prompt"))
    room = m.w.cfg.max_positions - ids.numel()
    job = Job(ids=ids, max_tokens=_int(body, "max_tokens", 16, 0, max(room, 0)),
              logprobs=0 if chat else _int(body, "logprobs", 0, 0, m.w.cfg.vocab_size),
              ignore_eos=bool(body.get("ignore_eos", False)), stream=bool(body.get("stream", False)),
              id_strings=bool(body.get("return_tokens_as_token_ids", False)), chat=chat)
    return job


def _text(m: Served, ids: list[int]) -> str:
    return m.tokenizer.decode(ids) if m.tokenizer is not None else ""


def _logprobs(m: Served, job: Job, steps: list[Step], offset: int) -> dict | None:
    """The completions ``logprobs`` object of ``steps`` (tokens, token_logprobs, top_logprobs, text_offset)."""
    if not job.logprobs:
        return None
    name = (lambda i: f"token_id:{i}") if job.id_strings else (lambda i: _text(m, [i]))
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for s in steps:
        out["tokens"].append(name(s.token))
        out["token_logprobs"].append(s.logprobs[0])
        out["top_logprobs"].append({name(i): lp for i, lp in s.logprobs[1]})
        out["text_offset"].append(offset)
        offset += len(_text(m, [s.token]))
    return out


def _choice(m: Served, job: Job, steps: list[Step], finish: str | None, offset: int = 0, delta: bool = False):
    ids = [s.token for s in steps]
    text = _text(m, ids)
    if job.chat:
        key = "delta" if delta else "message"
        return {"index": 0, key: {"role": "assistant", "content": text}, "token_ids": ids, "finish_reason": finish}
    return {"index": 0, "text": text, "token_ids": ids, "logprobs": _logprobs(m, job, steps, offset),
            "finish_reason": finish}


def _reply(m: Served, job: Job, rid: str, choice: dict, chunk: bool, usage: dict | None = None) -> dict:
    kind = "chat.completion" if job.chat else "text_completion"
    out = {"id": rid, "object": kind + (".chunk" if chunk and job.chat else ""), "created": int(time.time()),
           "model": m.name, "system_fingerprint": m.fingerprint, "choices": [choice] if choice else []}
    if usage is not None:   # the last reply of a run: its token counts and the prefill plans that served it
        out["usage"] = usage
        out["exactness_served"] = job.served
    return out


def _usage(job: Job, n: int) -> dict:
    P = int(job.ids.numel())
    return {"prompt_tokens": P, "completion_tokens": n, "total_tokens": P + n}


def _data(obj: dict) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


async def _sse(m: Served, job: Job, rid: str):
    """Server-sent events: one ``data: {chunk}`` per token, then ``data: [DONE]``; a run that fails after the
    first byte sends ``data: {"error": ...}`` instead of [DONE]."""
    n, offset = 0, 0
    try:
        async for s in steps_async(m, job):
            yield _data(_reply(m, job, rid, _choice(m, job, [s], s.finish, offset, True), True))
            n, offset = n + 1, offset + len(_text(m, [s.token]))
        yield _data(_reply(m, job, rid, {}, True, _usage(job, n)))
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 -- the status line is already sent; the client reads the error event
        yield _data({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})


# ----------------------------------------------------------------------------------------------------------- app

def _error(e: RequestError) -> JSONResponse:
    return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "param": e.param,
                                   "code": e.status}}, status_code=e.status)


async def _body(request):
    try:
        return await request.json()
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None


def create_app(m: Served):
    """The FastAPI app serving ``m`` (routes in the module docstring); refusals are OpenAI-style error objects."""
    app = FastAPI(title="exactness reference engine")
    app.add_exception_handler(RequestError, lambda request, e: _error(e))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": m.name, "object": "model", "created": 0, "owned_by": "exactness",
                                            "max_model_len": m.w.cfg.max_positions}]}

    async def complete(request: Request, chat: bool):
        job = parse_job(m, await _body(request), chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if job.stream:
            return StreamingResponse(_sse(m, job, rid), media_type="text/event-stream")
        steps = [s async for s in steps_async(m, job)]
        finish = steps[-1].finish if steps else "length"
        return _reply(m, job, rid, _choice(m, job, steps, finish), False, _usage(job, len(steps)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _body(request)
        ids = prompt_ids(m, body.get("prompt") if isinstance(body, dict) else None)
        return {"tokens": ids.tolist(), "count": int(ids.numel()), "max_model_len": m.w.cfg.max_positions}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _body(request)
        ids = prompt_ids(m, body.get("tokens") if isinstance(body, dict) else None)
        return {"prompt": _text(m, ids.tolist())}

    return app


# ---------------------------------------------------------------------------------------------------------- main

def load_served(preset: str, checkpoint: str, kernels: str, schedule: Schedule, device: str, dtype: str,
                name: str = "", weights: str = "bf16", kv_dtype: str = "bf16") -> Served:
    """Load the model (``analysis.hashes.load_model``: a preset's synthetic weights or a checkpoint folder, the
    projections quantized as ``weights`` says); every request's KV cache stores ``kv_dtype``.

    Raises:
        ValueError: unknown preset, kernel set, device, dtype, weights setting or kv_dtype;
            checkpoint.CheckpointError: an unusable folder.
    """
    from ..analysis.hashes import load_model

    ks = get_set(kernels)
    KVFormat(kv_dtype)   # refuses an unknown name before the model loads
    w, tok = load_model(preset, device, dtype, checkpoint, weights)
    if tok is None and w.cfg.vocab_size == BYTE_VOCAB:
        tok = ByteTokenizer()
    return Served(name=name or w.cfg.name, w=w, tokenizer=tok, kernels=ks, schedule=schedule, kv_dtype=kv_dtype)


def build_parser() -> argparse.ArgumentParser:
    """Options of ``python -m exactness serve``."""
    p = argparse.ArgumentParser(prog="python -m exactness serve", description="Serve the reference engine "
                                "behind an OpenAI-compatible API (greedy only, one request at a time).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="tiny", help="synthetic preset (config.PRESETS; default %(default)s)")
    src.add_argument("--checkpoint", default="", help="local Hugging Face Qwen3-MoE folder (instead of a preset)")
    p.add_argument("--kernels", default="fast", help="kernel set: fast or invariant (default %(default)s)")
    p.add_argument("--path", default="decode", choices=PATHS, help="prefill path (default %(default)s)")
    p.add_argument("--step", type=int, default=None, help="prefill step in tokens (default: the whole prompt)")
    p.add_argument("--deep-threshold", type=int, default=512, help="rows from which deep segments run deep")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32 (default %(default)s)")
    p.add_argument("--weights", default="bf16", choices=WEIGHT_FORMATS,
                   help="projection weights: as stored or quantized (default %(default)s)")
    p.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES, help="what the KV cache stores (default "
                   "%(default)s)")
    p.add_argument("--served-model-name", default="", help="model name to serve (default: preset / folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Load the model and serve until interrupted. Returns 0, or 2 with the reason on stderr for bad options."""
    import uvicorn

    args = build_parser().parse_args(argv)
    try:
        sched = Schedule(args.path, args.step, args.deep_threshold)
        m = load_served(args.preset, args.checkpoint, args.kernels, sched, args.device, args.dtype,
                        args.served_model_name, args.weights, args.kv_dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving {m.name!r} ({m.fingerprint}) on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(create_app(m), host=args.host, port=args.port, log_level="warning")
    return 0
