"""The inference paths as thin wrappers over model.forward.

    decode   the serial oracle: every prompt token one row at a time through the decode kernels, then the reply
    batched  prompt rows in chunks of the step size through the prompt kernels (step None = one chunk)
    deep     prompt segments of the step size; segments of >= deep_threshold rows run the deep plan (64-row dense
             tiles, expert-parallel MoE in 64-member tiles, or whole calls for a set whose kernels fix their own
             tiles: model.Ops), shorter ones the batched plan

A Schedule names the path with its step and deep threshold. Every run records how many segments and rows each plan
actually served, so a deep run that never ran deep shows. Generation is greedy (loop.Loop: the set's argmax
kernel), end-of-sequence ignored; every run kind returns a run.Run. With ``graphs`` the decode steps (on the decode
path every prompt row's step too) replay from a CUDA graph (graphs.GraphDecoder), which writes the eager steps'
bytes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .cache import KVCache, KVFormat
from .expert_providers import ExpertProvider, ResidentExperts
from .graphs import GraphDecoder
from .kernels import KernelSet, get_set
from .loop import DecodeStep, Loop, Stream
from .model import BATCHED, DECODE, DEEP, ForwardOut, Plan, check_rows, forward_span
from .run import Run, cache_kv
from .weights import Weights

PATHS = ("decode", "batched", "deep")


def served_counts() -> dict:
    """Run.served before a prefill: plan -> {"segments": 0, "rows": 0} for each of PATHS."""
    return {p: {"segments": 0, "rows": 0} for p in PATHS}


@dataclass(frozen=True)
class Schedule:
    """How a prompt is prefilled: the path, its step size and the deep threshold.

    Attributes:
        path: ``"decode"``, ``"batched"`` or ``"deep"`` (PATHS).
        step: rows per prefill segment, None = the whole prompt as one segment (the decode path runs one row per
            segment whatever the step).
        deep_threshold: on the deep path, segments of at least this many rows run the deep plan, shorter ones the
            batched plan.
    Raises:
        ValueError: unknown path, step not a positive int or None, deep_threshold not a positive int; each message
            names the value and what is allowed.
    """

    path: str
    step: int | None = None
    deep_threshold: int = 512

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"unknown path {self.path!r}; known paths: {', '.join(PATHS)}")
        if self.step is not None and (not isinstance(self.step, int) or self.step <= 0):
            raise ValueError(f"step size must be a positive int or None (unbounded), got {self.step!r}")
        if not isinstance(self.deep_threshold, int) or self.deep_threshold <= 0:
            raise ValueError(f"deep_threshold must be a positive int (rows), got {self.deep_threshold!r}")

    @property
    def role(self) -> str:
        """Kernel role of the prompt's rows (``"decode"`` on the decode path, else ``"prompt"``)."""
        return "decode" if self.path == "decode" else "prompt"

    @property
    def name(self) -> str:
        """The configuration's name as ReferenceEngine gives it: decode, batched, batched-<step>, deep-<step>."""
        if self.path == "decode" or self.step is None:
            return self.path
        return f"{self.path}-{self.step}"

    def segment_rows(self, n_rows: int) -> int:
        """Rows per prefill segment of a prompt of ``n_rows`` rows."""
        return 1 if self.path == "decode" else (self.step or n_rows)

    def plan(self, rows: int) -> Plan:
        """The plan that computes a segment of ``rows`` rows."""
        if self.path == "decode":
            return DECODE
        return DEEP if self.path == "deep" and rows >= self.deep_threshold else BATCHED


def check_run_args(w: Weights, n_prompt: int, gen_tokens: int) -> None:
    """Validate a run's lengths (the Schedule validates itself).

    Raises:
        ValueError: gen_tokens < 0, an empty prompt, or prompt + generated tokens past the model's max_positions;
            each message names the value and what is allowed.
    """
    if gen_tokens < 0:
        raise ValueError(f"gen_tokens must be >= 0, got {gen_tokens}")
    if n_prompt < 1:
        raise ValueError("the prompt is empty; at least one token is needed")
    if n_prompt + gen_tokens > w.cfg.max_positions:
        raise ValueError(f"prompt of {n_prompt} tokens + {gen_tokens} generated exceeds the model's "
                         f"max_positions={w.cfg.max_positions}")


