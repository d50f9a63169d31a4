"""llama.cpp as an engine under test, in process through llama-cpp-python (``llamacpp:/path/model.gguf``).

Configurations are micro-batch sizes: ``n_ubatch-<u>`` runs the prompt as one ``llama_decode`` call (n_batch covers
the context) that llama.cpp splits into micro-batches of ``u`` rows; ``n_ubatch-1`` (token by token through the
KV cache) is the oracle by default. Every configuration has its own ``Llama`` instance (created on first use, then
kept), with ``logits_all`` so that every prompt row's logits are read back. Runs are on the CPU.

Options (a YAML engine file's keys; the profile's common fields are accepted and only ``steps`` is read):
    ubatch: list of n_ubatch values (default 1, the profile's steps and 512); or
    configurations: list of names ``n_ubatch-<u>`` (instead of ubatch);
    oracle: the oracle's name (default: the smallest n_ubatch); n_ctx: context length in tokens (default 4096:
    also the size of the logits buffer, n_ctx x vocabulary fp32 per configuration); n_threads (default 1);
    seed (default 0);
    kv_type: the KV cache's storage type, ``f16`` (llama.cpp's default), ``bf16`` or ``f32``;
    dumps: a folder: the first prompt each configuration generates is also dumped op by op to ``<dumps>/<config>``
    (dumps/llamacpp.py: that configuration's micro-batches against the prompt token by token).

What comes back: prompt and generated logits (llama.cpp's fp32 output rows), the KV cache as serialised by
``llama_state_seq_get_data`` (parsed by llamacpp_kv.py into per-layer K and V tensors of the cache's storage type;
None with the reason in ``info`` when the blob is not in the layout it parses), drafted decoding with llama-cpp-python's
prompt-lookup draft model, and a prompt resumed from llama.cpp's saved state. No concurrent requests.
"""
from __future__ import annotations

import ctypes
import hashlib
import re
import time
from pathlib import Path

import numpy as np
import torch

from ..run import Run
from .base import Configuration, EngineError, NotAvailable, check_config
from .llamacpp_kv import parse_seq_state

INSTALL = "pip install llama-cpp-python"
KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30}  # ggml_type ids
COMMON_KEYS = {"profile", "preset", "device", "dtype", "prompts", "prompt_max_tokens", "steps", "gen_tokens",
               "deep_threshold", "kernel_sets"}
OWN_KEYS = {"ubatch", "configurations", "oracle", "n_ctx", "n_threads", "seed", "kv_type", "dumps"}
_NAME = re.compile(r"n_ubatch-([1-9][0-9]*)")


