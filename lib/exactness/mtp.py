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
more than once (stream_forwards.StreamForwards: the verify's k+1 rows, plain decode steps, the head's one-row and
catch-up forwards; the eager forwards' bytes); where a shape cannot be captured (a set without a grouped expert
kernel: its per-expert GEMM shapes follow the routing; offloaded experts) it runs eagerly and ``Run.graphs`` says
why.

Without a checkpoint's MTP tensors the head is derived from the model itself (derived_mtp_weights): its blocks are
the model's own decoder layers run one position ahead (proj passes the next token's embedding through), so the head
replays the model's next step over its own cache and most drafts are accepted (synthetic_mtp_weights: a random head
accepting almost none).

Draft sources: ``"mtp"`` (the head above; acceptance reported as measured) and
``"self"`` (sanity mode: the drafts are the main model's own decode steps, so acceptance is 100% exactly when the
verify rows reproduce the decode rows' argmax).

Token 0 comes from loop.first_token and the plain steps from loop.Loop (the greedy loop every run kind shares); a
round's verified rows are appended to the same loop.Stream.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .cache import KVCache, KVFormat
from .config import ModelConfig
from .expert_providers import ExpertProvider, ResidentExperts
from .kernels import KernelSet, get_set
from .loop import Loop, Stream
from .model import BATCHED, DECODE, ForwardOut, Ops, attention_block, moe_block
from .paths import Schedule, check_run_args, prefill, run_info, served_counts, stream_run
from .run import Run
from .stream_forwards import StreamForwards
from .weights import LayerWeights, Weights, _linear, _norm, moved, shared_draw

K_MIN, K_MAX = 1, 4
DRAFTS = ("mtp", "self")
MTP_SEED_OFFSET = 1000  # synthetic MTP weights: torch.Generator().manual_seed(cfg.seed + MTP_SEED_OFFSET)


@dataclass
class MTPWeights:
    """Tensors of one MTP module (Qwen3-Next checkpoint names in brackets).

    emb_norm [H] (mtp.pre_fc_norm_embedding.weight), hidden_norm [H] (mtp.pre_fc_norm_hidden.weight),
    proj [H, 2H] (mtp.fc.weight; input = [norm(emb); norm(h)]), layer: one decoder layer (mtp.layers.0.*, Qwen3-MoE
    names), final_norm [H] (mtp.norm.weight). ``source`` says where they came from (for receipts). ``more``: further
    blocks after ``layer``; ``derived``: the blocks are the main model's layers 0.. (their experts then come from the
    main model's expert provider, offloaded or not).
    """

    emb_norm: torch.Tensor
    hidden_norm: torch.Tensor
    proj: torch.Tensor
    layer: LayerWeights
    final_norm: torch.Tensor
    source: str = "synthetic"
    more: tuple[LayerWeights, ...] = ()
    derived: bool = False

    @property
    def blocks(self) -> list[LayerWeights]:
        """The decoder blocks in order: ``layer``, then ``more``."""
        return [self.layer, *self.more]

    def to(self, device=None, dtype: torch.dtype | None = None) -> "MTPWeights":
        """Copy on ``device`` with floating tensors cast to ``dtype`` (round-to-nearest-even)."""
        return self.map_tensors(lambda t: moved(t, device, dtype))

    def map_tensors(self, fn) -> "MTPWeights":
        """fn applied to every tensor."""
        return MTPWeights(fn(self.emb_norm), fn(self.hidden_norm), fn(self.proj), self.layer.map(fn),
                          fn(self.final_norm), self.source, tuple(lw.map(fn) for lw in self.more), self.derived)


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


def derived_mtp_weights(w: Weights) -> MTPWeights:
    """A head derived from the model ``w`` itself: its blocks are w's decoder layers (the same tensors), proj
    [H, 2H] = [I, 0] (the next token's RMS-normalised embedding passes through, the main hidden row is not read),
    unit input norms and w's final norm. The head's row i then runs the model's layers on token t_{i+1} at position
    i over its own cache, which holds t_1.. at positions 0..: the model's next step, its keys one position early
    (attention depends on relative positions; t_0 is missing). Deterministic: no random draw."""
    H, dev, dt = w.cfg.hidden, w.device, w.dtype
    proj = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1).to(device=dev, dtype=dt)   # exact in bf16
    ones = torch.ones(H, device=dev, dtype=dt)
    return MTPWeights(ones, ones.clone(), proj, w.layers[0], w.final_norm,
                      f"derived: the model's {len(w.layers)} decoder layers one position ahead",
                      tuple(w.layers[1:]), derived=True)


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
    else a head derived from the model (derived_mtp_weights); always on w's device in w's dtype."""
    if mtp is None and "mtp.fc.weight" in (getattr(w, "extra", None) or {}):
        mtp = mtp_from_extra(w.cfg, w.extra)
    if mtp is None:
        return derived_mtp_weights(w)
    return mtp.to(device=w.device, dtype=w.dtype)


class MTPHead:
    """The MTP module bound to a model: its weights and its own KV cache, one layer per block
    (``cfg.replace(n_layers=len(mtp.blocks))``).

    Args:
        w: main model weights (embedding and lm_head are shared).
        mtp: MTP weights (see resolve_mtp); capacity: positions per slot; slots: streams.
        kv_dtype: what the head's cache stores (cache.KV_DTYPES name; per-tensor fp8 scales are 1.0, since a
            main-model KVFormat's scales are per main-model layer).
        experts: the main model's expert provider, read by a derived head (its blocks are the model's layers);
            None, or a head of its own: its blocks' experts, always on the device.
    """

    def __init__(self, w: Weights, mtp: MTPWeights, capacity: int, slots: int = 1, kv_dtype: str = "bf16",
                 experts: ExpertProvider | None = None):
        self.w, self.m = w, mtp
        self.experts = experts if mtp.derived and experts is not None else ResidentExperts(mtp.blocks)
        self.cfg1 = w.cfg.replace(n_layers=len(mtp.blocks))
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
        ops.layer = self.w.cfg.n_layers                                            # taps see block j as layer L + j
        e = ops.rmsnorm(self.w.embed.index_select(0, tokens), m.emb_norm, cfg.rms_eps)   # [M, H]
        h = ops.rmsnorm(hidden, m.hidden_norm, cfg.rms_eps)                            # [M, H]
        x = ops.dense(torch.cat([e, h], dim=-1), m.proj)                               # [M, 2H] -> [M, H]
        h = None
        for j, lw in enumerate(m.blocks):
            ops.layer = self.w.cfg.n_layers + j
            x, h = attention_block(ops, lw, cfg, x, positions, slots, self.cache, j, h)
            nxt = m.blocks[j + 1].attn_norm if j + 1 < len(m.blocks) else m.final_norm
            x, h = moe_block(ops, lw, cfg, x, self.experts, j, h, nxt)
        ops.layer = -1
        h = ops.rmsnorm(x, m.final_norm, cfg.rms_eps) if h is None else h
        return ForwardOut(ops.lm_head(h, self.w.lm_head), x)                         # logits [M, V] fp32


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
    """One drafted decode in progress (slot 0): what each _round reads, and the stream it appends to."""

    fwd: StreamForwards             # the main model's and the head's forwards (cache, kernel set, graphs)
    drafter: _Drafter
    loop: Loop                      # its plain steps: fwd.main on one decode row
    k: int                          # drafts per round
    stats: DraftStats
    stream: Stream                  # token ids and the logits row each was chosen from


def generate_drafted(w: Weights, prompt_ids: torch.Tensor, gen_tokens: int, kernels: KernelSet | str = "fast",
                     schedule: Schedule = Schedule("batched"), *, k: int = 2, draft: str = "mtp",
                     mtp: MTPWeights | None = None, keep_cache: bool = False,
                     experts: ExpertProvider | None = None, kv_dtype: str | KVFormat = "bf16",
                     graphs: bool = False) -> Run:
    """Prefill ``prompt_ids`` [P] int64 as ``schedule`` says (as paths.generate does) and generate ``gen_tokens``
    greedy tokens with k drafts per verify forward (module docstring).

    Args:
        k: drafts per round, 1..4; draft: "mtp" (the MTP head; ``mtp`` weights or resolve_mtp's choice) or "self"
            (sanity mode: drafts from the main model's own decode steps).
        kv_dtype: what the main cache stores (cache.KV_DTYPES name or a KVFormat); the head's cache stores the
            same kind (MTPHead).
        graphs: replay the forwards after the prefill (verify, plain decode steps, the head's rows up to k+1 per
            call) from CUDA graphs (stream_forwards.StreamForwards: the same bytes); ``Run.graphs`` says what served.
    Returns:
        Run named ``schedule.name``; tokens equal paths.generate's exactly when the verify rows reproduce the
        decode rows. info adds draft, k, mtp_source (where the MTP weights came from), draft_stats (DraftStats),
        graphs (stream_forwards.StreamForwards.info(): per forward shape of up to k+1 rows met after the prefill,
        "main 3 batched", "main 1 decode", "head 1 decode", ...) and, with keep_cache, mtp_cache (the head's KV cache).
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
    served = served_counts()
    pre = prefill(w, cache, ids, ks, schedule, served=served, experts=experts)
    head = MTPHead(w, mw, cache.capacity, kv_dtype=cache.kv_dtype, experts=experts) if mw is not None else None
    if head is not None and type(head.experts) is not ResidentExperts:
        graphs = False   # a derived head reading staged experts: its forwards fetch on the host, as the model's do
    fwd = StreamForwards(w, cache, ks, experts, head, graphs, max_rows=k + 1)
    loop = Loop(ks, lambda tokens, positions, slots: fwd.main(tokens, positions[0], DECODE).logits, timed=True)
    state = _Drafting(fwd, _Drafter(fwd, draft, schedule.step), loop, k, DraftStats(), Stream(0, P, gen_tokens))
    loop.start(state.stream, pre.logits[-1:], schedule.role)
    if gen_tokens:
        state.drafter.feed(pre.hidden, torch.cat([ids[1:], state.stream.ids[0]]), 0)
    while state.stream.active:
        _round(state)
    info = run_info(schedule, ks, cache, served, fwd.info(), draft=draft, k=k, mtp_source=mw.source if mw else None,
                    draft_stats=state.stats, mtp_cache=head.cache if keep_cache and head else None)
    return stream_run(schedule.name, state.stream, w.cfg.vocab_size, info, t0, prompt_ids=prompt_ids,
                      prompt_logits=pre.logits, cache=cache if keep_cache else None)


def _round(state: _Drafting) -> None:
    """One draft-and-verify round (or the loop's plain decode step when one token is left); appends to the
    stream."""
    fwd, s, stats = state.fwd, state.stream, state.stats
    L = s.position                                 # position of the newest token, not yet fed
    kk = min(state.k, s.wanted - len(s.ids) - 1)   # never draft past the requested length
    if kk == 0:
        state.loop.advance([s])
        stats.plain_steps += 1
        return
    last = s.ids[-1]
    drafts = state.drafter.propose(fwd.cache, last, L, kk)
    a, new, logits, hidden = _verify(fwd, last, drafts, L)
    stats.proposed, stats.accepted, stats.rounds = stats.proposed + kk, stats.accepted + a, stats.rounds + 1
    s.add(new, logits, state.loop.stamp(logits.device))
    state.drafter.feed(hidden, new, L)
