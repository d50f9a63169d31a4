"""The fast set's CUDA kernels (kernels/fast_cuda.py: grouped expert GEMMs, FlashAttention-2 prompt and decode;
kernels/fast_fused.py: its torch ops compiled by torch.compile).

CPU tests: the fast set's CPU rows are plain torch's (its CUDA options change nothing there: the deep plan keeps
its row tiles, the experts run one by one), and the grouped route (rows sorted by expert, offsets, scatter back)
computes each (row, slot) pair's expert, through torch's reference _grouped_mm on CPU tensors. GPU tests (skipped
without CUDA) compare the kernels with the fast set's torch kernels within bf16 rounding, each with a planted
fault that must be caught, and check that a fast decode step is one CUDA graph whose replay equals the eager step;
the compiled ops against the same ops run eagerly, within a bound of bf16 roundings, each in fewer launches.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from exactness.cache import KVCache
from exactness.exact import bytes_equal
from exactness.kernels import attention as torch_attn
from exactness.kernels import experts as torch_experts
from exactness.kernels import fast_cuda, fast_fused, get_set
from exactness.kernels import norm as torch_norm
from exactness.kernels import rope as torch_rope
from exactness.model import BATCHED, DECODE, DEEP, forward

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _experts(E=6, I=16, H=24, M=11, k=3, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, device=device) * 0.2).to(torch.bfloat16)  # noqa: E731
    h, wg, wu, wd = r(M, H), r(E, I, H), r(E, I, H), r(E, H, I)
    idx = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(M)])   # [M, k] distinct
    return h, idx, wg, wu, wd


BF16_EPS = torch.finfo(torch.bfloat16).eps     # 2^-7


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (fp32)."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 ULPs of b, elementwise (fp32)."""
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(b.float().abs().clamp_min(1e-30))))
    return (a.float() - b.float()).abs() / ulp


def _loop(h, idx, wg, wu, wd):
    """y [M, k, H]: each pair's expert alone (F.linear), the reference the grouped route must reproduce."""
    M, k = idx.shape
    return torch.stack([torch.stack([F.linear(F.silu(F.linear(h[m:m + 1], wg[e])) * F.linear(h[m:m + 1], wu[e]),
                                              wd[e])[0] for e in idx[m].tolist()]) for m in range(M)])


def test_cpu_rows_are_plain_torch(tiny_weights):
    """On the CPU the fast set's options change no byte: a forward on the batched and deep plans equals the same
    set without them (row tiles on the deep plan, experts one by one)."""
    fast = get_set("fast")
    plain = dataclasses.replace(fast, options={})
    w = tiny_weights
    ids = torch.arange(150) % w.cfg.vocab_size
    for plan in (BATCHED, DEEP):
        outs = []
        for ks in (fast, plain):
            cache = KVCache(w.cfg, 160, 1, w.dtype, w.device)
            outs.append(forward(w, ids, torch.arange(150), cache, ks, plan).logits)
        assert bytes_equal(outs[0], outs[1]), plan
    assert not fast_cuda.whole_calls(torch.zeros(1)) and fast_cuda.moe_experts(*_experts()) is None