def _llama_cpp():
    """The llama_cpp module. Raises ImportError with the install line when it is missing."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ImportError(f"the llamacpp engine needs llama-cpp-python: {INSTALL}") from e
    return llama_cpp


def _ubatches(options: dict) -> list[int]:
    """The n_ubatch values the options ask for (sorted, unique). Raises ValueError naming the bad value."""
    if options.get("configurations") is not None:
        if options.get("ubatch") is not None:
            raise ValueError("llamacpp options: give either 'ubatch' or 'configurations', not both")
        names = options["configurations"]
        bad = [n for n in names or [None] if not (isinstance(n, str) and _NAME.fullmatch(n))]
        if bad:
            raise ValueError(f"llamacpp configurations {bad!r} are not allowed; allowed: names n_ubatch-<u>, u >= 1")
        return sorted({int(_NAME.fullmatch(n).group(1)) for n in names})
    ub = options.get("ubatch")
    if ub is None:
        ub = [1, *(options.get("steps") or []), 512]
    if not isinstance(ub, (list, tuple)) or not ub or not all(isinstance(u, int) and not isinstance(u, bool)
                                                              and u > 0 for u in ub):
        raise ValueError(f"llamacpp option ubatch={ub!r} is not allowed; allowed: a non-empty list of positive ints")
    return sorted(set(ub))


def _check_options(options: dict) -> None:
    extra = sorted(set(options) - OWN_KEYS - COMMON_KEYS)
    if extra:
        raise ValueError(f"llamacpp engine options {extra} are not known; allowed: {', '.join(sorted(OWN_KEYS))}")
    if options.get("dumps") is not None and not isinstance(options["dumps"], str):
        raise ValueError(f"llamacpp option dumps={options['dumps']!r} is not allowed; allowed: a folder path")
    for key in ("n_ctx", "n_threads"):
        v = options.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"llamacpp option {key}={v!r} is not allowed; allowed: a positive int")
    if options.get("kv_type", "f16") not in KV_TYPES:
        raise ValueError(f"llamacpp option kv_type={options['kv_type']!r} is not allowed; "
                         f"allowed: {', '.join(KV_TYPES)}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python on a local GGUF file (the module docstring lists the options)."""

    kind = "llamacpp"
    capabilities = frozenset({"prompt_logits", "gen_logits", "kv_bytes", "drafted", "prompt_cache", "token_ids"})

    def __init__(self, gguf_path: str | Path, ubatch: list[int], oracle: str | None = None, n_ctx: int = 4096,
                 n_threads: int = 1, seed: int = 0, kv_type: str = "f16", dumps: str | None = None):
        self.lc = _llama_cpp()
        self.path = Path(gguf_path)
        if not self.path.is_file():
            raise ValueError(f"llamacpp target {str(gguf_path)!r} is not a GGUF file")
        self.n_ctx, self.n_threads, self.seed, self.kv_type = n_ctx, n_threads, seed, kv_type
        self.dumps, self.dumped = dumps, {}
        self._configs = [Configuration(f"n_ubatch-{u}", {"n_ubatch": u, "n_batch": max(u, n_ctx),
                                                         "n_ctx": n_ctx, "n_threads": n_threads,
                                                         "kv_type": kv_type}) for u in ubatch]
        self.oracle = oracle or self._configs[0].name
        check_config(self, self.oracle)
        self._llms: dict[str, object] = {}
        self._draft_llms: dict[str, object] = {}
        self._sha: str | None = None
        self.meta = self._llm(self.oracle).metadata
        self.n_vocab = self._llm(self.oracle).n_vocab()

    @classmethod
    def from_spec(cls, target: str, options: dict) -> "LlamaCppEngine":
        """``target``: the GGUF file. Raises ValueError (unknown option or bad value, no such file), ImportError
        (llama-cpp-python missing; the message has the install line)."""
        if not target:
            raise ValueError("the llamacpp engine needs a GGUF file: llamacpp:/path/model.gguf")
        _check_options(options)
        kw = {k: options[k] for k in ("n_ctx", "n_threads", "seed", "kv_type", "oracle", "dumps")
              if options.get(k) is not None}
        return cls(target, _ubatches(options), **kw)

    # --- instances -------------------------------------------------------------------------------------------

    def _new_llm(self, config: str, draft_model=None):
        s = next(c.settings for c in self._configs if c.name == config)
        kv = KV_TYPES[self.kv_type]
        try:
            return self.lc.Llama(model_path=str(self.path), n_ctx=self.n_ctx, n_batch=s["n_batch"],
                                 n_ubatch=s["n_ubatch"], logits_all=True, n_threads=self.n_threads,
                                 n_threads_batch=self.n_threads, seed=self.seed, type_k=kv, type_v=kv,
                                 draft_model=draft_model, verbose=False)
        except (ValueError, RuntimeError) as e:
            raise EngineError(f"llamacpp {self.path}: {config}: llama.cpp could not load the model: {e}") from e

    def _llm(self, config: str):
        check_config(self, config)
        if config not in self._llms:
            self._llms[config] = self._new_llm(config)
        return self._llms[config]

    # --- protocol --------------------------------------------------------------------------------------------

    def configurations(self) -> list[Configuration]:
        return list(self._configs)

    def identity(self) -> dict:
        """kind, llama-cpp-python's version, the GGUF file's path, SHA-256 and architecture metadata, device
        (cpu), the file's dtype (general.file_type) and each configuration's settings."""
        if self._sha is None:
            self._sha = _sha256(self.path)
        arch = self.meta.get("general.architecture", "")
        return {"kind": self.kind, "version": {"llama_cpp_python": self.lc.__version__},
                "model": {"gguf": str(self.path), "sha256": self._sha, "architecture": arch,
                          "metadata": {k: v for k, v in self.meta.items() if k.startswith(arch + ".")}},
                "device": "cpu", "dtype": {"file_type": self.meta.get("general.file_type"), "kv": self.kv_type},
                "oracle": self.oracle, "configurations": {c.name: c.settings for c in self._configs}}

    def encode(self, text: str) -> list[int]:
        """llama.cpp's tokenization of ``text`` (BOS added as the GGUF says; special-token names are plain text).
        For a gguf_export file these are the byte tokenizer's ids, BOS first."""
        return list(self._llm(self.oracle).tokenize(text.encode("utf-8"), add_bos=True, special=False))

    def _check_run(self, prompt_ids: list[int], gen_tokens: int) -> list[int]:
        ids = [int(i) for i in prompt_ids]
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if not ids or bad:
            raise ValueError(f"prompt ids must be a non-empty list of ids in [0, {self.n_vocab}); got {len(ids)} "
                             f"ids{f', first bad id {bad[0]}' if bad else ''}")
        if not isinstance(gen_tokens, int) or gen_tokens < 0 or len(ids) + max(gen_tokens, 1) > self.n_ctx:
            raise ValueError(f"gen_tokens={gen_tokens!r} with a prompt of {len(ids)} tokens does not fit n_ctx="
                             f"{self.n_ctx} (gen_tokens must be an int >= 0; raise the n_ctx option)")
        return ids

    def _eval(self, llm, ids: list[int], config: str) -> None:
        try:
            llm.eval(ids)
        except (RuntimeError, ValueError, OSError) as e:
            raise EngineError(f"llamacpp {self.path.name}: {config}: llama_decode failed: {e}") from e

    def _decode(self, llm, first: np.ndarray, gen_tokens: int, config: str, t0: float):
        """Greedy tokens from logits row ``first`` on: (ids [G], logits [G, V] fp32, token_times)."""
        gen, rows, times, row = [], [], [], first
        for g in range(gen_tokens):
            tok = int(np.argmax(row))  # first maximal id, as torch.argmax
            gen.append(tok)
            rows.append(row)
            times.append(time.perf_counter() - t0)
            if g + 1 < gen_tokens:
                self._eval(llm, [tok], config)
                row = llm.scores[llm.n_tokens - 1].copy()
        logits = torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, self.n_vocab)
        return torch.tensor(gen, dtype=torch.int64), logits, times

    def _generation(self, config, llm, prompt_logits, gen, glog, times, info) -> Run:
        kv, why = self._kv(llm)
        info = {**info, **({"kv": why} if why else {})}
        ttft = times[0] if times else 0.0
        return Run(config=config, gen_ids=gen, prompt_logits=prompt_logits, gen_logits=glog, kv=kv,
                   ttft_s=ttft, decode_s=(times[-1] - ttft) if times else 0.0, token_times=times, info=info)

    def generate(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """The prompt as one batch split in n_ubatch rows, then ``gen_tokens`` greedy tokens one at a time (end of
        sequence not a stop). Returns prompt_logits [P, V] and gen_logits [G, V] fp32, gen_ids [G] int64, kv."""
        llm = self._llm(config)
        ids = self._check_run(prompt_ids, gen_tokens)
        t0 = time.perf_counter()
        llm.reset()
        self._eval(llm, ids, config)
        plog = torch.from_numpy(llm.scores[:len(ids)].copy())
        gen, glog, times = self._decode(llm, plog[-1].numpy(), gen_tokens, config, t0)
        info = {"dumps": self.dump(ids, config, Path(self.dumps) / config)} if self.dumps and \
            config not in self.dumped else {}
        return self._generation(config, llm, plog, gen, glog, times, info)

    def dump(self, prompt_ids: list[int], config: str, folder, **select) -> str:
        """Dump llama.cpp op by op on ``prompt_ids``: ``config``'s micro-batches (prompt role) against the prompt
        token by token (decode role), with this engine's settings; ``select``: dump_llamacpp's layers, positions,
        weights, gen_tokens. Returns the folder. Raises ValueError (bad selection), FileExistsError (folder not
        empty)."""
        from ..dumps.llamacpp import dump_llamacpp
        check_config(self, config)
        s = next(c.settings for c in self._configs if c.name == config)
        self.dumped[config] = dump_llamacpp(folder, self.path, prompt_ids, s["n_ubatch"], n_ctx=self.n_ctx,
                                            n_threads=self.n_threads, kv_type=self.kv_type, **select)
        return self.dumped[config]

    def resumed(self, prefix_ids: list[int], prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """The prefix evaluated, llama.cpp's state saved (``Llama.save_state``: llama_state_get_data), the context
        cleared by evaluating an unrelated token, the state restored (``load_state``) and the rest of the prompt
        evaluated on top of it; then greedy decoding as generate(). prompt_logits rows of the prefix are those
        the prefix request computed (restored with the state)."""
        llm = self._llm(config)
        ids = self._check_run(prompt_ids, gen_tokens)
        n = len(prefix_ids)
        if not 0 < n < len(ids) or [int(i) for i in prefix_ids] != ids[:n]:
            raise ValueError(f"prefix_ids ({n} ids) must be a proper, non-empty prefix of prompt_ids ({len(ids)})")
        llm.reset()
        self._eval(llm, ids[:n], config)
        state = llm.save_state()
        llm.reset()
        self._eval(llm, [ids[n]], config)  # overwrite the cache's first cell: the restore must bring it back
        t0 = time.perf_counter()
        llm.load_state(state)
        self._eval(llm, ids[n:], config)
        plog = torch.from_numpy(llm.scores[:len(ids)].copy())
        gen, glog, times = self._decode(llm, plog[-1].numpy(), gen_tokens, config, t0)
        return self._generation(config, llm, plog, gen, glog, times,
                                {"resumed": {"prefix_tokens": n, "state_bytes": int(state.llama_state_size)}})

    def drafted(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """Greedy generation through ``Llama.generate`` (greedy sampler: temp 0, top_k 1) with llama-cpp-python's
        prompt-lookup draft model (max_ngram_size 2, 10 drafted tokens): drafts are verified in one batch and the
        cache cut back after the first rejected one. gen_logits are the rows each token was sampled from."""
        check_config(self, config)
        ids = self._check_run(prompt_ids, gen_tokens)
        if config not in self._draft_llms:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            self._draft_llms[config] = self._new_llm(config, LlamaPromptLookupDecoding(2, 10))
        llm = self._draft_llms[config]
        llm.reset()
        gen, rows, times, evals = [], [], [], []
        t0 = time.perf_counter()
        it = llm.generate(ids, top_k=1, temp=0.0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
        try:
            for tok in it:
                rows.append(llm.scores[len(ids) + len(gen) - 1].copy())
                gen.append(int(tok))
                times.append(time.perf_counter() - t0)
                evals.append(int(llm.n_tokens))
                if len(gen) == gen_tokens:
                    break
        except (RuntimeError, ValueError, OSError) as e:
            raise EngineError(f"llamacpp {self.path.name}: {config}: drafted generation failed: {e}") from e
        finally:
            it.close()
        glog = torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, self.n_vocab)
        info = {"drafted": {"draft": "prompt-lookup", "max_ngram_size": 2, "num_pred_tokens": 10,
                            "cached_tokens_at_each_token": evals}}
        return Run(config=config, gen_ids=torch.tensor(gen, dtype=torch.int64), gen_logits=glog,
                   ttft_s=times[0] if times else 0.0, decode_s=(times[-1] - times[0]) if times else 0.0,
                   token_times=times, info=info)

    def concurrent(self, prompts: list[list[int]], gen_tokens: int, config: str) -> list[Run]:
        raise NotAvailable("llama-cpp-python's Llama runs one sequence at a time (no batched requests in process)")

    def seq_state(self, llm) -> bytes:
        """The ``llama_state_seq_get_data`` blob of sequence 0 of Llama instance ``llm`` (its KV cache)."""
        C, ctx = self.lc.llama_cpp, llm._ctx.ctx
        size = C.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        n = C.llama_state_seq_get_data(ctx, buf, size, 0)
        return bytes(buf)[:n]

    def _kv(self, llm):
        """(per-layer K then V tensors, None) parsed from llama_state_seq_get_data of sequence 0, or (None, the
        reason) when the blob is not in the layout parse_seq_state knows."""
        heads = int(self.meta.get(f"{self.meta.get('general.architecture')}.attention.head_count_kv", 0))
        try:
            return parse_seq_state(self.seq_state(llm), llm.n_tokens, heads), None
        except ValueError as e:
            return None, f"KV bytes not read: {e}"

    def close(self) -> None:
        for llm in [*self._llms.values(), *self._draft_llms.values()]:
            llm.close()
        self._llms.clear()
        self._draft_llms.clear()
