"""The wire side of ``exactness serve``: request bodies -> serve_batch.Job, and the OpenAI / vLLM reply formats.

Greedy only. Every knob that can move greedy decoding is accepted at its neutral value and refused (400 naming the
key, the value and what is allowed) at any other (NEUTRAL); ``seed`` is any int (greedy ignores it); ``stop`` is
refused. Formats (``m`` the served model, ``name(id)`` the token's text, or ``token_id:<id>`` with
``return_tokens_as_token_ids: true``):

    completions logprobs=N   choice.logprobs = {tokens, token_logprobs, top_logprobs (N each), text_offset}
    echo: true               non-streamed only (with stream: 400): choice.text starts with the prompt's text and
                             logprobs lists the prompt tokens first (the first has token_logprobs and top_logprobs
                             None), then the generated ones; max_tokens 0 returns the prompt part only
    prompt_logprobs=N        vLLM's: choice.prompt_logprobs = [None, {"<id>": {logprob, rank, decoded_token}, ...}]:
                             per prompt token after the first, the token itself then the top-N (rank 1 = best); in
                             the non-streamed choice and in the first streamed chunk's choice (chat: also top level)
    chat logprobs: true      choice.logprobs.content = [{token, logprob, bytes, top_logprobs: [{token, logprob,
      + top_logprobs=N       bytes}]}]; bytes = UTF-8 bytes of the token's text (byte tokenizer: the token's byte)

Prompt-token logprobs are log_softmax of the fp32 prompt logit row before each token as the served prefill computed
it, written as the Python float of the fp32 value (JSON keeps it exact). Every log_softmax runs on the served device
(a CUDA log_softmax may differ from the CPU one in the last bit: compare with one computed on the same device).
Chat messages are rendered with the served tokenizer's chat template where it has one (``exactness_template:
"chat_template"``), else prompts.plain_chat_text (``"plain"``).
"""
from __future__ import annotations

import json
import math
import time

import torch

from ..prompts import plain_chat_text
from .serve_batch import Job, PromptRows, Step

# key -> (allowed values, what the message says is allowed); None is taken as absent everywhere
NEUTRAL = {
    "temperature": ((0,), "0"), "top_p": ((1,), "1"), "top_k": ((-1, 0), "-1 or 0 (off)"), "min_p": ((0,), "0"),
    "typical_p": ((1,), "1"), "tfs_z": ((1,), "1"), "repetition_penalty": ((1,), "1"), "repeat_penalty": ((1,), "1"),
    "presence_penalty": ((0,), "0"), "frequency_penalty": ((0,), "0"), "mirostat": ((0,), "0"),
    "mirostat_mode": ((0,), "0"), "n": ((1,), "1"), "best_of": ((1,), "1"),
}


