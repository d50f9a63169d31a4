"""What an engine under test is to the suite: the :class:`Engine` protocol and what it returns.

An engine (our reference engine, a transformers model, an OpenAI-compatible server, llama.cpp) runs a prompt of
token ids greedily under one of its named :class:`Configuration` s and returns a :class:`Generation`: the generated
token ids always, and the logit rows, top-k logprobs or KV-cache bytes where the engine exposes them (None where it
does not: never estimated, never faked). One configuration is the engine's oracle (token by token through the cache
where the engine has one, else the one its user names); the hash matrix compares every other configuration with it.

Optional abilities (drafted decoding, prompt-cache resume, concurrent requests) are methods that raise
:class:`NotAvailable` with the reason where the engine cannot do them; the analyses record that reason in the receipt
("not available from this engine: ...") instead of a verdict.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

# What an engine may expose; Engine.capabilities holds the ones it does.
CAPABILITIES = (
    "prompt_logits",   # Generation.prompt_logits: one logit row per prompt token
    "gen_logits",      # Generation.gen_logits: the logit row each generated token was chosen from
    "top_logprobs",    # Generation.top_logprobs: the top-k log-probabilities of each generated token
    "kv_bytes",        # Generation.kv: the KV cache as stored after the run
    "drafted",         # Engine.drafted: drafted (speculative / assisted) decoding
    "prompt_cache",    # Engine.resumed: a prompt resumed from a cached prefix
    "concurrent",      # Engine.concurrent: several requests at once
    "token_ids",       # prompts are taken as token ids (else as text, decoded from the ids by the engine's tokenizer)
    "chat",            # Engine.generate takes a Chat prompt as messages (a server's /v1/chat/completions, its template)
    "chat_template",   # Engine.encode_chat turns a Chat into token ids with the model's own chat template
    "prompt_logprobs", # Generation.prompt_logprobs: the prompt tokens' logprobs (a server's echo / prompt_logprobs)
)


class NotAvailable(RuntimeError):
    """An ability the engine lacks; the message says why (it goes into the receipt as is)."""


class EngineError(RuntimeError):
    """An engine that failed to answer (refused connection, timeout, a server that died, a malformed reply); the
    message names the engine, the configuration and what went wrong."""


@dataclass(frozen=True)
class Chat:
    """A chat prompt: ``messages`` is a tuple of (role, content) string pairs, in order.

    An engine with the ``chat`` capability takes it as is (``generate(Chat(...), ...)``: the server applies its own
    template); one with ``chat_template`` turns it into ids with ``encode_chat``; any other engine is given the ids of
    ``prompts.plain_chat_text(chat)`` (the plain template, named in the receipt row).
    """

    messages: tuple

    def __post_init__(self):
        ok = isinstance(self.messages, tuple) and self.messages and all(
            isinstance(m, tuple) and len(m) == 2 and all(isinstance(x, str) for x in m) for m in self.messages)
        if not ok:
            raise ValueError(f"a chat prompt is a non-empty tuple of (role, content) string pairs, got "
                             f"{self.messages!r}")

    def as_json(self) -> list[dict]:
        """[{"role": ..., "content": ...}, ...] as the OpenAI chat API takes them."""
        return [{"role": r, "content": c} for r, c in self.messages]


@dataclass(frozen=True)
class Configuration:
    """One named way of running an engine.

    Attributes:
        name: unique within the engine, used in every run row (e.g. ``token-by-token``, ``one-forward``,
            ``chunk-7``, ``n_ubatch-512``, ``deep-on``).
        settings: what the configuration sets, JSON-ready (e.g. ``{"chunk": 7}``, ``{"n_ubatch": 512}``,
            ``{"base_url": "http://127.0.0.1:8000/v1"}``); recorded in receipt.json as is.
    """

    name: str
    settings: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"a configuration name must be a non-empty string without spaces, got {self.name!r}")


@dataclass
class Generation:
    """What an engine returned for one prompt under one configuration.

    Attributes:
        config: the configuration's name.
        gen_ids: [G] int64, the greedily generated token ids (end of sequence not a stop where the engine allows).
        prompt_logits: [P, V] float32 (exactly upcast from the engine's dtype) or None where not exposed.
        gen_logits: [G, V] float32 or None.
        top_logprobs: per generated token, a list of (token id, logprob) pairs, best first, or None.
        kv: the KV cache as stored after the run, one tensor per layer and K/V (their bytes are compared), or None.
        ttft_s: seconds from the request to the first generated token; decode_s: seconds of the other G-1.
        token_times: seconds from the request to each generated token (len G), or None.
        info: anything else the engine reports about the run (served plans, acceptance), JSON-ready.
        greedy: whether every generated token was checked to be the top-1 of its row: True, False (the first
            offending position in ``info["greedy_check"]``), or None where not checked (an engine that picks by
            argmax itself, or a server that sent no logprobs).
        prompt_logprobs: [R, 1+N] float64, per prompt token after the first: its logprob, then the top-N logprobs
            (-inf padding), as a server returned them; None where not exposed.
        prompt_logprob_ids: [R, 1+N] int64, the matching token ids (-1 where the server named a token by text only).
    """

    config: str
    gen_ids: torch.Tensor
    prompt_logits: torch.Tensor | None = None
    gen_logits: torch.Tensor | None = None
    top_logprobs: list | None = None
    kv: list[torch.Tensor] | None = None
    ttft_s: float = 0.0
    decode_s: float = 0.0
    token_times: list[float] | None = None
    info: dict = field(default_factory=dict)
    greedy: bool | None = None
    prompt_logprobs: torch.Tensor | None = None
    prompt_logprob_ids: torch.Tensor | None = None


@runtime_checkable
class Engine(Protocol):
    """An engine under test. Adapters: engines/reference.py (ours), engines/hf.py (transformers),
    engines/openai.py (any OpenAI-compatible server), engines/llamacpp.py (llama-cpp-python).

    Attributes:
        kind: ``reference``, ``transformers``, ``openai``, ``llamacpp``.
        oracle: the name of the configuration every other one is compared with.
        capabilities: the subset of CAPABILITIES this engine has.
    """

    kind: str
    oracle: str
    capabilities: frozenset

    def identity(self) -> dict:
        """JSON-ready: kind, version of the engine's software, model identity (config and weights SHA-256 where the
        files are local, the served model name otherwise), device, dtype, and each configuration's settings."""
        ...

    def configurations(self) -> list[Configuration]:
        """The configurations this engine is run under, the oracle among them."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the engine's tokenizer (the byte tokenizer where the model has none)."""
        ...

    def generate(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Generation:
        """Greedy generation of ``gen_tokens`` tokens after ``prompt_ids`` under configuration ``config``.

        Raises:
            EngineError: the engine failed; ValueError: unknown configuration (names the known ones).
        """
        ...

    def drafted(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Generation:
        """Greedy generation with drafted decoding (a draft model, prompt lookup or MTP, verified by the engine).

        Raises:
            NotAvailable: the engine has no drafted decoding.
        """
        ...

    def resumed(self, prefix_ids: list[int], prompt_ids: list[int], gen_tokens: int, config: str) -> Generation:
        """Greedy generation after ``prompt_ids`` whose first ``len(prefix_ids)`` tokens come from a prompt cache
        filled by an earlier request for ``prefix_ids`` (a prefix of ``prompt_ids``).

        Raises:
            NotAvailable: the engine has no prompt cache it lets us fill and reuse.
        """
        ...

    def concurrent(self, prompts: list[list[int]], gen_tokens: int, config: str) -> list[Generation]:
        """The prompts run at once (one batch, or concurrent requests); one Generation each, in order.

        Raises:
            NotAvailable: the engine cannot run requests together.
        """
        ...

    def close(self) -> None:
        """Release what the engine holds (servers the suite started are stopped by their own PID)."""
        ...


def check_config(engine: Engine, config: str) -> None:
    """Raise ValueError unless ``config`` names one of the engine's configurations (the message lists them)."""
    names = [c.name for c in engine.configurations()]
    if config not in names:
        raise ValueError(f"engine {engine.kind!r} has no configuration {config!r}; it has: {', '.join(names)}")


def byte_ids(text: str, vocab: int, bos: int | None = None) -> list[int]:
    """The byte tokenizer's ids of ``text`` (UTF-8 bytes, BOS first where given), for models without a tokenizer.

    Raises:
        ValueError: the vocabulary is too small for byte ids (< 256, or the BOS id out of range).
    """
    if vocab < 256 or (bos is not None and not 0 <= bos < vocab):
        raise ValueError(f"the byte tokenizer needs a vocabulary of at least 256 ids (and BOS inside it); "
                         f"this model has {vocab} (bos {bos})")
    return ([bos] if bos is not None else []) + list(text.encode("utf-8"))