def test_cpu_fast_kernels_are_the_eager_torch_ops(tiny_weights):
    """On the CPU the fast set's norm, RoPE, router and combine kernels run the torch ops eagerly (nothing is
    compiled): a forward equals, as bytes, one through a set of those torch functions themselves; control: the
    same set with RoPE's base changed differs. The fused options serve nothing on the CPU."""
    from exactness.kernels import router as torch_router
    fast = get_set("fast")
    tab = {"rmsnorm": torch_norm.rmsnorm_fast, "rope": torch_rope.rope_fast, "router": torch_router.router_fast,
           "moe_combine": torch_experts.combine_fast}

    def plain(fns):
        roles = {r: {c: (dataclasses.replace(s, fn=fns[c]) if c in fns else s) for c, s in getattr(fast, r).items()}
                 for r in ("decode", "prompt")}
        return dataclasses.replace(fast, name="fast_plain", options={}, **roles)
    w, ids = tiny_weights, torch.arange(70) % tiny_weights.cfg.vocab_size

    def run(ks):
        cache = KVCache(w.cfg, 80, 1, w.dtype, w.device)
        return forward(w, ids, torch.arange(70), cache, ks, BATCHED).logits
    ref = run(fast)
    assert bytes_equal(run(plain(tab)), ref)
    shifted = {**tab, "rope": lambda x, p, theta: torch_rope.rope_fast(x, p, theta * 2)}
    assert not bytes_equal(run(plain(shifted)), ref)
    x = torch.ones(3, 8)
    assert fast_fused.residual_norm(x, x, torch.ones(8), 1e-6) is None and fast_fused.qk_norm_rope(
        x[:, None], x[:, None], torch.ones(8), torch.ones(8), 1e-6, torch.arange(3), 1e4) is None


def test_cpu_compiled_forward_runs_every_option_close_to_eager(tiny_weights, monkeypatch, cpu_compile, cpu_grouped):
    """With compiling forced for CPU tensors (fast_cuda._COMPILE["cpu"], tests only; skipped where Inductor cannot
    compile here, conftest's cpu_compile): a fast-set forward of 70 prompt rows then one decode row goes through
    torch.compile for the first norm, the router, the grouped experts and the options it uses (q/k norms with RoPE, each
    residual add with its norm after the projection or the combine: each one's graph compiled); its logits within 3%
    (relative norm) of the eager set's, max, argmax and count beyond 8 bf16 ULPs in the message; planted fault: the
    output projection's option without its residual add, beyond the bound."""
    fast, w = get_set("fast"), tiny_weights
    ids = torch.arange(71) % w.cfg.vocab_size

    def run():
        cache = KVCache(w.cfg, 80, 1, w.dtype, w.device)
        a = forward(w, ids[:70], torch.arange(70), cache, fast, BATCHED).logits
        return torch.cat([a, forward(w, ids[70:], torch.tensor([70]), cache, fast, DECODE).logits])
    monkeypatch.setitem(fast_cuda._COMPILE, "cpu", False)
    ref = run()                                                                   # the eager ops
    monkeypatch.setitem(fast_cuda._COMPILE, "cpu", True)
    out = run()
    assert fast_cuda.STATUS["inductor"] == "ok" and fast_cuda.STATUS["grouped_mm"] == "ok", fast_cuda.STATUS
    ran = {f.__name__ for f, _ in fast_cuda._GRAPHS}
    assert {"_rms", "router_fast", "_grouped", "_combine_residual_norm", "_dense_residual_norm",
            "_qk_norm_rope"} <= ran, ran
    rel = lambda a: float((a.float() - ref.float()).norm() / ref.float().norm())  # noqa: E731
    u = _ulps(out, ref)
    assert rel(out) < 3e-2, (rel(out), float(u.max()), int(u.argmax()), int((u > 8).sum()))
    monkeypatch.setattr(fast_fused, "_dense_residual_norm",
                        lambda x, wo, a, wn, eps: fast_fused._residual_norm(torch.zeros_like(a), F.linear(x, wo),
                                                                            wn, eps))
    bad = rel(run())
    assert bad > 3e-2                                                             # planted fault