class RequestError(ValueError):
    """A request refused with an HTTP status (400 bad value, 404 unknown model); the message names the value."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def _int(body: dict, key: str, default, lo: int, hi: int):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(f"{key} must be an int in [{lo}, {hi}], got {v!r}", key)
    return v


def check_greedy(body: dict) -> None:
    """Refuse every non-neutral sampling knob (NEUTRAL), a non-int seed, stop strings and a logit bias."""
    for key, (ok, say) in NEUTRAL.items():
        v = body.get(key)
        num = isinstance(v, (int, float)) and not isinstance(v, bool)
        if v is not None and not (num and math.isfinite(v) and v in ok):
            raise RequestError(f"{key} must be {say} (this server decodes greedily only), got {v!r}", key)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"seed must be an int (greedy decoding ignores it), got {seed!r}", "seed")
    if body.get("stop"):
        raise RequestError(f"stop sequences are not supported, got {body['stop']!r}", "stop")
    if body.get("logit_bias"):
        raise RequestError(f"logit_bias must be empty (greedy decoding), got {body['logit_bias']!r}", "logit_bias")


def prompt_ids(m, prompt) -> torch.Tensor:
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


def chat_ids(m, msgs) -> tuple[torch.Tensor, str]:
    """Chat messages -> (ids [P] int64, the template used: "chat_template" or "plain").

    Raises:
        RequestError: messages not a non-empty list of {role, content} strings; no tokenizer.
    """
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(x, dict) and isinstance(x.get("role"), str) and isinstance(x.get("content"), str)
            for x in msgs):
        raise RequestError("messages must be a non-empty list of {role: string, content: string}", "messages")
    hf = getattr(m.tokenizer, "tok", None)
    if hf is not None and getattr(hf, "chat_template", None):
        out = hf.apply_chat_template([{"role": x["role"], "content": x["content"]} for x in msgs],
                                     add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return torch.tensor(list(ids), dtype=torch.int64), "chat_template"
    return prompt_ids(m, plain_chat_text(msgs)), "plain"


def parse_job(m, body, chat: bool = False) -> Job:
    """A completions (or chat) request body -> Job (formats in the module docstring).

    Raises:
        RequestError: a body that is not an object, another model's name (404), a non-greedy setting, a bad prompt,
            echo with stream, max_tokens / logprobs out of range, prompt + max_tokens past max_model_len.
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    if body.get("model") not in (None, m.name):
        raise RequestError(f"model {body['model']!r} is not served here; served: {m.name!r}", "model", 404)
    check_greedy(body)
    V, stream = m.w.cfg.vocab_size, bool(body.get("stream", False))
    template, echo = None, bool(body.get("echo", False))
    if chat:
        ids, template = chat_ids(m, body.get("messages"))
        top = _int(body, "top_logprobs", None, 0, V)
        if top is not None and body.get("logprobs") is not True:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if body.get("logprobs") is True else None
        echo = False
    else:
        ids = prompt_ids(m, body.get("prompt"))
        logprobs = _int(body, "logprobs", None, 0, V)
    if echo and stream:
        raise RequestError("echo is served on non-streamed requests only (stream: false)", "echo")
    if chat and body.get("max_tokens") is None:   # the chat API's newer name
        body = {**body, "max_tokens": body.get("max_completion_tokens")}
    P = int(ids.numel())
    if P >= m.max_model_len:
        raise RequestError(f"prompt of {P} tokens leaves no room in max_model_len={m.max_model_len}", "prompt")
    plp = _int(body, "prompt_logprobs", None, 0, V)
    tops = [n for n in (plp, logprobs if echo else None) if n is not None]
    return Job(ids=ids, max_tokens=_int(body, "max_tokens", 16, 0, m.max_model_len - P), logprobs=logprobs,
               ignore_eos=bool(body.get("ignore_eos", False)), prompt_top=max(tops) if tops else None,
               stream=stream, id_strings=bool(body.get("return_tokens_as_token_ids", False)), chat=chat, echo=echo,
               prompt_logprobs=plp, template=template)


# ------------------------------------------------------------------------------------------------------- replies

def text(m, ids: list[int]) -> str:
    return m.tokenizer.decode(ids) if m.tokenizer is not None else ""


def _name(m, job: Job):
    return (lambda i: f"token_id:{i}") if job.id_strings else (lambda i: text(m, [i]))


def _token_bytes(m, i: int) -> list[int]:
    if m.tokenizer is not None and m.tokenizer.__class__.__name__ == "ByteTokenizer":
        return [i] if 0 <= i < 256 else []
    return list(text(m, [i]).encode("utf-8"))


def _keyed(name, top: list) -> dict:
    """[(id, logprob)] best first -> {name(id): logprob}; where names collide (token texts: every lone byte of a
    multi-byte character is U+FFFD) the best logprob keeps the key."""
    out = {}
    for i, v in top:
        out.setdefault(name(i), v)
    return out