def prefill(w: Weights, cache: KVCache, ids: torch.Tensor, kernels: KernelSet | str, schedule: Schedule, *,
            start: int = 0, slot: int = 0, served: dict | None = None, experts: ExpertProvider | None = None,
            progress=None) -> ForwardOut:
    """Write prompt rows ``ids`` [P] int64 at positions start..start+P-1 of cache slot ``slot``.

    The rows run in segments of ``schedule.segment_rows(P)``, each through ``schedule.plan(rows)``; a deep segment
    runs the batched plan instead when the expert provider is not deep_ready (``served["fallback"]`` counts it).

    Args:
        served: plan kind -> {"segments", "rows"}, updated in place (None: counted and dropped).
        experts: the expert provider (None: the resident weights of ``w``).
        progress: a tqdm bar, advanced by each segment's rows once the device has run them.
    Returns:
        ForwardOut(logits [P, V] fp32, hidden [P, H] storage dtype); the MTP head reads the hidden rows.
    Raises:
        ValueError: a position outside the cache (model.forward_span).
    """
    served = served_counts() if served is None else served
    experts = ResidentExperts(w.layers) if experts is None else experts
    ids = ids.to(w.device)
    if ids.numel():
        check_rows(cache, start, slot, start + ids.numel() - 1, slot)      # before any segment runs
    seg = schedule.segment_rows(ids.numel())
    out, queued = [], []
    for a in range(0, ids.numel(), seg):
        rows = ids[a:a + seg]
        n = rows.numel()
        plan = schedule.plan(n)
        if plan is DEEP and not experts.deep_ready:
            plan = BATCHED  # the deep buffers (expert ring) could not be reserved: the batched pass serves
            fb = served.setdefault("fallback", {"segments": 0, "rows": 0, "reason": experts.fallback_reason})
            fb["segments"] += 1
            fb["rows"] += n
        out.append(forward_span(w, rows, start + a, cache, kernels, plan, slot=slot, experts=experts))
        served[plan.kind]["segments"] += 1
        served[plan.kind]["rows"] += n
        if progress is not None:
            queued = _count_done(progress, queued + [(_segment_end(w.device), n)])
    if progress is not None:
        _count_done(progress, queued, wait=True)
    return ForwardOut(torch.cat([o.logits for o in out]), torch.cat([o.hidden for o in out]))


def _segment_end(device: torch.device):
    """A CUDA event recorded after a segment's launches (None on other devices: their rows are done)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def _count_done(progress, queued: list, wait: bool = False) -> list:
    """Advance the bar by the rows of the leading segments the device has finished (all of them, waiting, with
    ``wait``): a segment's rows count when they are done, not when they are queued. Returns the segments left."""
    while queued and (queued[0][0] is None or wait or queued[0][0].query()):
        ev, n = queued.pop(0)
        if ev is not None:
            ev.synchronize()
        progress.update(n)
    return queued


def _decode_prompt(step: DecodeStep, ids: torch.Tensor, served: dict, progress=None) -> torch.Tensor:
    """The decode path's prefill through ``step``: prompt ids [P] int64 (device), one decode step per row at
    positions 0..P-1 of slot 0 -> logits [P, V] fp32 (what prefill returns on the decode path)."""
    out = []
    for i in range(ids.numel()):
        out.append(step(ids[i:i + 1], [i], [0]))
        served["decode"]["segments"] += 1
        served["decode"]["rows"] += 1
        if progress is not None:
            progress.update(1)
    return torch.cat(out)


def _advance(progress) -> bool:
    """One generated token on the bar; False: the stream goes on (tqdm.update's own result says it redrew)."""
    progress.update(1)
    return False


def _prompt_graphs(dec: GraphDecoder) -> str:
    """How the decode path's prompt rows ran with graphs (asked after them): "replayed" where the graph served
    them (row 0 captures it), else "eager: <why>" (the eager decode rows, as without graphs)."""
    if dec.reason is None and dec.replays:
        return "replayed"
    return "eager: " + (dec.reason or "a one-row prompt: its row captured the graph")