def test_a_compile_failure_is_recorded_and_the_eager_ops_serve_from_then_on(monkeypatch):
    """Where compiling raises (any exception, here an AssertionError as Inductor's internals may raise) the call
    returns the eager ops' bytes, fast_cuda.STATUS["inductor"] names the error, and later calls of any graph run
    eagerly without trying to compile again; control: before the failure the compiled callable is what runs."""
    calls = []

    def broken(fn, variant=()):
        def run(*a):
            calls.append(fn.__name__)
            raise AssertionError("lowering failed")
        return run
    monkeypatch.setitem(fast_cuda._COMPILE, "cpu", True)
    monkeypatch.setitem(fast_cuda.STATUS, "inductor", "untried")
    monkeypatch.setattr(fast_cuda, "compiled", broken)
    x, w = torch.randn(5, 8).bfloat16(), torch.randn(8).bfloat16()
    assert bytes_equal(fast_fused.rmsnorm(x, w, 1e-6), torch_norm._rms(x, w, 1e-6)) and calls == ["_rms"]
    assert fast_cuda.STATUS["inductor"] == "AssertionError: lowering failed"
    q = torch.randn(5, 2, 8).bfloat16()
    assert bytes_equal(fast_fused.rope(q, torch.arange(5), 1e4), torch_rope.rope_fast(q, torch.arange(5), 1e4))
    assert calls == ["_rms"] and fast_cuda.served()["inductor"].startswith("AssertionError")


def test_more_graphs_of_one_op_than_dynamos_limit_still_compile(monkeypatch, cpu_compile):
    """Compiling forced for CPU tensors: RMSNorm over 2-D and 3-D rows, one row and several, in bf16, fp16 and fp32
    (12 graphs, beyond Dynamo's 8 per code object) all compile, each variant its own copy of the function; control:
    with every call on one copy, the ninth graph fails (fullgraph) and the failure is recorded. Dynamo's limit is
    held at its default of 8 here: a library may raise it for the process (transformers' chunked prefill sets 64).
    Skipped where Inductor cannot compile here (conftest's cpu_compile)."""
    import torch._dynamo.config

    def run_all() -> str:
        monkeypatch.setattr(fast_cuda, "_GRAPHS", {})
        monkeypatch.setitem(fast_cuda.STATUS, "inductor", "untried")
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            for shape in ((1, 64), (7, 64), (1, 4, 16), (9, 4, 16)):
                x, w = torch.randn(*shape).to(dt), torch.randn(shape[-1]).to(dt)
                assert bytes_equal(fast_fused.rmsnorm(x, w, 1e-6), fast_fused.rmsnorm(x, w, 1e-6))
        return fast_cuda.STATUS["inductor"]
    with torch._dynamo.config.patch(recompile_limit=8):
        state = run_all()
        assert state == "ok" and len(fast_cuda._GRAPHS) == 12, (state, len(fast_cuda._GRAPHS))
        one = fast_cuda.compiled
        monkeypatch.setattr(fast_cuda, "compiled", lambda fn, variant=(): one(fn, ()))
        assert "RecompileLimit" in run_all()


