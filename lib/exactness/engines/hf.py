"""The transformers adapter: a local model folder run by ``transformers`` under named configurations.

Configurations (engine.configurations(); ``steps`` gives the chunk sizes):

    token-by-token        the oracle: the prompt fed one token per forward through a DynamicCache, then greedy decode
    one-forward           the whole prompt in one forward, then greedy decode through the cache
    chunk-<s>             the prompt in chunks of s tokens through the cache, then greedy decode
    generate              model.generate(do_sample=False): plain greedy as transformers runs it
    generate-chunk-<s>    the same with generate's ``prefill_chunk_size=s``

The first three run this module's own loop: one forward per chunk and one per generated token, with explicit
position ids, so that every prompt logit row and the cache's keys and values are exposed. The ``generate`` ones
expose what generate exposes: the logit row of each generated token (``output_logits``) and the cache it returns.
The end-of-sequence token is never a stop: every run returns ``gen_tokens`` tokens.

Options (a YAML engine file or the profile): ``device`` ("cpu", "cuda", "cuda:N"), ``dtype`` ("bfloat16",
"float32"), ``steps`` (chunk sizes), ``configurations`` (names to run; the oracle is always among them) and
``draft`` (the folder of an assistant model for drafted decoding; without it drafted decoding is prompt lookup).
"""
from __future__ import annotations

import copy
import hashlib
import inspect
import re
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ..run import Run
from .base import Configuration, EngineError, NotAvailable, byte_ids, check_config

ORACLE = "token-by-token"
OPTIONS = ("device", "dtype", "steps", "configurations", "draft")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PROMPT_LOOKUP_TOKENS = 10  # drafted tokens per step of prompt lookup (transformers' documented example value)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_CHUNKED = re.compile(r"(generate-)?chunk-([1-9][0-9]*)")


def configuration(name: str) -> Configuration:
    """The Configuration called ``name``; its settings: ``runner`` ("loop": this module's decode loop, or
    "generate") and ``prefill_chunk`` (prompt tokens per forward; None: the whole prompt at once).

    Raises:
        ValueError: an unknown name (names the allowed forms).
    """
    fixed = {ORACLE: ("loop", 1), "one-forward": ("loop", None), "generate": ("generate", None)}
    if name in fixed:
        runner, chunk = fixed[name]
    elif isinstance(name, str) and (m := _CHUNKED.fullmatch(name)):
        runner, chunk = ("generate" if m.group(1) else "loop"), int(m.group(2))
    else:
        raise ValueError(f"unknown transformers configuration {name!r}; allowed: {ORACLE}, one-forward, chunk-<s>, "
                         f"generate, generate-chunk-<s> (s a positive integer)")
    return Configuration(name, {"runner": runner, "prefill_chunk": chunk})


def default_names(steps) -> list[str]:
    """The configurations run when none are named: the oracle, one-forward, chunk-<s>, generate, generate-chunk-<s>."""
    return ([ORACLE, "one-forward"] + [f"chunk-{s}" for s in steps] + ["generate"]
            + [f"generate-chunk-{s}" for s in steps])


def check_options(options: dict) -> dict:
    """``options`` with defaults filled (device "cpu", dtype "bfloat16", steps (), configurations None, draft None).

    Raises:
        ValueError: keys other than OPTIONS (named), a bad device, dtype, step, configuration name or draft folder.
    """
    extra = sorted(set(options) - set(OPTIONS))
    if extra:
        raise ValueError(f"transformers engine: unknown option(s) {', '.join(map(repr, extra))}; "
                         f"allowed: {', '.join(OPTIONS)}")
    o = {"device": "cpu", "dtype": "bfloat16", "steps": (), "configurations": None, "draft": None, **options}
    if not isinstance(o["device"], str) or not re.fullmatch(r"cpu|cuda(:[0-9]+)?", o["device"]):
        raise ValueError(f"transformers engine: device {o['device']!r}; allowed: cpu, cuda, cuda:N")
    if o["device"] != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"transformers engine: device {o['device']!r} asked for, but torch sees no CUDA device")
    if o["dtype"] not in DTYPES:
        raise ValueError(f"transformers engine: dtype {o['dtype']!r}; allowed: {', '.join(DTYPES)}")
    steps = o["steps"]
    if not isinstance(steps, (list, tuple)) or any(type(s) is not int or s < 1 for s in steps):
        raise ValueError(f"transformers engine: steps {steps!r}; allowed: a list of positive integers")
    names = o["configurations"]
    if names is not None and (not isinstance(names, (list, tuple)) or not names):
        raise ValueError(f"transformers engine: configurations {names!r}; allowed: a non-empty list of names")
    for name in names or ():
        configuration(name)
    if o["draft"] is not None and not (Path(str(o["draft"])) / "config.json").is_file():
        raise ValueError(f"transformers engine: draft {o['draft']!r} is not a model folder (no config.json)")
    return o


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def load_model(folder, dtype: str, device: str):
    """``AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)`` in ``dtype`` on ``device``, eval mode.

    Raises:
        ValueError: ``folder`` has no config.json; ImportError: transformers is not installed.
    """
    if not (Path(folder) / "config.json").is_file():
        raise ValueError(f"transformers engine: target {str(folder)!r} is not a model folder (no config.json)")
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ImportError("the transformers engine needs transformers: pip install transformers") from e
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=DTYPES[dtype])
    return model.to(device).eval()


