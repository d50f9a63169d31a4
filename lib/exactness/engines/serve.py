"""``python -m exactness serve``: our reference engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn),
with continuous batching.

    GET  /v1/models             the served model (its name, max_model_len, max_batch)
    POST /v1/completions        prompt as token ids or a string; greedy only; stream or not; logprobs=N; echo;
                                prompt_logprobs=N
    POST /v1/chat/completions   messages rendered with the tokenizer's chat template (else the plain template);
                                logprobs + top_logprobs in the OpenAI chat format; prompt_logprobs=N
    POST /tokenize, /detokenize text <-> ids with the served tokenizer (the request shapes vLLM uses)
    GET  /exactness/stats       the scheduler's counters (max_batch, largest decode batch run, forwards, queue)

Requests are batched continuously (serve_batch): one scheduler thread owns one KV cache of ``--max-batch`` slots
of ``--max-model-len`` positions; a new request's prefill (``paths.prefill`` on the configured Schedule, into a free
slot) runs between decode steps, and every decode step runs all active requests as ONE decode forward of the
greedy loop every run kind shares (loop.Loop); requests beyond the free slots wait in arrival order. With the
invariant kernel set a served run's tokens and logprobs equal ``paths.generate(w, ids, max_tokens, kernels,
Schedule(path, step, deep_threshold))``'s under any load (while end-of-sequence is ignored: ``ignore_eos: true``;
otherwise the reply stops after the EOS token, finish_reason ``stop``); with the fast set a request's bytes may
depend on the requests batched with it.

Greedy only; the accepted knobs, the logprob formats (``token_ids`` in each choice, ``token_id:<id>`` names with
``return_tokens_as_token_ids: true``, legacy echo, vLLM's prompt_logprobs, chat logprobs) are in serve_api.
Log-probabilities are ``log_softmax`` of the fp32 logit row the token was chosen from (prompt tokens: the prompt row
before each). The last reply of a run (the non-streamed reply, or the streamed chunk with ``usage``) carries
``exactness_served``: plan -> segments and rows the prefill actually ran (so a deep configuration that never ran
deep shows). A streaming client that disconnects leaves the batch at the next step, freeing its slot.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..cache import KV_DTYPES, KVFormat
from ..config import BYTE_VOCAB
from ..kernels import KernelSet, get_set
from ..kernels.quant import WEIGHT_FORMATS
from ..paths import PATHS, Schedule
from ..tokenizer import ByteTokenizer
from ..weights import Weights, weights_format
from .serve_api import RequestError, choice, data, parse_job, prompt_ids, reply, text, usage
from .serve_batch import END, Job, PromptRows, Scheduler

MAX_BATCH = 8             # default decode slots
MAX_MODEL_LEN = 32768     # default positions per slot, at most the model's max_positions


@dataclass
class Served:
    """The served model and how it runs.

    Attributes:
        name: the model name /v1/models reports and requests may name.
        w: the weights; tokenizer: encodes string prompts (None: only token-id prompts are taken).
        kernels: the kernel set; schedule: prefill path, step and deep threshold.
        kv_dtype: what the KV cache stores (cache.KV_DTYPES).
        max_batch: KV-cache slots (requests decoded in one forward); max_model_len: positions per slot (prompt +
            generated tokens; None: the model's max_positions, at most MAX_MODEL_LEN).
        scheduler: the batching thread and its cache (serve_batch.Scheduler), made here.
    Raises:
        ValueError: max_batch < 1, max_model_len outside 1..max_positions.
    """

    name: str
    w: Weights
    tokenizer: object | None
    kernels: KernelSet
    schedule: Schedule
    kv_dtype: str = "bf16"
    max_batch: int = MAX_BATCH
    max_model_len: int | None = None
    scheduler: Scheduler = field(init=False, repr=False)

    def __post_init__(self):
        top = self.w.cfg.max_positions
        self.max_model_len = min(top, MAX_MODEL_LEN) if self.max_model_len is None else self.max_model_len
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1 (decode slots), got {self.max_batch!r}")
        if not 1 <= self.max_model_len <= top:
            raise ValueError(f"max_model_len must be in 1..{top} (the model's max_positions), got "
                             f"{self.max_model_len!r}")
        self.scheduler = Scheduler(self.w, self.kernels, self.schedule, self.kv_dtype, self.max_batch,
                                   self.max_model_len)

    @property
    def fingerprint(self) -> str:
        """``system_fingerprint`` of every reply: kernel set, path, step, deep threshold, dtype, device, max batch,
        then the weights setting and KV-cache dtype."""
        s = self.schedule
        return (f"exactness:{self.kernels.name}:{s.path}:{s.step or 'all'}:{s.deep_threshold}:"
                f"{str(self.w.dtype).removeprefix('torch.')}:{self.w.device}:max_batch={self.max_batch}:"
                f"{weights_format(self.w)}:{self.kv_dtype}")


async def run_async(m: Served, job: Job):
    """The items of ``job`` (PromptRows when asked, then Steps) as an async iterator, computed by the scheduler;
    closing it early (a client gone) makes the request leave the batch at the next step. An exception of the run
    is raised here."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    held = []

    def emit(item):
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:   # the event loop is gone: nobody reads this request any more
            for r in held:
                r.cancel()
    held.append(m.scheduler.submit(job, emit))
    try:
        while (item := await q.get()) is not END:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        held[0].cancel()


async def _sse(m: Served, job: Job, rid: str):
    """Server-sent events: one ``data: {chunk}`` per token (the first also carrying prompt_logprobs when asked;
    with max_tokens 0 one chunk carries them alone), a usage chunk, then ``data: [DONE]``; a run that fails after
    the first byte sends ``data: {"error": ...}`` instead of [DONE]."""
    n, offset, rows = 0, 0, None
    try:
        async for s in run_async(m, job):
            if isinstance(s, PromptRows):
                rows = s
                continue
            yield data(reply(m, job, rid, choice(m, job, [s], s.finish, rows, offset, True), True))
            n, offset, rows = n + 1, offset + len(text(m, [s.token])), None
        if rows is not None:
            yield data(reply(m, job, rid, choice(m, job, [], "length", rows, 0, True), True))
        yield data(reply(m, job, rid, None, True, usage(job, n)))
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 -- the status line is already sent; the client reads the error event
        yield data({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})


async def _complete(m: Served, job: Job, rid: str) -> dict:
    rows, steps = None, []
    async for s in run_async(m, job):
        if isinstance(s, PromptRows):
            rows = s
        else:
            steps.append(s)
    finish = steps[-1].finish if steps else "length"
    return reply(m, job, rid, choice(m, job, steps, finish, rows), False, usage(job, len(steps)))


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
                                            "max_model_len": m.max_model_len, "max_batch": m.max_batch}]}

    @app.get("/exactness/stats")
    async def stats():
        s = m.scheduler
        return {"max_batch": m.max_batch, "max_rows": s.max_rows, "decode_forwards": s.decode_forwards,
                "active": len(s.active), "waiting": len(s.waiting)}

    async def complete(request: Request, chat: bool):
        job = parse_job(m, await _body(request), chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if job.stream:
            return StreamingResponse(_sse(m, job, rid), media_type="text/event-stream")
        return await _complete(m, job, rid)

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
        return {"tokens": ids.tolist(), "count": int(ids.numel()), "max_model_len": m.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _body(request)
        ids = prompt_ids(m, body.get("tokens") if isinstance(body, dict) else None)
        return {"prompt": text(m, ids.tolist())}

    return app


# ---------------------------------------------------------------------------------------------------------- main

def load_served(preset: str, checkpoint: str, kernels: str, schedule: Schedule, device: str, dtype: str,
                name: str = "", weights: str = "bf16", kv_dtype: str = "bf16", max_batch: int = MAX_BATCH,
                max_model_len: int | None = None) -> Served:
    """Load the model (``checkpoint.load_model``: a preset's synthetic weights or a checkpoint folder, the
    projections quantized as ``weights`` says); the KV cache stores ``kv_dtype`` and has ``max_batch`` slots of
    ``max_model_len`` positions (Served).

    Raises:
        ValueError: unknown preset, kernel set, device, dtype, weights setting or kv_dtype; a bad max_batch or
            max_model_len;
            checkpoint.CheckpointError: an unusable folder.
    """
    from ..checkpoint import load_model

    ks = get_set(kernels)
    KVFormat(kv_dtype)   # refuses an unknown name before the model loads
    w, tok = load_model(preset, device, dtype, checkpoint, weights)
    if tok is None and w.cfg.vocab_size == BYTE_VOCAB:
        tok = ByteTokenizer()
    return Served(name=name or w.cfg.name, w=w, tokenizer=tok, kernels=ks, schedule=schedule, kv_dtype=kv_dtype,
                  max_batch=max_batch, max_model_len=max_model_len)


def build_parser() -> argparse.ArgumentParser:
    """Options of ``python -m exactness serve``."""
    p = argparse.ArgumentParser(prog="python -m exactness serve", description="Serve the reference engine "
                                "behind an OpenAI-compatible API (greedy only, continuous batching: every decode "
                                "step runs the active requests as one forward; a new request's prefill joins between "
                                "steps).")
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
    p.add_argument("--max-batch", type=int, default=MAX_BATCH, help="KV-cache slots: most requests decoded in "
                   "one forward; more wait in arrival order; 1 serves one at a time (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, help="positions per slot, prompt + generated "
                   f"tokens (default: the model's max_positions, at most {MAX_MODEL_LEN})")
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
                        args.served_model_name, args.weights, args.kv_dtype, args.max_batch, args.max_model_len)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving {m.name!r} ({m.fingerprint}) on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(create_app(m), host=args.host, port=args.port, log_level="warning")
    return 0
