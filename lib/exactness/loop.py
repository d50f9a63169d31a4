"""The greedy loop: every run kind's tokens after its prefill (plain, resumed, concurrent, packed, drafted, serve).

    first_token  token 0: the kernel set's argmax over the last prompt row, of the role that computed that row
                 (``"decode"`` on the decode path, ``"prompt"`` for a prefill segment, a packed prefill or a verify)
    DecodeStep   one decode forward of B streams: tokens [B] at their positions and cache slots -> logits [B, V],
                 eager, or replayed from a CUDA graph per batch size B (graphs.GraphDecoder wraps the step)
    Loop         advances the active streams together: ONE step per call with one row per stream (in the order
                 given), then the argmax of ``"decode"`` picks each stream's next token

A Stream is one request's tokens as the loop grows them; a stream joins when ``Loop.start`` gives it token 0 and
leaves once it holds the tokens it wants or its ``on_token`` callback says stop (serve's EOS, a gone client).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .cache import KVCache
from .expert_providers import ExpertProvider
from .graphs import GraphDecoder
from .kernels import KernelSet, get_set
from .model import DECODE, forward
from .weights import Weights


def first_token(ks: KernelSet, last_row: torch.Tensor, role: str) -> torch.Tensor:
    """Token 0 of a run: last_row [1, V] fp32, the logits of the last prompt row, computed under kernel ``role``
    (paths.Schedule.role; a packed prefill or a verify: ``"prompt"``) -> [1] int64."""
    return ks.fn("argmax", role)(last_row)


def decode_step(w: Weights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                kernels: KernelSet | str, *, experts: ExpertProvider | None = None) -> torch.Tensor:
    """One eager decode step for len(tokens) streams: tokens, positions, slots [B] int64 -> logits [B, V] fp32."""
    return forward(w, tokens, positions, cache, kernels, DECODE, slots=slots, experts=experts).logits


class DecodeStep:
    """step(tokens [B] int64 (device), positions, slots: host ints) -> logits [B, V] fp32: one decode forward.

    With ``graphs`` each batch size B replays its own GraphDecoder (the eager forward's bytes; where a graph cannot
    serve it runs the eager step and says why in ``info``).
    """

    def __init__(self, w: Weights, cache: KVCache, kernels: KernelSet | str, *,
                 experts: ExpertProvider | None = None, graphs: bool = False):
        self.w, self.cache, self.ks, self.experts, self.graphs = w, cache, get_set(kernels), experts, graphs
        self.decoders: dict[int, GraphDecoder] = {}

    def decoder(self, batch: int) -> GraphDecoder:
        """The GraphDecoder of ``batch`` streams, made on first use."""
        if batch not in self.decoders:
            self.decoders[batch] = GraphDecoder(self.w, self.cache, self.ks, batch=batch, experts=self.experts)
        return self.decoders[batch]

    def __call__(self, tokens: torch.Tensor, positions: list[int], slots: list[int]) -> torch.Tensor:
        if self.graphs:
            return self.decoder(len(positions)).step(tokens, positions, slots)
        dev = self.w.device
        return decode_step(self.w, self.cache, tokens, torch.tensor(positions, device=dev),
                           torch.tensor(slots, device=dev), self.ks, experts=self.experts)

    def info(self) -> dict[int, dict]:
        """Per batch size B, GraphDecoder.info() of its forwards ({} without graphs)."""
        return {b: d.info() for b, d in sorted(self.decoders.items())}


@dataclass
class Stream:
    """One request's generated tokens.

    Attributes:
        slot: its cache slot; start: the position the first decode step writes token 0 at (the prompt
            length P); wanted: tokens asked.
        ids: [1] int64 tokens (device); rows: the [1, V] fp32 logits row each was picked from (kept when
            ``keep_rows``); times: perf_counter stamp of each token (timed loops).
        on_token: called as on_token(stream, token [1], row [1, V]) after each token; a true result stops the
            stream (serve's EOS, a cancelled client).
    """

    slot: int
    start: int
    wanted: int
    on_token: Callable | None = None
    keep_rows: bool = True
    ids: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    times: list = field(default_factory=list)
    stopped: bool = False

    @property
    def active(self) -> bool:
        """Joined (token 0 given), not stopped, and short of ``wanted``."""
        return not self.stopped and 0 < len(self.ids) < self.wanted

    @property
    def position(self) -> int:
        """The newest token's position: where the next decode step writes it."""
        return self.start + len(self.ids) - 1

    def add(self, tokens: torch.Tensor, rows: torch.Tensor, stamp: float | None = None) -> None:
        """Append tokens [n] int64 picked from rows [n, V] fp32 (a verify appends several)."""
        for i in range(tokens.numel()):
            tok, row = tokens[i:i + 1], rows[i:i + 1]
            self.ids.append(tok)
            if self.keep_rows:
                self.rows.append(row)
            if stamp is not None:
                self.times.append(stamp)
            if self.on_token is not None and self.on_token(self, tok, row):
                self.stopped = True

    def gen_ids(self) -> torch.Tensor:
        """[G] int64 cpu."""
        return torch.cat(self.ids).cpu() if self.ids else torch.zeros(0, dtype=torch.int64)

    def gen_logits(self, vocab: int) -> torch.Tensor:
        """[G, V] fp32 cpu."""
        return torch.cat(self.rows).cpu() if self.rows else torch.zeros(0, vocab)


class Loop:
    """The greedy loop over streams sharing one cache (module docstring).

    Args:
        kernels: the kernel set (its argmax picks); step: a DecodeStep, or any step(tokens, positions, slots) -> logits;
        timed: stamp each token (device synchronised first) into Stream.times.
    Attributes:
        forwards: decode forwards run; max_rows: the most streams one forward carried.
    """

    def __init__(self, kernels: KernelSet | str, step: Callable, *, timed: bool = False):
        self.ks, self.step, self.timed = get_set(kernels), step, timed
        self.forwards, self.max_rows = 0, 0

    def stamp(self, device: torch.device | None = None) -> float | None:
        """perf_counter after the device finished (None when not timed)."""
        if not self.timed:
            return None
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def start(self, s: Stream, last_row: torch.Tensor, role: str) -> None:
        """Stream ``s`` joins: token 0 by first_token from last_row [1, V] fp32 under ``role``."""
        if s.wanted > 0:
            s.add(first_token(self.ks, last_row, role), last_row, self.stamp(last_row.device))

    def advance(self, streams: list[Stream]) -> list[Stream]:
        """ONE decode forward with one row per active stream of ``streams`` (in their order); each gets its next
        token. Returns the streams stepped."""
        act = [s for s in streams if s.active]
        if act:
            tokens = torch.cat([s.ids[-1] for s in act])                                  # [B] int64
            logits = self.step(tokens, [s.position for s in act], [s.slot for s in act])  # [B, V] fp32
            ids = self.ks.fn("argmax", "decode")(logits)                                  # [B]
            self.forwards, self.max_rows = self.forwards + 1, max(self.max_rows, len(act))
            stamp = self.stamp(logits.device)
            for r, s in enumerate(act):
                s.add(ids[r:r + 1], logits[r:r + 1], stamp)
        return act

    def run(self, streams: list[Stream]) -> None:
        """Advance until no stream of ``streams`` is active."""
        while self.advance(streams):
            pass