def legacy_logprobs(m, job: Job, steps: list[Step], rows: PromptRows | None, offset: int = 0) -> dict | None:
    """The completions ``logprobs`` object: with echo the prompt tokens first, then ``steps``' tokens."""
    if job.logprobs is None:
        return None
    name, N = _name(m, job), job.logprobs
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(tok, lp, top):
        out["tokens"].append(name(tok))
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if top is None else _keyed(name, top[:N]))
        out["text_offset"].append(offset)
        return offset + len(text(m, [tok]))
    if job.echo and rows is not None:
        ids = job.ids.tolist()
        offset = add(ids[0], None, None)
        for k, tok in enumerate(ids[1:]):
            offset = add(tok, rows.logprob[k], rows.top[k])
    for s in steps:
        offset = add(s.token, s.logprobs[0], s.logprobs[1])
    return out


def vllm_prompt_logprobs(m, job: Job, rows: PromptRows) -> list:
    """vLLM's prompt_logprobs: [None, {"<id>": {"logprob", "rank", "decoded_token"}, ...} per later token]."""
    name, N, ids = _name(m, job), job.prompt_logprobs, job.ids.tolist()
    out: list = [None]
    for k, tok in enumerate(ids[1:]):
        d = {str(tok): {"logprob": rows.logprob[k], "rank": rows.rank[k], "decoded_token": name(tok)}}
        for r, (i, v) in enumerate(rows.top[k][:N]):
            d.setdefault(str(i), {"logprob": v, "rank": r + 1, "decoded_token": name(i)})
        out.append(d)
    return out


def chat_logprobs(m, job: Job, steps: list[Step]) -> dict | None:
    """The chat ``logprobs`` object: {"content": [{token, logprob, bytes, top_logprobs}]} of ``steps``."""
    if job.logprobs is None:
        return None
    name = _name(m, job)
    entry = (lambda i, v: {"token": name(i), "logprob": v, "bytes": _token_bytes(m, i)})
    return {"content": [{**entry(s.token, s.logprobs[0]), "top_logprobs": [entry(i, v) for i, v in s.logprobs[1]]}
                        for s in steps]}


def choice(m, job: Job, steps: list[Step], finish: str | None, rows: PromptRows | None = None, offset: int = 0,
           delta: bool = False) -> dict:
    """One choice of ``steps`` (rows: the prompt logprobs, given to the first reply of a run only)."""
    ids = [s.token for s in steps]
    if job.chat:
        out = {"index": 0, "delta" if delta else "message": {"role": "assistant", "content": text(m, ids)},
               "logprobs": chat_logprobs(m, job, steps), "token_ids": ids, "finish_reason": finish}
    else:
        head = text(m, job.ids.tolist()) if job.echo else ""
        out = {"index": 0, "text": head + text(m, ids), "token_ids": ids,
               "logprobs": legacy_logprobs(m, job, steps, rows, offset), "finish_reason": finish}
    if rows is not None and job.prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(m, job, rows)
    return out


def reply(m, job: Job, rid: str, ch: dict | None, chunk: bool, usage: dict | None = None) -> dict:
    """A reply (or streamed chunk) around choice ``ch``; ``usage`` marks the last reply of a run, which carries
    ``exactness_served`` (the prefill plans that ran)."""
    kind = "chat.completion" if job.chat else "text_completion"
    out = {"id": rid, "object": kind + (".chunk" if chunk and job.chat else ""), "created": int(time.time()),
           "model": m.name, "system_fingerprint": m.fingerprint, "choices": [ch] if ch else []}
    if job.template:
        out["exactness_template"] = job.template
    if job.chat and ch and "prompt_logprobs" in ch:
        out["prompt_logprobs"] = ch["prompt_logprobs"]   # where vLLM's chat replies carry it
    if usage is not None:
        out["usage"] = usage
        out["exactness_served"] = job.served
    return out


def usage(job: Job, n: int) -> dict:
    P = int(job.ids.numel())
    return {"prompt_tokens": P, "completion_tokens": n, "total_tokens": P + n}


def data(obj: dict) -> str:
    return "data: " + json.dumps(obj) + "\n\n"
