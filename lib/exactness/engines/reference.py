"""Our reference engine as an engine under test (one kernel set per engine).

Configurations: ``decode`` (the oracle: every prompt token one row at a time through the decode kernels),
``batched`` (one chunk), ``batched-<s>`` and ``deep-<s>`` for each step size s. Everything is exposed: prompt and
generated logit rows, KV-cache bytes, drafted decoding (MTP draft, verified by the main model), prompt-cache resume
and concurrent streams in one batch.
"""
from __future__ import annotations

import time

import torch

from .. import __version__
from ..cache import KVFormat
from ..exact import token_hash  # noqa: F401  (re-exported for adapters' tests)
from ..kernels import get_set
from ..paths import Schedule, generate
from ..weights import weights_format
from .base import CAPABILITIES, Configuration, Generation, byte_ids, check_config

OPTIONS = ("preset", "checkpoint", "device", "dtype", "kernels", "kernel_sets", "steps", "deep_threshold", "draft_k",
           "weights", "kv_dtype")


def _schedules(steps, deep_threshold: int) -> dict[str, Schedule]:
    out = {"decode": Schedule("decode", None, deep_threshold), "batched": Schedule("batched", None, deep_threshold)}
    for s in steps:
        out[f"batched-{s}"] = Schedule("batched", s, deep_threshold)
        out[f"deep-{s}"] = Schedule("deep", s, deep_threshold)
    return out


class ReferenceEngine:
    """Our engine with one kernel set (see module docstring).

    Args:
        w: Weights; tokenizer: the checkpoint's tokenizer or None (byte ids); kernels: kernel set name;
        steps: step sizes (tokens); deep_threshold: rows; draft_k: drafts per verify round (1..4);
        kv_dtype: what every request's KV cache stores (cache.KV_DTYPES).
    Raises:
        ValueError: unknown kernel set or kv_dtype, bad step or threshold (Schedule's messages).
    """

    kind = "reference"
    oracle = "decode"
    capabilities = frozenset(CAPABILITIES) - {"chat", "chat_template"}   # chat prompts: the plain template

    def __init__(self, w, tokenizer=None, kernels: str = "invariant", steps=(), deep_threshold: int = 512,
                 draft_k: int = 2, model: dict | None = None, kv_dtype: str = "bf16"):
        self.w, self.tokenizer, self.ks = w, tokenizer, get_set(kernels)
        self.kv_dtype = KVFormat(kv_dtype).dtype
        self.schedules = _schedules(list(steps), deep_threshold)
        self.draft_k, self.model = draft_k, model or {}

    @classmethod
    def from_spec(cls, target: str, options: dict) -> "ReferenceEngine":
        """``reference`` or ``reference:<checkpoint folder>``; options: preset, checkpoint, device, dtype, kernels
        (default: the first of kernel_sets), steps, deep_threshold, draft_k, weights ("bf16", "int4_g128",
        "nvfp4"), kv_dtype ("bf16", "fp8_e4m3", "fp8_e4m3_block"); other names are refused."""
        from ..analysis.hashes import load_model
        unknown = sorted(set(options) - set(OPTIONS) - IGNORED)
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

    def identity(self) -> dict:
        """Kind, package version, model (preset or checkpoint), device, dtype, weights setting, KV-cache dtype,
        kernel set, configurations."""
        return {"kind": self.kind, "version": __version__, "model": self.model, "device": str(self.w.device),
                "dtype": str(self.w.dtype).replace("torch.", ""), "weights": weights_format(self.w),
                "kv_dtype": self.kv_dtype, "kernels": self.ks.name,
                "configurations": {c.name: c.settings for c in self.configurations()}}

    def configurations(self) -> list[Configuration]:
        return [Configuration(n, {"path": s.path, "step": s.step, "deep_threshold": s.deep_threshold,
                                  "kernels": self.ks.name}) for n, s in self.schedules.items()]

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return [int(i) for i in self.tokenizer.encode(text)]
        return byte_ids(text, self.w.cfg.vocab_size, self.w.cfg.bos_id)

    def generate(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Generation:
        check_config(self, config)
        run = generate(self.w, torch.tensor(prompt_ids, dtype=torch.int64), gen_tokens, self.ks,
                       self.schedules[config], keep_cache=True, kv_dtype=self.kv_dtype)
        g = _generation(config, run.gen_ids, run.prompt_logits, run.gen_logits, run.cache, run.ttft_s,
                        run.decode_s, {"served": run.served})
        if run.token_times:   # perf_counter stamps -> seconds since the request
            g.token_times = [t - run.token_times[0] + run.ttft_s for t in run.token_times]
        return g

    def drafted(self, prompt_ids: list[int], gen_tokens: int, config: str) -> Generation:
        """MTP drafts (draft_k per round) verified by the main model, prefilled as ``config`` says."""
        from ..mtp import generate_drafted
        check_config(self, config)
        t0 = time.perf_counter()
        res = generate_drafted(self.w, torch.tensor(prompt_ids), gen_tokens, self.ks, self.schedules[config],
                               k=self.draft_k, keep_cache=True, kv_dtype=self.kv_dtype)
        return _generation(config, res.gen_ids, None, res.gen_logits, res.cache, time.perf_counter() - t0, 0.0,
                           {"acceptance_rate": res.stats.acceptance_rate})

    def resumed(self, prefix_ids: list[int], prompt_ids: list[int], gen_tokens: int, config: str) -> Generation:
        """The prefix prefilled and kept in a prompt cache, then ``prompt_ids`` resumed from it."""
        from ..prompt_cache import PromptCache, generate_cached
        check_config(self, config)
        pc, sched = PromptCache(budget_gib=4.0, mode="any"), self.schedules[config]
        generate_cached(self.w, pc, torch.tensor(prefix_ids), 1, self.ks, sched, kv_dtype=self.kv_dtype)
        run = generate_cached(self.w, pc, torch.tensor(prompt_ids), gen_tokens, self.ks, sched, keep_cache=True,
                              kv_dtype=self.kv_dtype)
        return _generation(config, run.gen_ids, None, run.gen_logits, run.cache, 0.0, 0.0,
                           {"resumed_from": run.resumed_from})

    def concurrent(self, prompts: list[list[int]], gen_tokens: int, config: str) -> list[Generation]:
        """All prompts decoded in one batch (batch.run_streams, all joining at step 0, one cache slot each);
        ``info["batch_rows"]`` is the largest decode batch (rows) run."""
        from ..batch import run_streams
        check_config(self, config)
        res = run_streams(self.w, [torch.tensor(p) for p in prompts], gen_tokens, self.ks, self.schedules[config],
                          offset=0, max_batch=max(1, len(prompts)), kv_dtype=self.kv_dtype)
        return [_generation(config, s.gen_ids, s.prompt_logits, s.gen_logits, None, 0.0, 0.0,
                            {"batch_rows": res.max_batch_rows}) for s in res.streams]

    def close(self) -> None:
        self.w = None


IGNORED = {"prompts", "gen_tokens", "profile", "prompt_max_tokens"}  # profile fields an engine does not take


def _generation(config, gen_ids, prompt_logits, gen_logits, cache, ttft, decode, info) -> Generation:
    kv = None if cache is None else [t[0, :cache.lengths[0]] for t in (*cache.k, *cache.v)]
    return Generation(config, gen_ids.cpu(), None if prompt_logits is None else prompt_logits.cpu(),
                      None if gen_logits is None else gen_logits.cpu(), None, kv, ttft, decode, None, info)
