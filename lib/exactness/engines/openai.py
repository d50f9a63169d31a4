"""The ``openai`` engine: any OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, ``python -m exactness
serve``), spoken to over HTTP with httpx: one ``/v1/completions`` (or ``/v1/chat/completions``) request per run.

Spec: ``openai:http://127.0.0.1:8000/v1``, or a YAML engine file with these options:

    configurations   list of {name, base_url} or {name, launch: "command with {port}"}, each optionally with its
                     own api and sampling; a launched server is started by the suite (the command split like a shell
                     line, run without a shell, {port} a free local port, {python} the suite's own Python
                     (sys.executable), so ``{python} -m exactness serve ...`` and ``{python} -m llama_cpp.server
                     ...`` run in the suite's environment), waited for until GET /v1/models answers, probed, and
                     stopped by its own PID at close(). Default: one configuration ``server`` at the target URL.
    oracle           the configuration every other one is compared with (default: the first)
    model            the served model name (default: the first one each server's /v1/models lists)
    timeout_s        seconds allowed for connecting and between two reads of a reply (default 60)
    launch_timeout_s seconds a launched server has to answer /v1/models (default 120)
    cwd              the folder launch commands run in (default: the engine file's own folder, so relative paths
                     in a launch command are the file's; the caller's folder for an ``openai:URL`` spec)
    token_ids        send prompts as token ids (default true); false sends the text the server's /detokenize gives
                     (exact only where the tokenizer round-trips the ids: ``generate`` cannot tell)
    top_logprobs     top-N log-probabilities asked per generated token (default 5; 0 asks none)
    sampling         {knob: value or null}: overrides the neutral knobs every request sends (openai_checks.
                     NEUTRAL_SAMPLING: temperature 0, top_p 1, top_k -1, min_p 0, typical_p 1, tfs_z 1,
                     repetition_penalty / repeat_penalty 1, presence / frequency penalty 0, seed 0, mirostat(_mode)
                     0); null drops a knob a server refuses (llama-cpp-python's server takes top_k >= 0 only:
                     ``sampling: {top_k: 0}``). The knobs sent are in each configuration's settings.
    api              completions | chat | auto (default completions): auto uses /v1/completions and falls back
                     to /v1/chat/completions where it answers 404/405. Chat prompts (engines.base.Chat) always go
                     to /v1/chat/completions (the server's template); on a chat configuration a text prompt is sent
                     as one user message (its text as given to encode()) and an ids prompt is refused.
    prompt_logprobs  auto | vllm | echo | off (default auto): the prompt tokens' logprobs, by vLLM's
                     ``prompt_logprobs: N`` or the legacy ``echo: true`` + ``logprobs: N`` (one extra non-streamed
                     request, max_tokens 1, on a prompt's first run per configuration; later runs of the same
                     prompt there carry none); auto tries vllm then echo, records which answered, else off with why.
                     llama-cpp-python's server answers echo while launched with ``--logits_all true`` (its default;
                     with false it refuses logprobs).
    stream           read replies streamed (default true) or whole

Keys of the run profiles (device, dtype, steps, ...) that ``open_engine`` passes to every adapter do not apply to a
server and are ignored; any other key is refused.

What a server exposes: the generated ids (``token_ids`` of each choice, vLLM's and SGLang's ``return_token_ids``;
``ignore_eos`` is sent so end-of-sequence is not a stop), the top-N log-probabilities with exact ids where the server
names tokens ``token_id:<id>`` (``return_tokens_as_token_ids``), the prompt logprobs (Run.prompt_logprobs,
openai_checks describes the tensors), the time of each streamed chunk. Not exposed: prompt logits, gen logit rows,
the KV cache. Greedy is checked, not assumed: where logprobs came back, Run.greedy says whether every chosen
token was the top-1 (openai_checks.greedy_check, the first offending position in ``info["greedy_check"]``). A server
that returns text only: ``gen_ids`` holds the bytes of the tokens (chat logprobs' ``bytes``) where given, else the
UTF-8 bytes of the text as received, ``info["gen_ids_are"]`` says which, and ``info["lost"]`` lists what the text
may have lost (openai_checks.lost_facts). A reply cut short (no finish reason, an ``abort``, a closed connection)
is an EngineError of that run, never a token difference. ``probe()`` and ``probe_urls`` check every server first.

Drafted decoding and prompt-cache resume are properties of how a server was launched, not of a request: they are
available only where a configuration is named ``drafted`` (drafted() runs on it) or ``resumed`` (resumed() sends
the prefix there, then the prompt; whether the server reused its cache is its own business, its ``usage`` is kept
in ``info``). ``concurrent`` sends N requests at once from N threads.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from ..run import Run
from .base import PROFILE_OPTIONS, Chat, Configuration, EngineError, NotAvailable, check_config
from .openai_checks import parse_echo, parse_vllm, refused_knob
from .openai_http import Endpoint, launch, models, stop
from .openai_options import OPTIONS, PLP_MODES, PROBE_S, choice, endpoints, seconds
from .openai_reply import Reply, complete, generation, one_line

# --------------------------------------------------------------------------------------------------------- engine

class OpenAIEngine:
    """An OpenAI-compatible server (or several, one per configuration); options in the module docstring.

    Raises (from_spec):
        ValueError: an unknown option (names the allowed ones), a bad configuration entry, an unknown oracle.
        EngineError: a launched server that does not come up or fails its probe (servers started are stopped).
    """

    kind = "openai"

    def __init__(self, endpoints: list[Endpoint], oracle: str, model: str, timeout_s: float, token_ids: bool,
                 top_logprobs: int, plp: str = "auto", stream: bool = True):
        self.endpoints = {e.name: e for e in endpoints}
        self.oracle, self.model, self.timeout_s = oracle, model, timeout_s
        self.token_ids, self.top_n, self.stream = token_ids, top_logprobs, stream
        for e in endpoints:
            e.plp = plp
        self._texts: dict[tuple, str] = {}   # ids encode() returned -> the text (chat configurations send it)
        self._plp_asked: set = set()          # (configuration, prompt ids) whose prompt logprobs were asked

    @property
    def capabilities(self) -> frozenset:
        """concurrent, chat, top_logprobs / token_ids as asked, drafted / prompt_cache by configuration name, and
        prompt_logprobs once every configuration's server answered them."""
        caps = {"concurrent", "chat"} | ({"top_logprobs"} if self.top_n else set())
        caps |= {"token_ids"} if self.token_ids else set()
        caps |= {"drafted"} if "drafted" in self.endpoints else set()
        caps |= {"prompt_cache"} if "resumed" in self.endpoints else set()
        if all(e.plp in ("vllm", "echo") for e in self.endpoints.values()):
            caps.add("prompt_logprobs")
        return frozenset(caps)

    @classmethod
    def build(cls, target: str, options: dict) -> "OpenAIEngine":
        """The engine of ``openai:TARGET`` with ``options``, nothing launched or asked yet. Raises ValueError."""
        extra = set(options) - set(OPTIONS) - PROFILE_OPTIONS
        if extra:
            raise ValueError(f"openai engine: unknown options {sorted(extra)}; allowed: {', '.join(OPTIONS)}")
        eps = endpoints(target, options)
        names = [e.name for e in eps]
        oracle = options.get("oracle", names[0])
        if oracle not in names:
            raise ValueError(f"openai engine: oracle {oracle!r} is not a configuration; configurations: {names}")
        timeout_s = seconds(options, "timeout_s", 60.0)
        top_n, token_ids, stream = (options.get(k, d) for k, d in (("top_logprobs", 5), ("token_ids", True),
                                                                  ("stream", True)))
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
            raise ValueError(f"openai engine: top_logprobs must be an int >= 0, got {top_n!r}")
        for k, v in (("token_ids", token_ids), ("stream", stream)):
            if not isinstance(v, bool):
                raise ValueError(f"openai engine: {k} must be true or false, got {v!r}")
        plp = choice(options, "prompt_logprobs", PLP_MODES, "auto")
        return cls(eps, oracle, str(options.get("model") or ""), timeout_s, token_ids, top_n, plp, stream)

    @classmethod
    def from_spec(cls, target: str, options: dict) -> "OpenAIEngine":
        """build(), then each launched server started and probed (see the module docstring)."""
        wait_s = seconds(options, "launch_timeout_s", 120.0)
        eng = cls.build(target, options)
        try:
            for e in eng.endpoints.values():
                if e.launch:
                    launch(e, wait_s)
                    eng.probe_endpoint(e)
        except BaseException:
            eng.close()
            raise
        return eng

    # ---- probes

    def probe(self) -> None:
        """probe_endpoint for every configuration. Raises EngineError (one line) at the first that fails."""
        for e in self.endpoints.values():
            self.probe_endpoint(e)

    def probe_endpoint(self, ep: Endpoint) -> None:
        """GET /v1/models and a one-token greedy request (at most PROBE_S seconds each), resolving ``api: auto``
        and ``prompt_logprobs: auto``.

        Raises:
            EngineError: one line naming the configuration, the URL and what failed.
        """
        t = min(self.timeout_s, PROBE_S)
        names = models(ep, t)
        ep.model = ep.model or names[0]
        self._request(ep, "Hello", 1, timeout_s=t)
        if ep.plp != "off" and ep.api == "completions":
            self._prompt_logprobs(ep, "Hello", None, timeout_s=t)

    # ---- protocol

    def identity(self) -> dict:
        """Kind, client version, served model name(s) and fingerprints seen, each configuration's settings (the
        sampling knobs sent, the api and prompt-logprob format used)."""
        return {"kind": self.kind, "version": f"httpx {httpx.__version__}", "model": self.model or None,
                "served_models": {n: e.model or None for n, e in self.endpoints.items()},
                "system_fingerprints": {n: e.fingerprint for n, e in self.endpoints.items()},
                "device": "server", "dtype": None, "oracle": self.oracle,
                "configurations": {c.name: c.settings for c in self.configurations()}}

    def configurations(self) -> list[Configuration]:
        """One configuration per server, as given, with the knobs sent and the formats used."""
        # a launched server's URL holds a free port of the moment: its launch command names it, not the URL
        return [Configuration(n, {**e.settings, "base_url": "launched" if e.launch else e.base_url, "api": e.api,
                                  "prompt_logprobs": e.plp + (f" ({e.plp_why})" if e.plp_why else "")})
                for n, e in self.endpoints.items()]

    def _root(self, ep: Endpoint) -> str:
        return ep.base_url.removesuffix("/v1")

    def _post(self, ep: Endpoint, url: str, body: dict, key: str):
        """POST ``body`` and return ``key`` of the JSON reply. Raises EngineError naming what went wrong."""
        try:
            resp = httpx.post(url, json=body, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise EngineError(f"{ep.where()}: {url}: {type(e).__name__}: {one_line(e)}") from None
        if resp.status_code >= 400:
            raise EngineError(f"{ep.where()}: HTTP {resp.status_code} from {url}: {one_line(resp.text, 400)}")
        try:
            return resp.json()[key]
        except (ValueError, KeyError, TypeError):
            raise EngineError(f"{ep.where()}: {url} answered without {key!r}: {one_line(resp.text)}") from None

    def model_of(self, ep: Endpoint) -> str:
        """The model name requests to ``ep`` carry: the option, else the first of its /v1/models (asked once)."""
        if not (self.model or ep.model):
            ep.model = models(ep, self.timeout_s)[0]
        return self.model or ep.model

    def encode(self, text: str) -> list[int]:
        """The oracle server's ids of ``text``: POST /tokenize (vLLM, SGLang, ``exactness serve``), else
        /extras/tokenize (llama.cpp's Python server).

        Raises:
            EngineError: the server has neither or fails.
        """
        ep = self.endpoints[self.oracle]
        try:
            ids = list(self._post(ep, self._root(ep) + "/tokenize", {"model": self.model_of(ep), "prompt": text},
                                  "tokens"))
        except EngineError as first:
            try:
                ids = list(self._post(ep, self._root(ep) + "/extras/tokenize", {"input": text}, "tokens"))
            except EngineError:
                raise first from None
        self._texts[tuple(ids)] = text
        return ids

    def _prompt(self, ep: Endpoint, prompt_ids):
        if isinstance(prompt_ids, str) or self.token_ids:
            return prompt_ids if isinstance(prompt_ids, str) else [int(i) for i in prompt_ids]
        ids = [int(i) for i in prompt_ids]
        try:
            return self._post(ep, self._root(ep) + "/detokenize", {"model": self.model_of(ep), "tokens": ids},
                              "prompt")
        except EngineError as first:
            try:   # llama.cpp's Python server; its /v1/completions takes text only
                return self._post(ep, self._root(ep) + "/extras/detokenize", {"tokens": ids}, "text")
            except EngineError:
                raise first from None

    def _messages(self, ep: Endpoint, prompt) -> list[dict]:
        if isinstance(prompt, Chat):
            return prompt.as_json()
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        ids = tuple(int(i) for i in prompt)
        text = self._texts.get(ids)
        if text is None:
            cut = any(k[:len(ids)] == ids for k in self._texts)
            what = (f"a text prompt cut to {len(ids)} tokens (prompt_max_tokens) has no text of its own" if cut else
                    f"an ids prompt ({len(ids)} ids) cannot be sent as a message")
            raise EngineError(f"{ep.where()}: this configuration speaks /v1/chat/completions only (api: {ep.api}): "
                              f"{what}; give whole text or messages prompts")
        return [{"role": "user", "content": text}]

    def _body(self, ep: Endpoint, prompt, n: int, chat: bool, stream: bool) -> tuple[str, dict]:
        """(url, body) of one greedy request for ``n`` tokens with every sampling knob of ``ep``."""
        body = {"model": self.model_of(ep), "max_tokens": n, **ep.sampling, "ignore_eos": True,
                "return_token_ids": True, "stream": stream}
        body |= {"stream_options": {"include_usage": True}} if stream else {}
        if chat:
            body["messages"] = self._messages(ep, prompt)
            body |= {"logprobs": True, "top_logprobs": self.top_n} if self.top_n else {}
        else:
            body["prompt"] = self._prompt(ep, prompt)
            body |= {"logprobs": self.top_n} if self.top_n else {}
        body |= {"return_tokens_as_token_ids": True} if self.top_n else {}
        return ep.base_url + ("/chat/completions" if chat else "/completions"), body

    def _request(self, ep: Endpoint, prompt, n: int, stream: bool = True, extra: dict | None = None,
                 timeout_s: float | None = None) -> Reply:
        """One request; ``api: auto`` tries /v1/completions and falls back to chat on 404/405 (then kept)."""
        chat = isinstance(prompt, Chat) or ep.api == "chat"
        url, body = self._body(ep, prompt, n, chat, stream)
        hint = lambda text: refused_knob(text, ep.sampling)   # noqa: E731
        try:
            r = complete(url, {**body, **(extra or {})}, timeout_s or self.timeout_s, ep.where(), hint)
        except EngineError as e:
            if chat or ep.api != "auto" or getattr(e, "status", None) not in (404, 405):
                raise
            ep.api = "chat"
            return self._request(ep, prompt, n, stream, extra, timeout_s)
        if ep.api == "auto" and not chat:
            ep.api = "completions"
        ep.fingerprint = r.fingerprint or ep.fingerprint
        return r

    def _prompt_logprobs(self, ep: Endpoint, prompt, prompt_ids, timeout_s: float | None = None) -> tuple | None:
        """(lp, ids, format) of the prompt tokens' logprobs (openai_checks), or None where off. ``auto`` tries vllm
        then echo and keeps the first that answers (else off, with why).

        Raises:
            EngineError: a format asked by name that the server does not answer.
        """
        N, why = max(self.top_n, 1), []
        for mode in (("vllm", "echo") if ep.plp == "auto" else (ep.plp,)):
            extra = {"prompt_logprobs": N} if mode == "vllm" else {"echo": True, "logprobs": N}
            try:
                r = self._request(ep, prompt, 1, stream=False, extra=extra, timeout_s=timeout_s)
                ch = r.body["choices"][0]
                lp, ids = (parse_vllm(ch.get("prompt_logprobs", r.body.get("prompt_logprobs")), prompt_ids, N)
                           if mode == "vllm" else
                           parse_echo(ch.get("logprobs"), (r.usage or {}).get("completion_tokens") or 1, N))
            except (EngineError, ValueError, IndexError, TypeError) as e:
                if ep.plp != "auto":
                    raise EngineError(f"{ep.where()}: prompt_logprobs {mode}: {one_line(e)}") from None
                why.append(f"{mode}: {one_line(e, 150)}")
                continue
            ep.plp = mode
            return lp, ids, mode
        ep.plp, ep.plp_why = "off", "; ".join(why)
        return None

    def generate(self, prompt_ids, gen_tokens: int, config: str) -> Run:
        """One greedy request (every neutral knob, ignore_eos, max_tokens = gen_tokens) to ``config``'s server;
        ``prompt_ids`` token ids, or an engines.base.Chat (sent to /v1/chat/completions).

        Returns:
            Run with gen_ids [G] int64 (token ids, else bytes: see the module docstring), greedy,
            top_logprobs where asked and mapped, prompt_logprobs / prompt_logprob_ids where answered, ttft_s,
            decode_s and token_times (seconds since the request, one stamp per token, the stamp of the chunk that
            carried it); prompt/gen logits and KV None.
        Raises:
            ValueError: unknown configuration, gen_tokens < 1, an empty prompt; EngineError: see openai_reply.
        """
        check_config(self, config)
        if isinstance(gen_tokens, bool) or not isinstance(gen_tokens, int) or gen_tokens < 1:
            raise ValueError(f"gen_tokens must be an int >= 1, got {gen_tokens!r}")
        if not isinstance(prompt_ids, Chat) and len(prompt_ids) == 0:
            raise ValueError("the prompt is empty; at least one token is needed")
        ep = self.endpoints[config]
        r = self._request(ep, prompt_ids, gen_tokens, self.stream)
        g = generation(config, r, gen_tokens, self.top_n)
        g.info["api"] = "chat" if isinstance(prompt_ids, Chat) else ep.api
        key = (config, tuple(prompt_ids) if not isinstance(prompt_ids, Chat) else None)
        if ep.plp != "off" and key[1] is not None and ep.api == "completions" and key not in self._plp_asked:
            self._plp_asked.add(key)   # once per configuration and prompt: repeats keep the request load as asked
            got = self._prompt_logprobs(ep, prompt_ids, list(prompt_ids))
            if got:
                g.prompt_logprobs, g.prompt_logprob_ids, g.info["prompt_logprobs_via"] = got
        return g

    def drafted(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """generate() on the configuration named ``drafted``. Raises NotAvailable where there is none."""
        return self._named("drafted", "drafted decoding", config).generate(prompt_ids, gen_tokens, "drafted")

    def resumed(self, prefix_ids: list[int], prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """The prefix (1 token), then the prompt, both to the configuration named ``resumed``; the prompt's
        Run with the prefix's usage in ``info``. Raises NotAvailable where there is no such configuration."""
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

    def concurrent(self, prompts: list[list[int]], gen_tokens: int, config: str) -> list[Run]:
        """The prompts as simultaneous streamed requests (one thread each); Runs in prompt order."""
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


def probe_urls(target: str, options: dict) -> list[str]:
    """Probe (OpenAIEngine.probe_endpoint) every configuration given by a base_url, launching nothing; returns the
    names probed.

    Raises:
        ValueError: bad options (as from_spec); EngineError: one line naming the configuration, URL and failure.
    """
    eng = OpenAIEngine.build(target, options)
    probed = [e for e in eng.endpoints.values() if not e.launch]
    for e in probed:
        eng.probe_endpoint(e)
    return [e.name for e in probed]
