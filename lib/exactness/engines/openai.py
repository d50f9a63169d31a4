"""The ``openai`` engine: any OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, ``python -m exactness
serve``), spoken to over HTTP with httpx, one streamed ``/v1/completions`` request per generation.

Spec: ``openai:http://127.0.0.1:8000/v1``, or a YAML engine file with these options:

    configurations   list of {name, base_url} or {name, launch: "command with {port}"}; a launched server is
                     started by the suite (the command split like a shell line, run without a shell, {port} a free
                     local port), waited for until GET /v1/models answers, and stopped by its own PID at close().
                     Default: one configuration ``server`` at the target URL.
    oracle           the configuration every other one is compared with (default: the first)
    model            the served model name (default: the first one each server's /v1/models lists)
    timeout_s        seconds allowed for connecting and between two reads of a reply (default 60)
    launch_timeout_s seconds a launched server has to answer /v1/models (default 120)
    token_ids        send prompts as token ids (default true); false sends the text the server's /detokenize gives
                     (exact only where the tokenizer round-trips the ids: ``generate`` cannot tell)
    top_logprobs     top-N log-probabilities asked per generated token (default 5; 0 asks none)

Keys of the run profiles (device, dtype, steps, ...) that ``open_engine`` passes to every adapter do not apply to a
server and are ignored; any other key is refused.

What a server exposes: the generated ids (the ``token_ids`` of each choice, vLLM's and SGLang's
``return_token_ids``; ``ignore_eos`` is sent so end-of-sequence is not a stop), the top-N log-probabilities with
exact ids where the server names tokens ``token_id:<id>`` (``return_tokens_as_token_ids``), and the time of each
streamed chunk. Not exposed: prompt logits, the gen logit rows and the KV cache (those capabilities are absent).
A server that returns text only: ``gen_ids`` then holds the UTF-8 bytes of the returned text (one int per byte, so
configurations still compare exactly, as texts) and ``info["gen_ids_are"]`` says so; top-N logprobs keyed by token
strings cannot be mapped to ids and are recorded as None with the reason in ``info``.

Drafted decoding and prompt-cache resume are properties of how a server was launched, not of a request: they are
available only where a configuration is named ``drafted`` (drafted() runs on it) or ``resumed`` (resumed() sends
the prefix there, then the prompt; whether the server reused its cache is its own business, its ``usage`` is kept
in ``info``). ``concurrent`` sends N requests at once from N threads.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from ..exact import token_hash
from .base import Configuration, EngineError, Generation, NotAvailable, check_config
from .openai_http import Endpoint, Reply, launch, stop, stream_completion

OPTIONS = ("configurations", "oracle", "model", "timeout_s", "launch_timeout_s", "token_ids", "top_logprobs")


def _endpoints(target: str, raw) -> list[Endpoint]:
    """The configurations option (or the target URL alone) -> Endpoints. Raises ValueError naming a bad entry."""
    if raw is None:
        if not target.startswith(("http://", "https://")):
            raise ValueError(f"openai engine: target must be a base URL like http://127.0.0.1:8000/v1, got "
                             f"{target!r} (or give configurations)")
        return [Endpoint("server", base_url=target.rstrip("/"), settings={"base_url": target.rstrip("/")})]
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"openai engine: configurations must be a non-empty list, got {raw!r}")
    out = []
    for c in raw:
        ok = isinstance(c, dict) and set(c) in ({"name", "base_url"}, {"name", "launch"})
        if not ok or not all(isinstance(v, str) and v for v in c.values()):
            raise ValueError(f"openai engine: each configuration is {{name, base_url}} or {{name, launch}} "
                             f"(non-empty strings), got {c!r}")
        Configuration(c["name"])   # validates the name
        if "launch" in c and "{port}" not in c["launch"]:
            raise ValueError(f"openai engine: the launch command of {c['name']!r} must contain {{port}}, got "
                             f"{c['launch']!r}")
        out.append(Endpoint(c["name"], base_url=c.get("base_url", "").rstrip("/"), launch=c.get("launch", ""),
                            settings=dict(c)))
    names = [e.name for e in out]
    if len(set(names)) != len(names):
        raise ValueError(f"openai engine: configuration names must be unique, got {names}")
    return out


def _seconds(options: dict, key: str, default: float) -> float:
    v = options.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"openai engine: {key} must be a positive number of seconds, got {v!r}")
    return float(v)


def _common_keys() -> set:
    from ..receipt.profiles import PROFILES
    return {k for p in PROFILES.values() for k in p.parameters()}


# --------------------------------------------------------------------------------------------------------- engine

class OpenAIEngine:
    """An OpenAI-compatible server (or several, one per configuration); options in the module docstring.

    Raises (from_spec):
        ValueError: an unknown option (names the allowed ones), a bad configuration entry, an unknown oracle.
        EngineError: a launched server that does not come up (servers already started are stopped).
    """

    kind = "openai"

    def __init__(self, endpoints: list[Endpoint], oracle: str, model: str, timeout_s: float, token_ids: bool,
                 top_logprobs: int):
        self.endpoints = {e.name: e for e in endpoints}
        self.oracle, self.model, self.timeout_s = oracle, model, timeout_s
        self.token_ids, self.top_n = token_ids, top_logprobs
        caps = {"concurrent"} | ({"top_logprobs"} if top_logprobs else set()) | ({"token_ids"} if token_ids else set())
        caps |= {"drafted"} if "drafted" in self.endpoints else set()
        caps |= {"prompt_cache"} if "resumed" in self.endpoints else set()
        self.capabilities = frozenset(caps)

    @classmethod
    def from_spec(cls, target: str, options: dict) -> "OpenAIEngine":
        """The engine of ``openai:TARGET`` with the YAML file's ``options`` (see the module docstring)."""
        extra = set(options) - set(OPTIONS) - _common_keys()
        if extra:
            raise ValueError(f"openai engine: unknown options {sorted(extra)}; allowed: {', '.join(OPTIONS)}")
        eps = _endpoints(target, options.get("configurations"))
        names = [e.name for e in eps]
        oracle = options.get("oracle", names[0])
        if oracle not in names:
            raise ValueError(f"openai engine: oracle {oracle!r} is not a configuration; configurations: {names}")
        timeout_s, wait_s = _seconds(options, "timeout_s", 60.0), _seconds(options, "launch_timeout_s", 120.0)
        top_n, token_ids = options.get("top_logprobs", 5), options.get("token_ids", True)
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
            raise ValueError(f"openai engine: top_logprobs must be an int >= 0, got {top_n!r}")
        if not isinstance(token_ids, bool):
            raise ValueError(f"openai engine: token_ids must be true or false, got {token_ids!r}")
        eng = cls(eps, oracle, str(options.get("model") or ""), timeout_s, token_ids, top_n)
        try:
            for e in eps:
                if e.launch:
                    launch(e, wait_s)
        except BaseException:
            eng.close()
            raise
        return eng

    # ---- protocol

    def identity(self) -> dict:
        """Kind, client version, served model name(s) and fingerprints seen, each configuration's settings."""
        return {"kind": self.kind, "version": f"httpx {httpx.__version__}", "model": self.model or None,
                "served_models": {n: e.model or None for n, e in self.endpoints.items()},
                "system_fingerprints": {n: e.fingerprint for n, e in self.endpoints.items()},
                "device": "server", "dtype": None, "oracle": self.oracle,
                "configurations": {n: {**e.settings, "base_url": e.base_url} for n, e in self.endpoints.items()}}

    def configurations(self) -> list[Configuration]:
        """One configuration per server, as given."""
        return [Configuration(n, {**e.settings, "base_url": e.base_url}) for n, e in self.endpoints.items()]

    def _root(self, ep: Endpoint) -> str:
        return ep.base_url.removesuffix("/v1")

    def _post(self, ep: Endpoint, url: str, body: dict, key: str):
        """POST ``body`` and return ``key`` of the JSON reply. Raises EngineError naming what went wrong."""
        try:
            resp = httpx.post(url, json=body, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise EngineError(f"{ep.where()}: {url}: {type(e).__name__}: {e}") from None
        if resp.status_code >= 400:
            raise EngineError(f"{ep.where()}: HTTP {resp.status_code} from {url}: {resp.text[:500]}")
        try:
            return resp.json()[key]
        except (ValueError, KeyError, TypeError):
            raise EngineError(f"{ep.where()}: {url} answered without {key!r}: {resp.text[:300]}") from None

    def model_of(self, ep: Endpoint) -> str:
        """The model name requests to ``ep`` carry: the option, else the first of its /v1/models (asked once)."""
        if self.model or ep.model:
            return self.model or ep.model
        try:
            resp = httpx.get(ep.base_url + "/models", timeout=self.timeout_s)
            ep.model = resp.json()["data"][0]["id"]
        except httpx.HTTPError as e:
            raise EngineError(f"{ep.where()}: GET {ep.base_url}/models: {type(e).__name__}: {e}") from None
        except (ValueError, KeyError, IndexError, TypeError):
            raise EngineError(f"{ep.where()}: GET {ep.base_url}/models did not list a model (status "
                              f"{resp.status_code}): {resp.text[:300]}") from None
        return ep.model

    def encode(self, text: str) -> list[int]:
        """The oracle server's ids of ``text``: POST /tokenize (vLLM, SGLang, ``exactness serve``), else
        /extras/tokenize (llama.cpp's Python server).

        Raises:
            EngineError: the server has neither or fails.
        """
        ep = self.endpoints[self.oracle]
        try:
            return list(self._post(ep, self._root(ep) + "/tokenize", {"model": self.model_of(ep), "prompt": text},
                                   "tokens"))
        except EngineError as first:
            try:
                return list(self._post(ep, self._root(ep) + "/extras/tokenize", {"input": text}, "tokens"))
            except EngineError:
                raise first from None

    def _prompt(self, ep: Endpoint, prompt_ids: list[int]):
        if self.token_ids:
            return [int(i) for i in prompt_ids]
        ids = [int(i) for i in prompt_ids]
        try:
            return self._post(ep, self._root(ep) + "/detokenize", {"model": self.model_of(ep), "tokens": ids},
                              "prompt")
        except EngineError as first:
            try:   # llama.cpp's Python server; its /v1/completions takes text only
                return self._post(ep, self._root(ep) + "/extras/detokenize", {"tokens": ids}, "text")
            except EngineError:
                raise first from None

    def generate(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Generation:
        """One streamed greedy request (temperature 0, ignore_eos, max_tokens = gen_tokens) to ``config``'s server.

        Returns:
            Generation with gen_ids [G] int64 (the server's token ids; see the module docstring for text-only
            servers), top_logprobs where asked and mapped, ttft_s, decode_s and token_times (seconds since the
            request, one stamp per token, the stamp of the chunk that carried it); prompt/gen logits and KV None.
        Raises:
            ValueError: unknown configuration, gen_tokens < 1, an empty prompt; EngineError: see stream_completion.
        """
        check_config(self, config)
        if isinstance(gen_tokens, bool) or not isinstance(gen_tokens, int) or gen_tokens < 1:
            raise ValueError(f"gen_tokens must be an int >= 1, got {gen_tokens!r}")
        if len(prompt_ids) == 0:
            raise ValueError("the prompt is empty; at least one token is needed")
        ep = self.endpoints[config]
        body = {"model": self.model_of(ep), "prompt": self._prompt(ep, prompt_ids), "max_tokens": gen_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        if self.top_n:
            body |= {"logprobs": self.top_n, "return_tokens_as_token_ids": True}
        r = stream_completion(ep.base_url + "/completions", body, self.timeout_s, ep.where(), bool(self.top_n))
        ep.fingerprint = r.fingerprint or ep.fingerprint
        g = _generation(config, r)
        if g.gen_ids.numel() != gen_tokens:
            g.info["notes"].append(f"asked for {gen_tokens} tokens, the server returned {g.gen_ids.numel()} "
                                   f"(finish_reason {r.finish!r})")
        return g

    def drafted(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Generation:
        """generate() on the configuration named ``drafted``. Raises NotAvailable where there is none."""
        return self._named("drafted", "drafted decoding", config).generate(prompt_ids, gen_tokens, "drafted")

    def resumed(self, prefix_ids: list[int], prompt_ids: list[int], gen_tokens: int, config: str) -> Generation:
        """The prefix (1 token), then the prompt, both to the configuration named ``resumed``; the prompt's
        Generation with the prefix's usage in ``info``. Raises NotAvailable where there is no such configuration."""
        self._named("resumed", "a prompt cache", config)
        first = self.generate(prefix_ids, 1, "resumed")
        g = self.generate(prompt_ids, gen_tokens, "resumed")
        g.info["prefix_usage"] = first.info.get("usage")
        return g

    def _named(self, name: str, what: str, config: str) -> "OpenAIEngine":
        check_config(self, config)
        if name not in self.endpoints:
            raise NotAvailable(f"{what} is a property of how an OpenAI-compatible server is launched, not of a "
                               f"request; this engine has no configuration named {name!r} that serves it")
        return self

    def concurrent(self, prompts: list[list[int]], gen_tokens: int, config: str) -> list[Generation]:
        """The prompts as simultaneous streamed requests (one thread each); Generations in prompt order."""
        check_config(self, config)
        with ThreadPoolExecutor(max(1, len(prompts))) as pool:
            gens = list(pool.map(lambda p: self.generate(p, gen_tokens, config), prompts))
        for g in gens:
            g.info["concurrent"] = len(prompts)
        return gens

    def close(self) -> None:
        """Stop the servers this engine launched (by their own PIDs)."""
        for e in self.endpoints.values():
            stop(e)


def _generation(config: str, r: Reply) -> Generation:
    """A Reply -> Generation (gen_ids from the token ids, else the text's UTF-8 bytes, marked in info)."""
    info = {"finish_reason": r.finish, "usage": r.usage, "system_fingerprint": r.fingerprint, "notes": r.notes}
    if r.served is not None:
        info["served"] = r.served
    if r.ids is not None:
        ids = torch.tensor(r.ids, dtype=torch.int64)
        info["gen_ids_are"] = "token ids"
    else:
        ids = torch.tensor(list(r.text.encode("utf-8")), dtype=torch.int64)
        info["gen_ids_are"] = "utf-8 bytes of the returned text (the server returned no token ids)"
        info["text_hash"] = token_hash(ids)
    times = r.times
    return Generation(config=config, gen_ids=ids, top_logprobs=r.top if r.top else None,
                      ttft_s=times[0] if times else 0.0, decode_s=times[-1] - times[0] if times else 0.0,
                      token_times=times or None, info=info)


# ---------------------------------------------------------------------------------------------------------- bench

def bench(engine: OpenAIEngine, prompt_ids: list[int], gen_tokens: int, config: str) -> dict:
    """The bench section's measures (analysis/bench.py defines them) of one prompt on one configuration.

    cold is the first request of this call and warm the identical repeat (a server's own prompt cache, if any, may
    serve warm); streams 1 and 2 are that request sent alone and twice at once: aggregate tok/s = generated tokens
    of all streams / wall seconds of the whole call, and whether every stream's tokens equal warm's.

    Returns:
        {"cold": metrics, "warm": metrics, "streams": [{streams, wall_s, aggregate_tps, equal_to_alone}, ...]} with
        metrics as analysis.bench_runner.timing_metrics (ttft_s, prefill_tps, decode_tps, itl_mean_ms, itl_p50_ms,
        itl_p95_ms, generated); seconds and tokens per second.
    Raises:
        EngineError, ValueError: as OpenAIEngine.generate.
    """
    from ..analysis.bench_runner import timing_metrics

    P = len(prompt_ids)
    runs = {k: engine.generate(prompt_ids, gen_tokens, config) for k in ("cold", "warm")}
    out = {k: timing_metrics(P, g.ttft_s, g.token_times or []) for k, g in runs.items()}
    ref = token_hash(runs["warm"].gen_ids)
    out["streams"] = []
    for n in (1, 2):
        t0 = time.perf_counter()
        gens = engine.concurrent([list(prompt_ids)] * n, gen_tokens, config)
        wall = time.perf_counter() - t0
        out["streams"].append({"streams": n, "wall_s": wall,
                               "aggregate_tps": sum(int(g.gen_ids.numel()) for g in gens) / wall,
                               "equal_to_alone": all(token_hash(g.gen_ids) == ref for g in gens)})
    return out