def _entries(g) -> int:
    """How many graphs Dynamo holds for compiled copy g."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return len(_debug_get_cache_entry_list(g._torchdynamo_orig_callable.__code__))


def test_one_graph_serves_every_row_count_and_other_sizes_stay_static(monkeypatch, cpu_compile, cpu_grouped):
    """Compiling forced for CPU tensors: the grouped route and RMSNorm over 7, 33 and 120 rows each compile one
    graph (one copy, whose Dynamo cache holds one entry: the row count is dynamic), one row a copy of its own; a
    width not seen before gets a copy of its own (the widths are static: keyed, not guarded): 8 copies of one graph
    each for 2 widths. Control: without the row count marked dynamic, each row count compiles a graph of its own.
    Skipped where Inductor or the reference _grouped_mm cannot run here (conftest's cpu_compile, cpu_grouped)."""

    def graphs(widths=(24,)) -> dict:
        monkeypatch.setattr(fast_cuda, "_GRAPHS", {})
        for k in fast_cuda.STATUS:
            monkeypatch.setitem(fast_cuda.STATUS, k, "untried")
        for H in widths:
            for M in (7, 33, 120, 1):
                h, idx, wg, wu, wd = _experts(H=H, M=M)
                fast_cuda.moe_experts(h, idx, wg, wu, wd)
                fast_fused.rmsnorm(h, torch.ones(H, dtype=h.dtype), 1e-6)
        assert fast_cuda.STATUS["grouped_mm"] == "ok", fast_cuda.STATUS
        return {(f.__name__, v[2], v[3][0][4]): _entries(g) for (f, v), g in fast_cuda._GRAPHS.items()}
    got = graphs((24, 40))
    assert fast_cuda.STATUS["inductor"] == "ok" and len(fast_cuda._GRAPHS) == 8, (fast_cuda.STATUS, got)
    assert got == {(name, one, (H,)): 1 for name in ("_grouped", "_rms") for one in (False, True)
                   for H in (24, 40)}, got
    monkeypatch.setattr(fast_cuda, "_rows_dynamic", lambda x, args, rows: (x, *args))
    got = graphs()
    assert fast_cuda.STATUS["inductor"] == "ok", fast_cuda.STATUS
    assert got[("_grouped", False, (24,))] == 3 and got[("_rms", False, (24,))] == 3, got     # control


def test_a_weight_as_long_as_the_row_count_is_not_tied_to_it(monkeypatch, cpu_compile):
    """Compiling forced for CPU tensors: RMSNorm and the q/k norms with RoPE over as many rows as their weights
    have elements (64 rows of width 64; 128 rows of heads of 128) compile (their weights stay static), and a later
    call of 7 rows runs the same graph (one copy each, one graph in it); the caller's tensors carry no mark
    afterwards, and a tensor named a row tensor without the row count is refused (ValueError). Planted fault: the
    weight's size marked dynamic as the rows' is, which ties it to the row count (Dynamo refuses the graph: the
    failure is recorded and the eager ops serve). Skipped where Inductor cannot compile here (conftest's
    cpu_compile)."""
    seen = []

    def run(rms_rows=(0,), counts=(64, 7)) -> str:
        monkeypatch.setattr(fast_cuda, "_GRAPHS", {})
        monkeypatch.setitem(fast_cuda.STATUS, "inductor", "untried")
        for M in counts:
            x = torch.randn(M, 64).bfloat16()
            seen.append(x)
            fast_cuda.run_compiled(torch_norm._rms, x, torch.ones(64, dtype=x.dtype), 1e-6, rows=rms_rows)
        for M in (128, 7):
            q, k, w = torch.randn(M, 4, 128).bfloat16(), torch.randn(M, 2, 128).bfloat16(), torch.ones(128).bfloat16()
            seen.extend((q, k, w))
            fast_fused.qk_norm_rope(q, k, w, w, 1e-6, torch.arange(M), 1e4)
        return fast_cuda.STATUS["inductor"]
    state = run()
    assert state == "ok" and [_entries(g) for g in fast_cuda._GRAPHS.values()] == [1, 1], (state, fast_cuda._GRAPHS)
    assert not any(hasattr(t, "_dynamo_dynamic_indices") for t in seen)
    with pytest.raises(ValueError, match="argument 1 of shape"):
        fast_cuda.run_compiled(torch_norm._rms, seen[1], torch.ones(64), 1e-6, rows=(0, 1))
    assert "Constraint" in run(rms_rows=(0, 1), counts=(64,))                       # planted fault


def test_grouped_route_computes_each_pairs_expert(monkeypatch, cpu_grouped):
    """Through torch's reference _grouped_mm on CPU tensors: every (row, slot) pair gets its own expert's SwiGLU
    (close to the per-pair loop: the reference may group the products differently); a planted fault (the sort's
    order reversed within a group boundary) is caught. Skipped where this torch has no CPU _grouped_mm (conftest's
    cpu_grouped)."""
    h, idx, wg, wu, wd = _experts()
    y = fast_cuda.moe_experts(h, idx, wg, wu, wd)
    ref = _loop(h, idx, wg, wu, wd)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-3)
    argsort = torch.argsort
    monkeypatch.setattr(torch, "argsort", lambda t, stable=True: argsort(t, stable=stable).flip(0))
    bad = fast_cuda.moe_experts(h, idx, wg, wu, wd)
    assert not torch.allclose(bad.float(), ref.float(), rtol=2e-2, atol=2e-3)


