"""Our reference engine, built once: weights, kernel set, KV format, expert provider, CUDA graphs and MTP weights
are decided when it is made (as gpt-fast's setup_caches decides sizes and dtypes once); a run then takes a prompt,
the tokens wanted and a configuration.

Configurations: by name (``decode``, the oracle: every prompt token one row at a time through the decode kernels;
``batched``, one chunk; ``batched-<s>`` and ``deep-<s>`` for each step size s), or any (path, step, deep threshold)
through ``configuration``. Everything is exposed: prompt and generated logit rows, KV-cache bytes, drafted decoding
(MTP drafts verified by the main model), prompt-cache resume, concurrent streams in one batch, packed prefill and
kernel taps.

Each run kind has two views:

    run, run_drafted, run_resumed,      the whole run.Run (info: what served it; the KV cache when kept), what
    run_concurrent, run_packed          the receipt sections read
    generate, drafted, resumed,         the Engine protocol (engines/base.py): the same runs as the engines
    concurrent                          section records any engine's
"""
from __future__ import annotations

import time

import torch

from .. import __version__
from ..batch import BATCH_LIMIT, PACKED_PLANS, StreamsResult, run_packed, run_streams
from ..cache import KVFormat
from ..kernels import get_set
from ..model import tapping
from ..mtp import generate_drafted, resolve_mtp
from ..paths import PATHS, Schedule, generate
from ..prompt_cache import MODES, PromptCache, generate_cached
from ..run import Run
from ..weights import weights_format
from .base import CAPABILITIES, PROFILE_OPTIONS, Configuration, byte_ids, check_config

OPTIONS = ("preset", "checkpoint", "device", "dtype", "kernels", "kernel_sets", "steps", "deep_threshold", "draft_k",
           "weights", "kv_dtype")


def _schedules(steps, deep_threshold: int) -> dict[str, Schedule]:
    out = {"decode": Schedule("decode", None, deep_threshold), "batched": Schedule("batched", None, deep_threshold)}
    for s in steps:
        out[f"batched-{s}"] = Schedule("batched", s, deep_threshold)
        out[f"deep-{s}"] = Schedule("deep", s, deep_threshold)
    return out


def _ids(prompt) -> torch.Tensor:
    """Prompt token ids (a list of ints or a tensor) -> [P] int64 (a tensor already int64 as is)."""
    return torch.as_tensor(prompt, dtype=torch.int64)