@contextmanager
def _eos_off(*models):
    """Generation configs without an end-of-sequence token while inside (generate would stop there)."""
    saved = [(m, m.generation_config) for m in models if m is not None]
    for m, gc in saved:
        m.generation_config = copy.deepcopy(gc)
        m.generation_config.eos_token_id = None
    try:
        yield
    finally:
        for m, gc in saved:
            m.generation_config = gc


class _Clock:
    """A generate streamer that stamps each generated token's arrival (perf_counter seconds); the first ``put`` is
    the prompt. Tokens verified together in one step arrive together and share a stamp."""

    def __init__(self):
        self.times, self.prompt_seen = [], False

    def put(self, value):
        if self.prompt_seen:
            self.times += [time.perf_counter()] * (value.shape[-1] if value.dim() == 2 else 1)
        self.prompt_seen = True

    def end(self):
        pass


class TransformersEngine:
    """A transformers causal LM under test (see the module docstring for its configurations).

    Args:
        model: a loaded ``PreTrainedModel`` with a language-modeling head, in eval mode on its device.
        steps: chunk sizes of the default chunk-<s> and generate-chunk-<s> configurations.
        configurations: names to run (the oracle is added first where missing); None: default_names(steps).
        draft_model: the assistant model of drafted decoding (same vocabulary); None: prompt lookup.
        tokenizer: encodes text; None: the byte tokenizer over the model's vocabulary.
        folder, draft_folder: where the model and draft were loaded from (their files' SHA-256 go in identity()).
    Raises:
        ValueError: an unknown or repeated configuration name.
    """

    kind = "transformers"
    oracle = ORACLE
    capabilities = frozenset({"prompt_logits", "gen_logits", "kv_bytes", "drafted", "prompt_cache", "concurrent",
                              "token_ids"})

    def __init__(self, model, *, steps=(), configurations=None, draft_model=None, tokenizer=None, folder=None,
                 draft_folder=None):
        names = list(configurations) if configurations is not None else default_names(steps)
        names = names if ORACLE in names else [ORACLE] + names
        if len(set(names)) != len(names):
            raise ValueError(f"transformers engine: repeated configuration names in {names}")
        self.model, self.draft, self.tokenizer = model, draft_model, tokenizer
        self.folder, self.draft_folder = folder, draft_folder
        self._configs = [configuration(n) for n in names]
        self._identity = None
        # transformers renamed the cache argument (past_key_values -> cache); use the name this version takes
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_spec(cls, target: str, options: dict) -> TransformersEngine:
        """The engine on the model folder ``target`` with ``options`` (check_options).

        Raises:
            ValueError: bad options or a target that is not a model folder; ImportError: no transformers.
        """
        o = check_options(dict(options))
        model = load_model(target, o["dtype"], o["device"])
        draft = load_model(o["draft"], o["dtype"], o["device"]) if o["draft"] is not None else None
        tokenizer = None
        if any((Path(target) / f).is_file() for f in TOKENIZER_FILES):
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
        return cls(model, steps=o["steps"], configurations=o["configurations"], draft_model=draft,
                   tokenizer=tokenizer, folder=Path(target), draft_folder=o["draft"] and Path(o["draft"]))

    # ---- what the engine is

    def configurations(self) -> list[Configuration]:
        """The configurations run, the oracle first."""
        return list(self._configs)

    def identity(self) -> dict:
        """JSON-ready: kind, transformers and torch versions, model class, config.json and weight files' SHA-256
        (of the in-memory config's JSON where the model was not loaded from a folder), device, dtype, attention
        and experts implementations, the draft model's identity, each configuration's settings."""
        if self._identity is None:
            import transformers
            cfg = self.model.config
            self._identity = {
                "kind": self.kind, "transformers": transformers.__version__, "torch": torch.__version__,
                **_files_identity(self.model, self.folder), "device": str(self.model.device),
                "dtype": str(self.model.dtype).removeprefix("torch."),
                "attn_implementation": getattr(cfg, "_attn_implementation", None),
                "experts_implementation": str(getattr(cfg, "_experts_implementation", None)),
                "tokenizer": type(self.tokenizer).__name__ if self.tokenizer is not None else "bytes",
                "draft": (_files_identity(self.draft, self.draft_folder) if self.draft is not None
                          else {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}),
                "configurations": {c.name: c.settings for c in self._configs}}
        return self._identity

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: the folder's tokenizer (special tokens as it adds them), else UTF-8 byte ids
        with the config's BOS first."""
        if self.tokenizer is not None:
            return list(self.tokenizer.encode(text))
        cfg = self.model.config
        return byte_ids(text, cfg.vocab_size, getattr(cfg, "bos_token_id", None))

    # ---- runs

    def generate(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """Greedy ``gen_tokens`` tokens after ``prompt_ids`` under ``config``; prompt_logits [P, V] and kv (K then
        V per layer, [T, Hkv, D] each) from the loop configurations, gen_logits [G, V] fp32 from all.

        Raises:
            ValueError: unknown configuration, bad prompt ids or gen_tokens; EngineError: the model failed.
        """
        return self.concurrent([prompt_ids], gen_tokens, config)[0]

    def concurrent(self, prompts: list[list[int]], gen_tokens: int, config: str) -> list[Run]:
        """The prompts as one left-padded batch with an attention mask (chunks are of the padded columns); one
        Run each, pad positions stripped from its prompt_logits and kv.

        Raises:
            as generate.
        """
        settings = self._settings(config, gen_tokens, prompts)
        ids, mask = self._batch(prompts)
        chunk = settings["prefill_chunk"]
        if settings["runner"] == "generate":
            return self._guard(config, lambda: self._generate(ids, mask, gen_tokens, chunk, config, {}))
        return self._guard(config, lambda: self._loop(ids, mask, gen_tokens, chunk, config))

    def drafted(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """Assisted generation (generate with the draft model, or prompt lookup without one), greedy, the
        configuration's prefill; tokens and gen_logits as generate returns them.

        Raises:
            as generate.
        """
        settings = self._settings(config, gen_tokens, [prompt_ids])
        ids, _ = self._batch([prompt_ids])
        extra = ({"assistant_model": self.draft} if self.draft is not None
                 else {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS})
        chunk = settings["prefill_chunk"] if settings["runner"] == "generate" else None
        gen = self._guard(config, lambda: self._generate(ids, None, gen_tokens, chunk, config, extra))[0]
        gen.info["drafted"] = "assistant model" if self.draft is not None else "prompt lookup"
        return gen

    def resumed(self, prefix_ids: list[int], prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """A DynamicCache filled with ``prefix_ids`` (chunked as the configuration chunks), deep-copied as a
        prompt cache keeps it; the copy continues with the rest of ``prompt_ids``. prompt_logits holds the
        prefix request's rows, then the resumed ones; the times count from the resumed request.

        Raises:
            ValueError: ``prefix_ids`` not a proper prefix of ``prompt_ids``; as generate.
        """
        settings = self._settings(config, gen_tokens, [prompt_ids])
        n = len(prefix_ids)
        if not 0 < n < len(prompt_ids) or list(prompt_ids[:n]) != list(prefix_ids):
            raise ValueError(f"resumed: the prefix ({n} ids) must be a proper, non-empty prefix of the prompt "
                             f"({len(prompt_ids)} ids)")
        ids, _ = self._batch([prompt_ids])

        def run():
            cache = self._new_cache()
            plog = self._prefill(ids[:, :n], None, cache, settings["prefill_chunk"])
            stored = copy.deepcopy(cache)
            chunk = settings["prefill_chunk"]
            if settings["runner"] == "generate":
                gen = self._generate(ids, None, gen_tokens, chunk, config, {self._cache_kw: stored})[0]
            else:
                gen = self._loop(ids[:, n:], None, gen_tokens, chunk, config, stored)[0]
                gen.prompt_logits = torch.cat([plog[0], gen.prompt_logits])
            gen.info["resumed_from"] = n
            return gen
        return self._guard(config, run)

    def dump_unavailable(self, config: str) -> str | None:
        """Why ``config`` cannot be dumped op by op (None: ``one-forward`` can)."""
        if config == "one-forward":
            return None
        if config == ORACLE:
            return "the oracle's loop (token by token through a DynamicCache) is the decode role of every set"
        return "only one-forward is dumped (dumps/hf_hooks.py: one forward over the prompt against token by token)"

    def dump(self, prompt_ids: list[int], config: str, folder, **select) -> str:
        """Dump the ``one-forward`` configuration op by op on ``prompt_ids`` (prompt role) against the prompt token
        by token (decode role): dumps/hf_hooks.dump_hf_model, weights not stored; ``select``: its ``positions``.
        Returns the folder. Raises ValueError (another configuration, a model without the Qwen3-MoE layout),
        FileExistsError (folder not empty)."""
        from ..dumps.hf_hooks import dump_hf_model
        why = self.dump_unavailable(config)
        if why:
            raise ValueError(f"transformers dumps of {config!r}: {why}")
        return dump_hf_model(folder, self.model, torch.tensor(prompt_ids, dtype=torch.int64), weights=False, **select)

    def close(self) -> None:
        """Drop the models (and the CUDA allocator's cached blocks where on a GPU)."""
        on_cuda = self.model is not None and self.model.device.type == "cuda"
        self.model = self.draft = self.tokenizer = None
        if on_cuda:
            torch.cuda.empty_cache()

    # ---- internals

    def _settings(self, config: str, gen_tokens: int, prompts) -> dict:
        check_config(self, config)
        if type(gen_tokens) is not int or gen_tokens < 1:
            raise ValueError(f"gen_tokens must be a positive integer, got {gen_tokens!r}")
        vocab = self.model.config.vocab_size
        if not prompts or any(not p or any(type(t) is not int or not 0 <= t < vocab for t in p) for p in prompts):
            raise ValueError(f"prompts must be non-empty lists of token ids in [0, {vocab})")
        return next(c.settings for c in self._configs if c.name == config)

    def _guard(self, config: str, fn):
        try:
            with torch.inference_mode():
                return fn()
        except (ValueError, NotAvailable):
            raise
        except Exception as e:  # torch and transformers raise many kinds; the suite records them as one
            raise EngineError(f"transformers {type(self.model).__name__} under {config!r}: "
                              f"{type(e).__name__}: {e}") from e

    def _batch(self, prompts) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left-padded ids [B, L] int64 and mask [B, L] int64 on the model's device (mask None for one prompt)."""
        L, dev = max(map(len, prompts)), self.model.device
        ids = torch.full((len(prompts), L), self._pad, dtype=torch.int64)
        mask = torch.zeros((len(prompts), L), dtype=torch.int64)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):], mask[b, L - len(p):] = torch.tensor(p), 1
        return ids.to(dev), (mask.to(dev) if len(prompts) > 1 else None)

    @property
    def _pad(self) -> int:
        return getattr(self.model.config, "pad_token_id", None) or 0

    def _new_cache(self):
        from transformers import DynamicCache
        return DynamicCache(config=self.model.config)

    def _now(self) -> float:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter()

    def _forward(self, ids, pos, mask, cache) -> torch.Tensor:
        """ids [B, n] at positions pos [B, n] through ``cache`` -> logits [B, n, V] fp32 (exact upcast)."""
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                         **{self._cache_kw: cache})
        return out.logits.float()

    def _prefill(self, ids, mask, cache, chunk) -> torch.Tensor:
        """ids [B, n] after the cache's positions, ``chunk`` columns per forward (None: all) -> [B, n, V] fp32 on
        the CPU. mask [B, past + n] or None; positions count the unmasked tokens (left padding gets 0)."""
        start, n = cache.get_seq_length(), ids.shape[1]
        if mask is None:
            pos = torch.arange(start, start + n, device=ids.device).expand(ids.shape[0], n)
        else:
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, start:]
        step = chunk or n
        rows = []
        for a in range(0, n, step):
            b = min(a + step, n)
            m = mask[:, :start + b] if mask is not None else None
            rows.append(self._forward(ids[:, a:b], pos[:, a:b], m, cache).cpu())
        return torch.cat(rows, 1)

    def _loop(self, ids, mask, gen_tokens, chunk, config, cache=None) -> list[Run]:
        """This module's loop: prefill in chunks, then one forward per generated token (the last is not fed)."""
        cache = self._new_cache() if cache is None else cache
        prompt_mask, t0 = mask, self._now()
        plog = self._prefill(ids, mask, cache, chunk)
        last, end = plog[:, -1].to(ids.device), cache.get_seq_length()
        pos = torch.full((ids.shape[0], 1), end - 1, device=ids.device) if mask is None else mask.sum(-1, True) - 1
        gen, glog, times = [], [], []
        for i in range(gen_tokens):
            if i:
                pos = pos + 1
                if mask is not None:
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                last = self._forward(gen[-1][:, None], pos, mask, cache)[:, -1]
            gen.append(last.argmax(-1))
            glog.append(last.cpu())
            times.append(self._now())
        gen, glog = torch.stack(gen, 1).cpu(), torch.stack(glog, 1)
        return self._rows(config, gen, glog, plog, cache, prompt_mask, t0, times)

    def _generate(self, ids, mask, gen_tokens, chunk, config, extra) -> list[Run]:
        """model.generate, greedy, ``gen_tokens`` new tokens, end of sequence not a stop; ``extra`` goes to it."""
        clock = _Clock()
        with _eos_off(self.model, extra.get("assistant_model")):
            t0 = self._now()
            chunked = {"prefill_chunk_size": chunk} if chunk else {}  # older versions lack the argument
            out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=gen_tokens,
                                      output_logits=True, return_dict_in_generate=True, pad_token_id=self._pad,
                                      streamer=clock, **chunked, **extra)
        gen = out.sequences[:, ids.shape[1]:].cpu()
        glog = torch.stack(out.logits, 1).float().cpu() if out.logits is not None else None
        return self._rows(config, gen, glog, None, getattr(out, self._cache_kw, None), mask, t0, clock.times)

    def _rows(self, config, gen, glog, plog, cache, mask, t0, times) -> list[Run]:
        """One Run per batch row, left padding (the zeros of the prompt mask [B, L]) stripped from its
        prompt rows and KV."""
        out, B = [], gen.shape[0]
        for b in range(B):
            first = int((mask[b] == 0).sum()) if mask is not None else 0
            kv = _kv(cache, b, first) if cache is not None else None
            out.append(Run(
                config=config, gen_ids=gen[b], prompt_logits=plog[b, first:] if plog is not None else None,
                gen_logits=glog[b] if glog is not None else None, kv=kv,
                ttft_s=times[0] - t0 if times else 0.0, decode_s=times[-1] - times[0] if times else 0.0,
                token_times=[t - t0 for t in times] if len(times) == gen.shape[1] else None,
                info={"batch": B} if B > 1 else {}))
        return out


def _kv(cache, b: int, first: int) -> list[torch.Tensor]:
    """Row ``b`` of a DynamicCache from position ``first``: keys of every layer, then values, [T, Hkv, D] each."""
    layers = cache.layers
    return ([l.keys[b, :, first:].transpose(0, 1).contiguous().cpu() for l in layers]
            + [l.values[b, :, first:].transpose(0, 1).contiguous().cpu() for l in layers])


def _files_identity(model, folder) -> dict:
    """Model class and SHA-256 of config.json and the weight files of ``folder`` (of the in-memory config's JSON
    and no weights where ``folder`` is None)."""
    ident = {"model_class": type(model).__name__}
    if folder is None:
        text = model.config.to_json_string(use_diff=False)
        return {**ident, "folder": None, "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
                "config_source": "in memory", "weights_sha256": None}
    folder = Path(folder)
    weights = {p.name: sha256_file(p) for p in sorted(folder.iterdir()) if p.name.endswith(WEIGHT_SUFFIXES)}
    return {**ident, "folder": str(folder), "config_sha256": sha256_file(folder / "config.json"),
            "config_source": "config.json", "weights_sha256": weights}