def test_serve_refuses_what_it_cannot_run():
    h, idx, wg, wu, wd = _experts()
    assert not fast_cuda.moe_experts_serve(h, wg, wu, wd)                        # CPU
    assert not fast_cuda.moe_experts_serve(h.float(), wg.float(), wu.float(), wd.float())
    assert not fast_cuda.attention_prompt_serve(torch.zeros(2, 4, 8), torch.zeros(1, 4, 2, 8))


# ------------------------------------------------------------------------------------------------ GPU

@GPU
@pytest.mark.gpu
def test_gpu_grouped_experts_close_to_the_loop():
    """fast_cuda.moe_experts (routing, gather and scatter compiled around the grouped GEMMs) against the per-pair
    loop, at 300 rows and one; control: the slots shifted."""
    h, idx, wg, wu, wd = _experts(E=128, I=768, H=2048, M=300, k=8, device="cuda")
    if not fast_cuda.moe_experts_serve(h, wg, wu, wd):
        pytest.skip("torch._grouped_mm does not serve this GPU")
    y = fast_cuda.moe_experts(h, idx, wg, wu, wd)
    ref = _loop(h, idx, wg, wu, wd)
    err = lambda a: float((a.float() - ref.float()).norm() / ref.float().norm())  # noqa: E731
    assert err(y) < 1e-2
    assert fast_cuda.STATUS["inductor"] == "ok" and fast_cuda.STATUS["grouped_mm"] == "ok", fast_cuda.STATUS
    assert err(fast_cuda.moe_experts(h, idx.roll(1, dims=1), wg, wu, wd)) > 0.5   # control: slots shifted
    one = fast_cuda.moe_experts(h[:1], idx[:1], wg, wu, wd)                       # decode: one row
    assert float((one.float() - ref[:1].float()).norm() / ref[:1].float().norm()) < 1e-2


def _attn(P=1300, S=2, seed=3, Hq=32, Hkv=4, D=128):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kc, vc = (torch.randn(S, P + 40, Hkv, D, generator=g, device="cuda").bfloat16() for _ in range(2))
    q = torch.randn(P, Hq, D, generator=g, device="cuda").bfloat16()
    return q, kc, vc


@GPU
@pytest.mark.gpu
def test_gpu_flash_attention_close_to_sdpa():
    """Prompt: one chunk and a later chunk (bottom-right causal) of slot 1, and three rows (a verify's, in the
    decode form); decode: rows of both slots at different positions; each against the fast set's SDPA kernels;
    control: positions off by one."""
    q, kc, vc = _attn()
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    for a, n in ((0, 1300), (700, 600)):
        slots, pos = torch.ones(n, dtype=torch.int64, device="cuda"), torch.arange(a, a + n, device="cuda")
        out = fast_cuda.attention_prompt(q[a:a + n], kc, vc, slots, pos)
        ref = torch_attn.attention_fast_prompt(q[a:a + n], kc, vc, slots, pos)
        assert rel(out, ref) < 1e-2, (a, n)
        assert rel(fast_cuda.attention_prompt(q[a:a + n], kc, vc, slots, pos + 1), ref) > 1e-2
    few = torch.ones(3, dtype=torch.int64, device="cuda"), torch.arange(700, 703, device="cuda")   # a verify's rows
    ref = torch_attn.attention_fast_prompt(q[700:703], kc, vc, *few)
    assert rel(fast_cuda.attention_prompt(q[700:703], kc, vc, *few), ref) < 1e-2
    assert rel(fast_cuda.attention_prompt(q[700:703], kc, vc, few[0], few[1] + 1), ref) > 1e-3
    slots = torch.tensor([1, 0, 1, 0], device="cuda")
    pos = torch.tensor([0, 17, 700, 1299], device="cuda")
    out = fast_cuda.attention_decode(q[:4], kc, vc, slots, pos)
    ref = torch_attn.attention_fast_decode(q[:4], kc, vc, slots, pos)
    assert rel(out, ref) < 1e-2
    assert rel(fast_cuda.attention_decode(q[:4], kc, vc, slots, pos - 1 + (pos == 0)), ref) > 1e-3