class ReferenceEngine:
    """Our engine with one kernel set (see module docstring).

    Args:
        w: Weights (with an offload ``experts`` store: its ``weights``); tokenizer: the checkpoint's tokenizer or
        None (byte ids); kernels: kernel set (name or KernelSet); steps: step sizes (tokens) of the named
        configurations; deep_threshold: rows; draft_k: drafts per verify round (1..4); model: what identity()
        names the model by; kv_dtype: what every run's KV cache stores (cache.KV_DTYPES name or a KVFormat);
        experts: the expert provider (None: the resident weights of ``w``; an offload.ExpertStore); graphs:
        replay decode steps from CUDA graphs where one serves; mtp: the MTP weights (None: mtp.resolve_mtp's,
        resolved on the first drafted run).
    Raises:
        ValueError: unknown kernel set or kv_dtype, bad step or threshold (Schedule's messages).
    """

    kind = "reference"
    oracle = "decode"
    capabilities = frozenset(CAPABILITIES) - {"chat", "chat_template"}   # chat prompts: the plain template
    PATHS = PATHS                            # prefill paths: decode, batched, deep
    BATCH_LIMIT = BATCH_LIMIT                # prompts one concurrent or packed run holds by default
    PACKED_PLANS = tuple(PACKED_PLANS)       # plans a packed prefill may run
    PROMPT_CACHE_MODES = MODES               # which prefix states a prompt cache keeps: grid, any

    def __init__(self, w, tokenizer=None, kernels="invariant", steps=(), deep_threshold: int = 512,
                 draft_k: int = 2, model: dict | None = None, kv_dtype="bf16", *, experts=None,
                 graphs: bool = False, mtp=None):
        self.w, self.tokenizer, self.ks = w, tokenizer, get_set(kernels)
        self.kv, self.kv_dtype = kv_dtype, KVFormat.of(kv_dtype).dtype   # refused here when unknown
        self.steps, self.deep_threshold = list(steps), deep_threshold
        self.schedules = _schedules(self.steps, deep_threshold)
        self.draft_k, self.model = draft_k, model or {}
        self.experts, self.graphs = experts, graphs
        self._mtp = {"given": mtp}   # shared with with_kernels' engines: the head is resolved once

    @classmethod
    def from_spec(cls, target: str, options: dict) -> "ReferenceEngine":
        """``reference`` or ``reference:<checkpoint folder>``; options: preset, checkpoint, device, dtype, kernels
        (default: the first of kernel_sets), steps, deep_threshold, draft_k, weights ("bf16", "int4_g128",
        "nvfp4"), kv_dtype ("bf16", "fp8_e4m3", "fp8_e4m3_block"); other names are refused."""
        from ..checkpoint import load_model
        unknown = sorted(set(options) - set(OPTIONS) - PROFILE_OPTIONS)
        if unknown:
            raise ValueError(f"reference engine: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(OPTIONS)}")
        ckpt = target or options.get("checkpoint") or ""
        preset = options.get("preset") or "tiny"
        kv_dtype = KVFormat(options.get("kv_dtype") or "bf16").dtype   # refused before the model loads
        w, tok = load_model(preset, options.get("device") or "cpu", options.get("dtype") or "bfloat16", ckpt,
                            options.get("weights") or "bf16")
        kernels = options.get("kernels") or (options.get("kernel_sets") or ["invariant"])[0]
        return cls(w, tok, kernels, options.get("steps") or (), options.get("deep_threshold") or 512,
                   options.get("draft_k") or 2, {"checkpoint": ckpt} if ckpt else {"preset": preset}, kv_dtype)

    def with_kernels(self, kernels) -> "ReferenceEngine":
        """The same engine (weights, KV format, experts, graphs, MTP head) with kernel set ``kernels``."""
        other = ReferenceEngine(self.w, self.tokenizer, kernels, self.steps, self.deep_threshold, self.draft_k,
                                self.model, self.kv, experts=self.experts, graphs=self.graphs)
        other._mtp = self._mtp
        return other

    def identity(self) -> dict:
        """Kind, package version, model (preset or checkpoint), device, dtype, weights setting, KV-cache dtype,
        kernel set, configurations."""
        return {"kind": self.kind, "version": __version__, "model": self.model, "device": str(self.w.device),
                "dtype": str(self.w.dtype).replace("torch.", ""), "weights": weights_format(self.w),
                "kv_dtype": self.kv_dtype, "kernels": self.ks.name,
                "configurations": {c.name: c.settings for c in self.configurations()}}

    # ---------------------------------------------------------------------------------------- configurations

    def _configuration(self, name: str, s: Schedule) -> Configuration:
        return Configuration(name, {"path": s.path, "step": s.step, "deep_threshold": s.deep_threshold,
                                    "kernels": self.ks.name})

    def configurations(self) -> list[Configuration]:
        return [self._configuration(n, s) for n, s in self.schedules.items()]

    def configuration(self, path: str, step: int | None = None, deep_threshold: int | None = None) -> Configuration:
        """Any prefill: ``path`` (PATHS) at ``step`` rows per segment (None: one segment), segments of at least
        ``deep_threshold`` rows (default: the engine's) on the deep plan; named as Schedule.name.

        Raises:
            ValueError: what Schedule raises (unknown path, bad step or threshold).
        """
        s = Schedule(path, step, self.deep_threshold if deep_threshold is None else deep_threshold)
        return self._configuration(s.name, s)

    def schedule(self, config: str | Configuration) -> Schedule:
        """The prefill of a configuration: a name of configurations(), or a Configuration with path, step and
        deep_threshold settings (configuration's).

        Raises:
            ValueError: an unknown name (names the known ones), or settings without path, step and deep_threshold.
        """
        if isinstance(config, Configuration):
            s = config.settings
            if not {"path", "step", "deep_threshold"} <= set(s):
                raise ValueError(f"configuration {config.name!r} has no path, step and deep_threshold settings "
                                 f"(got {sorted(s)}); make it with ReferenceEngine.configuration")
            return Schedule(s["path"], s["step"], s["deep_threshold"])
        check_config(self, config)
        return self.schedules[config]

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return [int(i) for i in self.tokenizer.encode(text)]
        return byte_ids(text, self.w.cfg.vocab_size, self.w.cfg.bos_id)

    def tapping(self, recorder):
        """Context manager: within it, every kernel call of this engine's forwards goes to
        ``recorder.record(**call)`` (model.tapping)."""
        return tapping(recorder)

    def load_mtp(self):
        """The MTP weights of drafted runs (mtp.resolve_mtp: the given ones, the checkpoint's, or a head derived
        from the model's own layers), resolved once and shared with the engines of with_kernels."""
        if "resolved" not in self._mtp:
            self._mtp["resolved"] = resolve_mtp(self.w, self._mtp["given"])
        return self._mtp["resolved"]

    # ---------------------------------------------------------------------------------------- whole runs

    def run(self, prompt_ids, gen_tokens: int, config: str | Configuration = "decode", *, keep_kv: bool = False,
            progress=None) -> Run:
        """paths.generate: prefill ``prompt_ids`` [P] as ``config`` says, then ``gen_tokens`` greedy tokens;
        ``keep_kv``: the run keeps its KV cache (Run.cache, Run.kv); progress: a tqdm bar (one per row)."""
        return generate(self.w, _ids(prompt_ids), gen_tokens, self.ks, self.schedule(config), keep_cache=keep_kv,
                        experts=self.experts, progress=progress, kv_dtype=self.kv, graphs=self.graphs)

    def run_drafted(self, prompt_ids, gen_tokens: int, config: str | Configuration, *, draft: str = "mtp",
                    keep_kv: bool = False) -> Run:
        """mtp.generate_drafted: draft_k drafts per verify forward from ``draft`` ("mtp": the MTP head of
        load_mtp; "self": the main model's own decode steps, a sanity mode)."""
        mtp = self.load_mtp() if draft == "mtp" else None
        return generate_drafted(self.w, _ids(prompt_ids), gen_tokens, self.ks, self.schedule(config),
                                k=self.draft_k, draft=draft, mtp=mtp, keep_cache=keep_kv, experts=self.experts,
                                kv_dtype=self.kv, graphs=self.graphs)

    def prompt_cache(self, budget_gib: float, mode: str = "grid", step: int | None = None) -> PromptCache:
        """An empty prompt cache for run_resumed (prompt_cache.PromptCache: ``mode`` of PROMPT_CACHE_MODES)."""
        return PromptCache(budget_gib, mode, step)

    def run_resumed(self, prompt_ids, gen_tokens: int, config: str | Configuration, cache: PromptCache, *,
                    keep_kv: bool = False) -> Run:
        """prompt_cache.generate_cached: the longest prefix ``cache`` holds restored, the tail prefilled, the
        prompt's states kept in ``cache``; Run.prompt_start is the resume point."""
        return generate_cached(self.w, cache, _ids(prompt_ids), gen_tokens, self.ks, self.schedule(config),
                               keep_cache=keep_kv, experts=self.experts, kv_dtype=self.kv)

    def run_concurrent(self, prompts: list, gen_tokens: int, config: str | Configuration, *, offset: int = 0,
                       max_batch: int = BATCH_LIMIT) -> StreamsResult:
        """batch.run_streams: stream j (prompts[j]) joins after j * offset steps, one decode forward per step."""
        return run_streams(self.w, [_ids(p) for p in prompts], gen_tokens, self.ks, self.schedule(config),
                           offset=offset, max_batch=max_batch, experts=self.experts, kv_dtype=self.kv,
                           graphs=self.graphs)

    def run_packed(self, prompts: list, gen_tokens: int, plan: str = "batched", *, keep_kv: bool = False) -> list[Run]:
        """batch.run_packed: the prompts prefilled in ONE forward under ``plan`` (PACKED_PLANS), then decoded
        together; one Run per prompt (its cache, when kept, a one-slot copy)."""
        return run_packed(self.w, [_ids(p) for p in prompts], gen_tokens, self.ks, plan, keep_cache=keep_kv,
                          experts=self.experts, kv_dtype=self.kv)

    # ---------------------------------------------------------------------------------------- Engine protocol

    def generate(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        check_config(self, config)
        run = self.run(prompt_ids, gen_tokens, config, keep_kv=True)
        return _engine_run(config, run, {"served": run.served})

    def drafted(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """MTP drafts (draft_k per round) verified by the main model, prefilled as ``config`` says."""
        check_config(self, config)
        t0 = time.perf_counter()
        run = self.run_drafted(prompt_ids, gen_tokens, config, keep_kv=True)
        return _engine_run(config, run, {"acceptance_rate": run.stats.acceptance_rate}, prompt_rows=False,
                           ttft_s=time.perf_counter() - t0)

    def resumed(self, prefix_ids: list[int], prompt_ids: list[int], gen_tokens: int, config: str) -> Run:
        """The prefix prefilled and kept in a prompt cache, then ``prompt_ids`` resumed from it."""
        check_config(self, config)
        pc = self.prompt_cache(4.0, "any")
        self.run_resumed(prefix_ids, 1, config, pc)
        run = self.run_resumed(prompt_ids, gen_tokens, config, pc, keep_kv=True)
        return _engine_run(config, run, {"resumed_from": run.prompt_start}, prompt_rows=False, ttft_s=0.0)

    def concurrent(self, prompts: list[list[int]], gen_tokens: int, config: str) -> list[Run]:
        """All prompts decoded in one batch (batch.run_streams, all joining at step 0, one cache slot each);
        ``info["batch_rows"]`` is the largest decode batch (rows) run."""
        check_config(self, config)
        res = self.run_concurrent(prompts, gen_tokens, config, max_batch=max(1, len(prompts)))
        return [_engine_run(config, s, {"batch_rows": res.max_batch_rows}, ttft_s=0.0) for s in res.streams]

    def close(self) -> None:
        self.w = None


def _engine_run(config: str, run: Run, info: dict, *, prompt_rows: bool = True,
                ttft_s: float | None = None) -> Run:
    """Our run as the engine section sees it: ``info`` only (what the receipt records of it), prompt rows where
    ``prompt_rows`` (a drafted or resumed run's are not compared: its reference is a fresh run), no cache object;
    ``ttft_s`` given: the run's whole time counts as its time to first token and no token times are reported."""
    timed = ttft_s is None
    return Run(config, run.gen_ids, run.prompt_logits if prompt_rows else None, run.gen_logits, None, run.kv,
               run.ttft_s if timed else ttft_s, run.decode_s if timed else 0.0,
               run.token_times if timed else None, info, prompt_ids=run.prompt_ids)