def generate(w: Weights, prompt_ids: torch.Tensor, gen_tokens: int, kernels: KernelSet | str = "fast",
             schedule: Schedule = Schedule("decode"), *, keep_cache: bool = False,
             experts: ExpertProvider | None = None, progress=None, kv_dtype: str | KVFormat = "bf16",
             graphs: bool = False) -> Run:
    """Prefill ``prompt_ids`` [P] int64 as ``schedule`` says and greedily generate ``gen_tokens`` tokens.

    Args:
        keep_cache: keep the KV cache in the result (Run.cache, Run.kv); experts: the expert provider (None: the
            resident weights); progress: a tqdm bar, advanced by one per prompt row and per generated token;
        kv_dtype: what the KV cache stores (cache.KV_DTYPES name or a cache.KVFormat);
        graphs: replay the decode steps from a CUDA graph (graphs.GraphDecoder: the same bytes), on the decode
            path the prompt rows' steps too; where a graph cannot serve, the eager steps run and Run.graphs says why.
    Returns:
        Run named ``schedule.name``; info: path, step, kernels, deep_threshold, kv_dtype, served (plan ->
        {"segments", "rows"} the prefill ran), graphs ({} without graphs, else GraphDecoder.info() and on the
        decode path "prompt": "replayed" or "eager: <why>").
    Raises:
        ValueError: see check_run_args; an unknown kernel set or kv_dtype.
    """
    ks = get_set(kernels)
    P = int(prompt_ids.numel())
    check_run_args(w, P, gen_tokens)
    cache = KVCache(w.cfg, P + max(gen_tokens, 1), 1, w.dtype, w.device, kv_dtype)
    served = served_counts()
    step = DecodeStep(w, cache, ks, experts=experts, graphs=graphs)
    dec = step.decoder(1) if graphs else None
    t0 = time.perf_counter()
    if dec is not None and schedule.path == "decode":   # the prompt rows are decode steps: replayed too
        plog = _decode_prompt(step, prompt_ids.to(w.device), served, progress)
    else:
        plog = prefill(w, cache, prompt_ids, ks, schedule, served=served, experts=experts, progress=progress).logits
    prompt_graphs = None if dec is None or schedule.path != "decode" else _prompt_graphs(dec)
    s = Stream(0, P, gen_tokens, on_token=None if progress is None else lambda *_: _advance(progress))
    loop = Loop(ks, step, timed=True)
    loop.start(s, plog[-1:], schedule.role)   # token 0 from the last prompt row, the others from decode steps
    loop.run([s])
    graph_info = {} if dec is None else {**dec.info(), **({"prompt": prompt_graphs} if prompt_graphs else {})}
    return stream_run(schedule.name, s, w.cfg.vocab_size, run_info(schedule, ks, cache, served, graph_info), t0,
                      prompt_ids=prompt_ids, prompt_logits=plog, cache=cache if keep_cache else None)


def run_info(schedule: Schedule, ks: KernelSet, cache: KVCache, served: dict, graphs: dict | None = None,
             **more) -> dict:
    """Run.info of our engine's run: path, step, kernels, deep_threshold, kv_dtype, served, graphs, ``more``."""
    return {"path": schedule.path, "step": schedule.step, "kernels": ks.name,
            "deep_threshold": schedule.deep_threshold, "kv_dtype": cache.kv_dtype, "served": served,
            "graphs": graphs or {}, **more}


def stream_run(config: str, s: Stream, vocab: int, info: dict, t0: float | None, *, prompt_ids: torch.Tensor,
               prompt_logits: torch.Tensor | None, prompt_start: int = 0, cache: KVCache | None = None) -> Run:
    """The Run of stream ``s``: its tokens and rows, token times relative to ``t0`` (perf_counter; None: not
    timed), the prompt's ids [P] and computed rows [P - prompt_start, V], and a one-slot ``cache`` when kept
    (Run.cache, and its slot 0 as Run.kv)."""
    times = [t - t0 for t in s.times] if t0 is not None else []
    return Run(config, s.gen_ids(), None if prompt_logits is None else prompt_logits.cpu(), s.gen_logits(vocab),
               kv=cache_kv(cache), ttft_s=times[0] if times else 0.0,
               decode_s=times[-1] - times[0] if len(times) > 1 else 0.0, token_times=times, info=info,
               prompt_ids=prompt_ids.cpu(), prompt_start=prompt_start, cache=cache)