@GPU
@pytest.mark.gpu
def test_gpu_fast_decode_step_is_one_graph():
    """A fast decode step of two streams replays as one CUDA graph (attention and experts captured), and its
    logits equal the eager step's as bytes."""
    from exactness.config import get_preset
    from exactness.graphs import GraphDecoder
    from exactness.weights import device_random_weights
    from exactness.loop import decode_step
    w = device_random_weights(get_preset("small").replace(n_layers=2), torch.bfloat16, "cuda", seed=1)
    from exactness.paths import Schedule, prefill
    cache = KVCache(w.cfg, 64, 2, w.dtype, w.device)
    for s, n in ((0, 30), (1, 37)):                                               # two streams, two positions
        prefill(w, cache, torch.arange(n) % 251, "fast", Schedule("batched"), slot=s)
    dec = GraphDecoder(w, cache, "fast", batch=2)
    tok, pos = torch.tensor([5, 9], device="cuda"), [30, 37]
    dec.step(tok, pos, [0, 1])                                                   # eager, then capture
    eager = decode_step(w, cache, tok, torch.tensor(pos, device="cuda"), torch.tensor([0, 1], device="cuda"), "fast")
    replay = dec.step(tok, pos, [0, 1])
    assert dec.info()["reason"] is None and dec.info()["pieces"] == 1, dec.info()
    assert bytes_equal(eager, replay)


