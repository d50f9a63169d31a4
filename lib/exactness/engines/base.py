"""What an engine under test is to the suite: the :class:`Engine` protocol and what it returns.

An engine (our reference engine, a transformers model, an OpenAI-compatible server, llama.cpp) runs a prompt of
token ids greedily under one of its named :class:`Configuration` s and returns a :class:`run.Run`: the generated
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

from ..run import Run

# What an engine may expose; Engine.capabilities holds the ones it does.
CAPABILITIES = (
    "prompt_logits",   # Run.prompt_logits: one logit row per prompt token
    "gen_logits",      # Run.gen_logits: the logit row each generated token was chosen from
    "top_logprobs",    # Run.top_logprobs: the top-k log-probabilities of each generated token
    "kv_bytes",        # Run.kv: the KV cache as stored after the run
    "drafted",         # Engine.drafted: drafted (speculative / assisted) decoding
    "prompt_cache",    # Engine.resumed: a prompt resumed from a cached prefix
    "concurrent",      # Engine.concurrent: several requests at once
    "packed",          # several prompts prefilled in one forward (our engine's run_packed)
    "kernel_taps",     # every kernel call's inputs and output, reported to a recorder (our engine's tapping)
    "token_ids",       # prompts are taken as token ids (else as text, decoded from the ids by the engine's tokenizer)
    "chat",            # Engine.generate takes a Chat prompt as messages (a server's /v1/chat/completions, its template)
    "chat_template",   # Engine.encode_chat turns a Chat into token ids with the model's own chat template
    "prompt_logprobs", # Run.prompt_logprobs: the prompt tokens' logprobs (a server's echo / prompt_logprobs)
)

# Options open_engine fills from the profile (device ... deep_threshold), and profile fields an engine file may carry
# beside its adapter's own options: an adapter takes those it knows and ignores the rest of these.
PROFILE_OPTIONS = frozenset({"device", "dtype", "steps", "kernel_sets", "kernels", "preset", "deep_threshold",
                             "kv_dtype", "weights", "prompts", "gen_tokens", "profile", "prompt_max_tokens"})


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

    def generate(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """Greedy generation of ``gen_tokens`` tokens after ``prompt_ids`` under configuration ``config``.

        Raises:
            EngineError: the engine failed; ValueError: unknown configuration (names the known ones).
        """
        ...

    def drafted(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """Greedy generation with drafted decoding (a draft model, prompt lookup or MTP, verified by the engine).

        Raises:
            NotAvailable: the engine has no drafted decoding.
        """
        ...

    def resumed(self, prefix_ids: list[int], prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """Greedy generation after ``prompt_ids`` whose first ``len(prefix_ids)`` tokens come from a prompt cache
        filled by an earlier request for ``prefix_ids`` (a prefix of ``prompt_ids``).

        Raises:
            NotAvailable: the engine has no prompt cache it lets us fill and reuse.
        """
        ...

    def concurrent(self, prompts: list[list[int]], gen_tokens: int, config: str) -> list[Run]:
        """The prompts run at once (one batch, or concurrent requests); one Run each, in order.

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
