"""The fast set's CUDA kernels (kernels/fast_cuda.py): grouped expert GEMMs, FlashAttention-2 prompt and decode.

CPU tests: the fast set's CPU rows are plain torch's (its CUDA options change nothing there: the deep plan keeps
its row tiles, the experts run one by one), and the grouped route (rows sorted by expert, offsets, scatter back)
computes each (row, slot) pair's expert, through torch's reference _grouped_mm on CPU tensors. GPU tests (skipped
without CUDA) compare the kernels with the fast set's torch kernels within bf16 rounding, each with a planted
fault that must be caught, and check that a fast decode step is one CUDA graph whose replay equals the eager step.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from exactness.cache import KVCache
from exactness.exact import bytes_equal
from exactness.kernels import attention as torch_attn
from exactness.kernels import fast_cuda, get_set
from exactness.model import BATCHED, DEEP, forward

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _experts(E=6, I=16, H=24, M=11, k=3, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, device=device) * 0.2).to(torch.bfloat16)  # noqa: E731
    h, wg, wu, wd = r(M, H), r(E, I, H), r(E, I, H), r(E, H, I)
    idx = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(M)])   # [M, k] distinct
    return h, idx, wg, wu, wd


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


def test_grouped_route_computes_each_pairs_expert(monkeypatch):
    """Through torch's reference _grouped_mm on CPU tensors: every (row, slot) pair gets its own expert's SwiGLU
    (close to the per-pair loop: the reference may group the products differently); a planted fault (the sort's
    order reversed within a group boundary) is caught."""
    monkeypatch.setitem(fast_cuda._STATE, "cpu_grouped", True)
    h, idx, wg, wu, wd = _experts()
    try:
        y = fast_cuda.moe_experts(h, idx, wg, wu, wd)
    except (RuntimeError, NotImplementedError) as e:   # a torch whose _grouped_mm has no CPU path
        pytest.skip(f"torch._grouped_mm on CPU: {e}")
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
    h, idx, wg, wu, wd = _experts(E=128, I=768, H=2048, M=300, k=8, device="cuda")
    if not fast_cuda.moe_experts_serve(h, wg, wu, wd):
        pytest.skip("torch._grouped_mm does not serve this GPU")
    y = fast_cuda.moe_experts(h, idx, wg, wu, wd)
    ref = _loop(h, idx, wg, wu, wd)
    err = lambda a: float((a.float() - ref.float()).norm() / ref.float().norm())  # noqa: E731
    assert err(y) < 1e-2
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
    """Prompt: one chunk and a later chunk (bottom-right causal) of slot 1; decode: rows of both slots at
    different positions; each against the fast set's SDPA kernels; control: positions off by one."""
    q, kc, vc = _attn()
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    for a, n in ((0, 1300), (700, 600)):
        slots, pos = torch.ones(n, dtype=torch.int64, device="cuda"), torch.arange(a, a + n, device="cuda")
        out = fast_cuda.attention_prompt(q[a:a + n], kc, vc, slots, pos)
        ref = torch_attn.attention_fast_prompt(q[a:a + n], kc, vc, slots, pos)
        assert rel(out, ref) < 1e-2, (a, n)
        assert rel(fast_cuda.attention_prompt(q[a:a + n], kc, vc, slots, pos + 1), ref) > 1e-2
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