def _launches(fn) -> int:
    """The CUDA kernels one call of fn launches (torch.profiler), after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


@GPU
@pytest.mark.gpu
def test_gpu_compiled_fast_ops_within_bf16_roundings_of_eager_in_fewer_launches():
    """Each compiled op of fast_fused against the same torch ops run eagerly, at a decode row count and a prompt's
    (1 and 300 rows): relative error (norm) within bf16's epsilon 2^-7 (Inductor rounds a fused chain once where
    eager rounds each op, and RoPE's sum cancels, so elementwise ULPs can be large; max, argmax and count beyond 2
    ULPs in the message), in fewer launches than eager (the combine, one einsum, in no more); planted fault: an
    input of the compiled call (norm weight, RoPE input, routing weights) scaled by 1.25, beyond the bound."""
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda").bfloat16()  # noqa: E731
    H, Hq, Hk, D, K, k = 256, 4, 2, 64, 512, 8
    w, wq, wk, wo = 1 + 0.1 * r(H), 1 + 0.1 * r(D), 1 + 0.1 * r(D), 0.05 * r(H, K)
    for M in (1, 300):
        a, b, xo = r(M, H), r(M, H), r(M, K)
        q, kk, pos = r(M, Hq, D), r(M, Hk, D), torch.arange(M, device="cuda") + 4000
        y, wts = r(M, k, H), torch.softmax(r(M, k).float(), -1).bfloat16()
        f = 1.25                                           # the planted fault scales one input by f
        cases = {   # name: (compiled op of input t, eager ops, the input, the input of the planted fault)
            "rmsnorm": (lambda t: fast_fused.rmsnorm(a, t, 1e-6), lambda: torch_norm._rms(a, w, 1e-6), w, w * f),
            "rope": (lambda t: fast_fused.rope(t, pos, 1e6), lambda: torch_rope.rope_fast(q, pos, 1e6), q, q * f),
            "combine": (lambda t: fast_fused.combine(y, t, None), lambda: torch_experts.combine_fast(y, wts, None),
                        wts, wts * f),
            "residual_norm": (lambda t: fast_fused.residual_norm(a, b, t, 1e-6),
                              lambda: fast_fused._residual_norm(a, b, w, 1e-6), w, w * f),
            "combine_residual_norm": (lambda t: fast_fused.combine_residual_norm(y, wts, None, a, t, 1e-6),
                                      lambda: fast_fused._combine_residual_norm(y, wts, None, a, w, 1e-6), w, w * f),
            "dense_residual_norm": (lambda t: fast_fused.dense_residual_norm(xo, wo, a, t, 1e-6),
                                    lambda: fast_fused._dense_residual_norm(xo, wo, a, w, 1e-6), w, w * f),
            "qk_norm_rope": (lambda t: fast_fused.qk_norm_rope(q, kk, t[0], t[1], 1e-6, pos, 1e6),
                             lambda: fast_fused._qk_norm_rope(q, kk, wq, wk, 1e-6, pos, 1e6), (wq, wk),
                             (wq * f, wk * f)),
        }
        tup = lambda v: v if isinstance(v, tuple) else (v,)  # noqa: E731
        for name, (op, eager, given, fault) in cases.items():
            outs, refs = tup(op(given)), tup(eager())
            assert fast_cuda.STATUS["inductor"] == "ok", fast_cuda.STATUS
            for o, ref in zip(outs, refs):
                d = (o.float() - ref.float()).abs()
                assert _rel(o, ref) <= BF16_EPS, (name, M, _rel(o, ref), float(d.max()), int(d.argmax()),
                                                  int((_ulps(o, ref) > 2).sum()))
            assert max(_rel(o, ref) for o, ref in zip(tup(op(fault)), refs)) > BF16_EPS, (name, M)   # planted fault
            compiled = lambda op=op, given=given: op(given)  # noqa: E731
            fewer = _launches(compiled), _launches(eager)
            assert fewer[0] <= fewer[1] if name == "combine" else fewer[0] < fewer[1], (name, M, fewer)


@GPU
@pytest.mark.gpu
def test_gpu_fast_verify_rows_are_one_graph():
    """A fast forward of three rows of one stream on the batched plan (a drafted verify) replays as one CUDA graph
    (its attention in the decode form, captured), and its logits equal the eager forward's as bytes; control: the
    eager forward one position later differs."""
    from exactness.config import get_preset
    from exactness.graphs import GraphForward
    from exactness.paths import Schedule, prefill
    from exactness.weights import device_random_weights
    w = device_random_weights(get_preset("small").replace(n_layers=2), torch.bfloat16, "cuda", seed=1)
    cache = KVCache(w.cfg, 64, 1, w.dtype, w.device)
    prefill(w, cache, torch.arange(30) % 251, "fast", Schedule("batched"), slot=0)
    g = GraphForward(w, cache, "fast", rows=3, plan=BATCHED)
    tok = torch.tensor([5, 9, 11], device="cuda")
    outs = []
    for _ in range(3):                                   # eager + capture, then a replay, at the same positions
        outs.append(g.run(tok, [30, 31, 32], [0, 0, 0]).logits)
        cache.truncate(0, 30)
    info = g.info()
    assert info["reason"] is None and info["pieces"] == 1 and info["replays"] == 2, info
    pos = torch.arange(30, 33, device="cuda")
    eager = forward(w, tok, pos, cache, "fast", BATCHED, slots=torch.zeros(3, dtype=torch.int64, device="cuda"))
    assert bytes_equal(outs[-1], eager.logits)
    cache.truncate(0, 30)
    later = forward(w, tok, pos + 1, cache, "fast", BATCHED, slots=torch.zeros(3, dtype=torch.int64, device="cuda"))
    assert not bytes_equal(later.logits, eager.logits)
