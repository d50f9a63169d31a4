"""Multi-token prediction (MTP) head and drafted decode: with exact kernels, drafted decode equals plain decode.

The head follows DeepSeek-V3 (arXiv 2412.19437, sec. 2.2, eq. 21-23) with the layout of Qwen3-Next's MTP module
(vLLM ``qwen3_next_mtp.py``): for position i, the main model's last hidden row h_i (``ForwardOut.hidden``, before
the final RMSNorm) and the embedding of the next token t_{i+1} are each RMSNorm-ed, concatenated embedding first
(``[norm(emb(t_{i+1})); norm(h_i)]``, [2H]), projected by ``proj`` [H, 2H], run through one decoder block
(attention with its own one-layer KV cache, then MoE), normalised by ``final_norm`` and scored by the main model's
``lm_head``; the argmax is the draft of t_{i+2}. Drafts are chained with one head (as vLLM does with a single MTP
layer): draft j+1 feeds draft j and the head's own output row (before ``final_norm``) at the next position.

Drafted decode (greedy): k drafts, then ONE verify forward of the k+1 rows [last token, d1..dk] through the main
model at their positions. A forward of k+1 rows is a prompt-shaped call, so it runs the prompt kernels (plan
``batched``): with the invariant set those rows carry the decode kernels' bytes and drafted == plain exactly; with
the fast set they may differ, which is what the receipt exposes. Acceptance keeps the longest prefix of drafts that
equals the model's own argmax rows, plus the model's next token; the main and MTP caches are rolled back
(``KVCache.truncate``) past the accepted rows. When no draft is needed (the last token) the step is a plain decode.

With ``graphs`` (CUDA) the forwards after the prefill of up to k+1 rows replay from CUDA graphs, one per shape met
more than once (graphs.StreamForwards: the verify's k+1 rows, plain decode steps, the head's one-row and catch-up
forwards; the eager forwards' bytes); where a shape cannot be captured (the fast set's verify: its per-expert GEMM
shapes follow the routing; offloaded experts) it runs eagerly and ``DraftedResult.graphs`` says why.

Draft sources: ``"mtp"`` (the head above; synthetic weights have a low acceptance rate, reported as measured) and
``"self"`` (sanity mode: the drafts are the main model's own decode steps, so acceptance is 100% exactly when the
verify rows reproduce the decode rows' argmax).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import torch

from .cache import KVCache, KVFormat
from .config import ModelConfig
from .graphs import StreamForwards
from .kernels import KernelSet, get_set
from .model import BATCHED, DECODE, ExpertProvider, ForwardOut, Ops, ResidentExperts, attention_block, moe_block
from .paths import PATHS, Schedule, check_run_args, prefill
from .weights import LayerWeights, Weights, _linear, _norm, moved, shared_draw

K_MIN, K_MAX = 1, 4
DRAFTS = ("mtp", "self")
MTP_SEED_OFFSET = 1000  # synthetic MTP weights: torch.Generator().manual_seed(cfg.seed + MTP_SEED_OFFSET)


@dataclass
class MTPWeights:
    """Tensors of one MTP module (Qwen3-Next checkpoint names in brackets).

    emb_norm [H] (mtp.pre_fc_norm_embedding.weight), hidden_norm [H] (mtp.pre_fc_norm_hidden.weight),
    proj [H, 2H] (mtp.fc.weight; input = [norm(emb); norm(h)]), layer: one decoder layer (mtp.layers.0.*, Qwen3-MoE
    names), final_norm [H] (mtp.norm.weight). ``source`` says where they came from (for receipts).
    """

    emb_norm: torch.Tensor
    hidden_norm: torch.Tensor
    proj: torch.Tensor
    layer: LayerWeights
    final_norm: torch.Tensor
    source: str = "synthetic"

    def to(self, device=None, dtype: torch.dtype | None = None) -> "MTPWeights":
        """Copy on ``device`` with floating tensors cast to ``dtype`` (round-to-nearest-even)."""
        return self.map_tensors(lambda t: moved(t, device, dtype))

    def map_tensors(self, fn) -> "MTPWeights":
        """fn applied to every tensor."""
        return MTPWeights(fn(self.emb_norm), fn(self.hidden_norm), fn(self.proj), self.layer.map(fn),
                          fn(self.final_norm), self.source)


def check_k(k) -> int:
    """Validate the draft count. Raises ValueError unless ``k`` is an int in K_MIN..K_MAX (1..4)."""
    if isinstance(k, bool) or not isinstance(k, int) or not K_MIN <= k <= K_MAX:
        raise ValueError(f"draft count k must be an int in {K_MIN}..{K_MAX}, got {k!r}")
    return k


def synthetic_mtp_weights(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, device="cpu") -> MTPWeights:
    """Seeded synthetic MTP weights: the init rules of weights.synthetic_weights (norms 1 + 0.1·N(0,1), linears
    N(0, 1/in_features), router ×4), drawn in fp32 from ``Generator().manual_seed(cfg.seed + 1000)`` in the order
    emb_norm, hidden_norm, proj, then one layer in weights.py's order, then final_norm; rounded to ``dtype``.
    Inside weights.sharing_synthetic_weights() drawn once per config."""
    return shared_draw(("mtp", cfg), lambda: _mtp_draw(cfg), device, dtype)


def _mtp_draw(cfg: ModelConfig) -> MTPWeights:
    """The fp32 CPU draw of synthetic_mtp_weights (see there)."""
    g = torch.Generator().manual_seed(cfg.seed + MTP_SEED_OFFSET)
    H, D, E, I, Is = cfg.hidden, cfg.head_dim, cfg.n_experts, cfg.expert_inter, cfg.shared_expert_inter
    emb_norm, hidden_norm, proj = _norm(g, H), _norm(g, H), _linear(g, H, 2 * H)
    layer = LayerWeights(
        attn_norm=_norm(g, H), wq=_linear(g, cfg.n_heads * D, H), wk=_linear(g, cfg.n_kv_heads * D, H),
        wv=_linear(g, cfg.n_kv_heads * D, H), wo=_linear(g, H, cfg.n_heads * D), q_norm=_norm(g, D),
        k_norm=_norm(g, D), mlp_norm=_norm(g, H), router=4.0 * _linear(g, E, H),
        w_gate=_linear(g, I, H, E), w_up=_linear(g, I, H, E), w_down=_linear(g, H, I, E),
        shared_gate=_linear(g, Is, H) if Is else None, shared_up=_linear(g, Is, H) if Is else None,
        shared_down=_linear(g, H, Is) if Is else None)
    return MTPWeights(emb_norm, hidden_norm, proj, layer, _norm(g, H), f"synthetic (seed {cfg.seed} + 1000)")


_LAYER_NAMES = {"attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
                "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
                "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
                "mlp_norm": "post_attention_layernorm.weight", "router": "mlp.gate.weight"}


def mtp_from_extra(cfg: ModelConfig, extra: dict) -> MTPWeights:
    """MTP weights from a checkpoint's ``mtp.*`` tensors (``weights.extra`` of checkpoint.load_checkpoint).

    Names (Qwen3-Next layout): mtp.fc.weight [H, 2H], mtp.pre_fc_norm_embedding.weight [H],
    mtp.pre_fc_norm_hidden.weight [H], mtp.norm.weight [H], and one Qwen3-MoE layer under ``mtp.layers.0.``
    (per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` or fused ``mlp.experts.gate_up_proj`` [E, 2I, H] /
    ``down_proj``; ``mlp.shared_expert.*`` when cfg has a shared expert).
    Raises:
        ValueError: a tensor is missing (names it).
    """
    def get(name: str) -> torch.Tensor:
        if name not in extra:
            raise ValueError(f"checkpoint MTP tensor {name!r} is missing; present: {sorted(extra)[:8]}")
        return extra[name]
    p, E, I = "mtp.layers.0.", cfg.n_experts, cfg.expert_inter
    if p + "mlp.experts.gate_up_proj" in extra:
        gu = get(p + "mlp.experts.gate_up_proj")                                     # [E, 2I, H]
        wg, wu, wd = gu[:, :I], gu[:, I:], get(p + "mlp.experts.down_proj")
    else:
        wg, wu, wd = (torch.stack([get(f"{p}mlp.experts.{e}.{n}_proj.weight") for e in range(E)])
                      for n in ("gate", "up", "down"))
    sh = (lambda n: get(f"{p}mlp.shared_expert.{n}_proj.weight")) if cfg.shared_expert_inter else (lambda n: None)
    layer = LayerWeights(**{f: get(p + n) for f, n in _LAYER_NAMES.items()}, w_gate=wg, w_up=wu, w_down=wd,
                         shared_gate=sh("gate"), shared_up=sh("up"), shared_down=sh("down"))
    return MTPWeights(get("mtp.pre_fc_norm_embedding.weight"), get("mtp.pre_fc_norm_hidden.weight"),
                      get("mtp.fc.weight"), layer, get("mtp.norm.weight"), "checkpoint")


def resolve_mtp(w: Weights, mtp: MTPWeights | None = None) -> MTPWeights:
    """The MTP weights to use: ``mtp`` when given, else the checkpoint's (``w.extra`` holding ``mtp.fc.weight``),
    else synthetic weights from the preset's seed; always on w's device in w's dtype."""
    if mtp is None and "mtp.fc.weight" in (getattr(w, "extra", None) or {}):
        mtp = mtp_from_extra(w.cfg, w.extra)
    if mtp is None:
        return synthetic_mtp_weights(w.cfg, w.dtype, w.device)
    return mtp.to(device=w.device, dtype=w.dtype)


class MTPHead:
    """The MTP module bound to a model: its weights and its own one-layer KV cache (``cfg.replace(n_layers=1)``).

    Args:
        w: main model weights (embedding and lm_head are shared).
        mtp: MTP weights (see resolve_mtp); capacity: positions per slot; slots: streams.
        kv_dtype: what the head's cache stores (cache.KV_DTYPES name; per-tensor fp8 scales are 1.0, since a
            main-model KVFormat's scales are per main-model layer).
    """

    def __init__(self, w: Weights, mtp: MTPWeights, capacity: int, slots: int = 1, kv_dtype: str = "bf16"):
        self.w, self.m = w, mtp
        self.experts = ResidentExperts([mtp.layer])  # the head's own experts, always on the device
        self.cfg1 = w.cfg.replace(n_layers=1)
        self.cache = KVCache(self.cfg1, capacity, slots, w.dtype, w.device, KVFormat.of(kv_dtype).dtype)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kernels: KernelSet,
                plan=DECODE, slot: int = 0) -> ForwardOut:
        """Rows (t_{i+1} = tokens [M] int64, h_i = hidden [M, H], i = positions [M] int64) -> ForwardOut(logits
        [M, V] fp32 of the draft t_{i+2}, hidden [M, H] = the block's output before final_norm, for chaining)."""
        ops = Ops(kernels, plan)
        ops.positions = positions
        slots = torch.full_like(positions, slot)
        out = self.body(ops, tokens, positions, slots, hidden)
        self.cache.advance(slots, positions)
        return out

    def body(self, ops: Ops, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             hidden: torch.Tensor) -> ForwardOut:
        """forward's rows with ``ops`` at cache ``slots`` [M] int64: no host read of its own, and the cache's
        lengths left to the caller (graphs.GraphForward records the kernels it launches)."""
        cfg, m = self.cfg1, self.m
        ops.layer = self.w.cfg.n_layers                                                # taps see the block as layer L
        e = ops.rmsnorm(self.w.embed[tokens], m.emb_norm, cfg.rms_eps)                # [M, H]
        h = ops.rmsnorm(hidden, m.hidden_norm, cfg.rms_eps)                            # [M, H]
        x = ops.dense(torch.cat([e, h], dim=-1), m.proj)                               # [M, 2H] -> [M, H]
        x = attention_block(ops, m.layer, cfg, x, positions, slots, self.cache, 0)
        x = moe_block(ops, m.layer, cfg, x, self.experts, 0)
        ops.layer = -1
        logits = ops.lm_head(ops.rmsnorm(x, m.final_norm, cfg.rms_eps), self.w.lm_head)  # [M, V] fp32
        return ForwardOut(logits, x)


@dataclass
class DraftStats:
    """Drafts proposed and accepted over a run; ``rounds`` = verify forwards; ``plain_steps`` = draft-free steps."""

    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    plain_steps: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / proposed (None when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else None


@dataclass
class DraftedResult:
    """One drafted greedy run.

    Attributes:
        draft ("mtp"/"self"), k, kernels, path, step: what was asked for; mtp_source: where MTP weights came from.
        prompt_ids [P] int64, gen_ids [N] int64, gen_logits [N, V] fp32 (the row each token was chosen from), cpu.
        stats: DraftStats; served: prefill plan -> {"segments", "rows"}; seconds: wall time of the run.
        cache, mtp_cache: the main and the MTP head's KV caches after the run (kept only when asked).
        graphs: {} when CUDA graphs were not asked for; else graphs.StreamForwards.info(): per forward shape of up
            to k+1 rows met after the prefill ("main 3 batched": the verify of k = 2 drafts, "main 1 decode", "head 1
            decode", "head 2 batched", ...) its replays, eager calls and why a graph did not serve.
    """

    draft: str
    k: int
    kernels: str
    path: str
    step: int | None
    mtp_source: str | None
    prompt_ids: torch.Tensor
    gen_ids: torch.Tensor
    gen_logits: torch.Tensor
    stats: DraftStats = field(default_factory=DraftStats)
    served: dict = field(default_factory=lambda: {p: {"segments": 0, "rows": 0} for p in PATHS})
    seconds: float = 0.0
    cache: KVCache | None = None
    mtp_cache: KVCache | None = None
    graphs: dict = field(default_factory=dict)

    def graphs_record(self) -> dict | None:
        """What a report keeps of ``graphs``: None when CUDA graphs were not asked for, else {"served": any shape
        replayed, "replays" and "eager_steps" summed over the shapes, "reason": "<shape>: <why>" for each shape a
        graph did not serve, joined with "; " (None when every shape's graph served)}."""
        if not self.graphs:
            return None
        why = [f"{key}: {g['reason']}" for key, g in self.graphs.items() if g["reason"] is not None]
        return {"served": any(g["served"] for g in self.graphs.values()),
                "replays": sum(g["replays"] for g in self.graphs.values()),
                "eager_steps": sum(g["eager_steps"] for g in self.graphs.values()),
                "reason": "; ".join(why) or None}


class _Drafter:
    """Proposes drafts for one stream (slot 0) and keeps the MTP cache in step with the accepted tokens."""

    def __init__(self, fwd: StreamForwards, draft: str, step: int | None):
        self.fwd, self.ks, self.draft, self.step = fwd, fwd.ks, draft, step
        self.pend_h, self.pend_t, self.pend_pos = None, None, 0  # main hidden rows not yet run through the head

    def feed(self, hidden: torch.Tensor, next_tokens: torch.Tensor, first_pos: int) -> None:
        """Queue main hidden rows h_i [n, H] (i = first_pos..) with their next tokens t_{i+1} [n]."""
        self.pend_h, self.pend_t, self.pend_pos = hidden, next_tokens, first_pos

    def propose(self, cache: KVCache, last: torch.Tensor, L: int, kk: int) -> torch.Tensor:
        """kk draft ids [kk] int64 for the positions after L (``last`` [1] = token at position L)."""
        return self._self(cache, last, L, kk) if self.draft == "self" else self._mtp(L, kk)

    def _self(self, cache, last, L, kk):
        out, t = [], last
        for j in range(kk):
            logits = self.fwd.main(t, L + j, DECODE).logits                            # [1, V]
            t = self.ks.fn("argmax", "decode")(logits)
            out.append(t)
        cache.truncate(0, L)  # the verify forward rewrites positions L..L+kk
        return torch.cat(out)

    def _mtp(self, L, kk):
        n, seg = self.pend_t.numel(), self.step or self.pend_t.numel()
        for a in range(0, n, seg):  # catch up: the head over the main model's accepted rows, in prefill segments
            rows = slice(a, min(n, a + seg))
            o = self.fwd.head_rows(self.pend_t[rows], self.pend_h[rows], self.pend_pos + a)
        d = [self.ks.fn("argmax", "decode")(o.logits[-1:])]
        h = o.hidden[-1:]
        for j in range(1, kk):  # chain: the head's own row and the previous draft at the next position
            o = self.fwd.head_rows(d[-1], h, L + j - 1)
            d.append(self.ks.fn("argmax", "decode")(o.logits))
            h = o.hidden
        self.fwd.head.cache.truncate(0, L)  # chained rows (positions >= L) used the head's own hidden: speculative
        return torch.cat(d)


def _verify(fwd: StreamForwards, last, drafts, L):
    """One forward of [last, d1..dk] at L..L+k (prompt kernels); returns (accepted a, new ids [a+1], logits rows
    [a+1, V], hidden rows [a+1, H])."""
    out = fwd.main(torch.cat([last, drafts]), L, BATCHED)                             # k+1 rows
    g = fwd.ks.fn("argmax", "prompt")(out.logits)                                      # [k+1]
    agree = (g[:-1] == drafts).int()
    a = int(agree.cumprod(0).sum())
    fwd.cache.truncate(0, L + a + 1)
    return a, g[:a + 1], out.logits[:a + 1], out.hidden[:a + 1]


@dataclass
class _Drafting:
    """One drafted decode in progress (slot 0): what each _round reads, and the tokens it appends to."""

    fwd: StreamForwards             # the main model's and the head's forwards (cache, kernel set, graphs)
    drafter: _Drafter
    k: int                          # drafts per round
    n_prompt: int                   # P
    gen_tokens: int                 # tokens asked for
    stats: DraftStats
    gen: list = field(default_factory=list)   # generated ids, [1] int64 each
    glog: list = field(default_factory=list)  # the logits row each was chosen from, [1, V] fp32 each


def generate_drafted(w: Weights, prompt_ids: torch.Tensor, gen_tokens: int, kernels: KernelSet | str = "fast",
                     schedule: Schedule = Schedule("batched"), *, k: int = 2, draft: str = "mtp",
                     mtp: MTPWeights | None = None, keep_cache: bool = False,
                     experts: ExpertProvider | None = None, kv_dtype: str | KVFormat = "bf16",
                     graphs: bool = False) -> DraftedResult:
    """Prefill ``prompt_ids`` [P] int64 as ``schedule`` says (as paths.generate does) and generate ``gen_tokens``
    greedy tokens with k drafts per verify forward (module docstring).

    Args:
        k: drafts per round, 1..4; draft: "mtp" (the MTP head; ``mtp`` weights or resolve_mtp's choice) or "self"
            (sanity mode: drafts from the main model's own decode steps).
        kv_dtype: what the main cache stores (cache.KV_DTYPES name or a KVFormat); the head's cache stores the
            same kind (MTPHead).
        graphs: replay the forwards after the prefill (verify, plain decode steps, the head's rows up to k+1 per
            call) from CUDA graphs (graphs.StreamForwards: the same bytes); ``DraftedResult.graphs`` says what
            served.
    Returns:
        DraftedResult; tokens equal paths.generate's exactly when the verify rows reproduce the decode rows.
    Raises:
        ValueError: k outside 1..4, unknown draft source or kv_dtype, or what paths.check_run_args raises.
    """
    check_k(k)
    if draft not in DRAFTS:
        raise ValueError(f"unknown draft source {draft!r}; allowed: {', '.join(DRAFTS)}")
    ks, P = get_set(kernels), int(prompt_ids.numel())
    check_run_args(w, P, gen_tokens)
    t0, dev = time.perf_counter(), w.device
    ids = prompt_ids.to(dev)
    cache = KVCache(w.cfg, P + max(gen_tokens, 1), 1, w.dtype, dev, kv_dtype)
    mw = resolve_mtp(w, mtp) if draft == "mtp" else None
    res = DraftedResult(draft, k, ks.name, schedule.path, schedule.step, mw.source if mw else None,
                        prompt_ids.cpu(), torch.zeros(0, dtype=torch.int64), torch.zeros(0, w.cfg.vocab_size))
    pre = prefill(w, cache, ids, ks, schedule, served=res.served, experts=experts)
    head = MTPHead(w, mw, cache.capacity, kv_dtype=cache.kv_dtype) if mw is not None else None
    fwd = StreamForwards(w, cache, ks, experts, head, graphs, max_rows=k + 1)
    drafter = _Drafter(fwd, draft, schedule.step)
    state = _Drafting(fwd, drafter, k, P, gen_tokens, res.stats)
    if gen_tokens:
        state.gen.append(ks.fn("argmax", schedule.role)(pre.logits[-1:]))
        state.glog.append(pre.logits[-1:])
        drafter.feed(pre.hidden, torch.cat([ids[1:], state.gen[0]]), 0)
    while len(state.gen) < gen_tokens:
        _round(state)
    res.gen_ids = torch.cat(state.gen).cpu() if state.gen else res.gen_ids
    res.gen_logits = torch.cat(state.glog).cpu() if state.glog else res.gen_logits
    res.seconds = time.perf_counter() - t0
    res.graphs = fwd.info()
    if keep_cache:
        res.cache, res.mtp_cache = cache, (head.cache if head else None)
    return res


def _round(state: _Drafting) -> None:
    """One draft-and-verify round (or a plain decode step when one token is left); appends to state.gen / glog."""
    fwd, gen, stats = state.fwd, state.gen, state.stats
    L = state.n_prompt + len(gen) - 1              # position of the newest token, not yet fed
    kk = min(state.k, state.gen_tokens - len(gen) - 1)  # never draft past the requested length
    last = gen[-1]
    if kk == 0:
        logits = fwd.main(last, L, DECODE).logits                                      # [1, V] fp32
        gen.append(fwd.ks.fn("argmax", "decode")(logits))
        state.glog.append(logits)
        stats.plain_steps += 1
        return
    drafts = state.drafter.propose(fwd.cache, last, L, kk)
    a, new, logits, hidden = _verify(fwd, last, drafts, L)
    stats.proposed, stats.accepted, stats.rounds = stats.proposed + kk, stats.accepted + a, stats.rounds + 1
    gen.extend(new.split(1))
    state.glog.extend(logits.split(1))
    state.drafter.feed(hidden, new, L)


def mtp_nbytes(m: MTPWeights) -> int:
    """Bytes of the MTP tensors."""
    lw = m.layer
    layer = sum(getattr(lw, f.name).nbytes for f in fields(lw) if getattr(lw, f.name) is not None)
    return layer + m.emb_norm.nbytes + m.hidden_norm.nbytes + m.proj.nbytes + m.final_norm.nbytes
