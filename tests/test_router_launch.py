"""The router of a decode-size call in one launch (kernels/triton_router.py: the logits' split-K programs, the last of
which takes the softmax/top-k) gives the bytes of triton_gemm.linear then triton_moe_rows.softmax_topk: weights,
expert ids and logits, compared as integers; a planted fault (a router weight doubled) must be caught by the same
comparison. The GPU test runs the small preset's router (128 experts, hidden 2048, top-8), the interpreter test a
tiny one with a config pinned for it.
"""
from __future__ import annotations

import pytest
import torch

from interpreted import HAS_TRITON, NEEDS_TRITON, interpreted_rows

GPU = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA device and Triton")
_INTS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32, torch.int64: torch.int64}


def router_mismatches(x: torch.Tensor, w: torch.Tensor, top_k: int, norm: bool, fault: bool = False) -> list[int]:
    """Elements of (weights, idx, logits) from triton_router.router(x, w) whose bytes differ from
    triton_gemm.linear then triton_moe_rows.softmax_topk over w (fault: the one launch gets w with the weight of
    row 0's first choice doubled at every column, so its top-k and logits move). ValueError where the launch does
    not serve."""
    from exactness.kernels import triton_gemm, triton_moe_rows, triton_router
    logits = triton_gemm.linear(x, w)
    weights, idx = triton_moe_rows.softmax_topk(logits, top_k, norm)
    wf = w.clone()
    if fault:
        wf[int(idx[0, 0])] *= 2
    one = triton_router.router(x, wf, top_k, norm)
    if one is None:
        raise ValueError(f"triton_router does not serve M={x.shape[0]}")
    return [int((a.view(_INTS[a.dtype]) != b.view(_INTS[b.dtype])).sum()) for a, b in zip(one, (weights, idx, logits))]


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("M, norm", [(1, True), (1, False), (3, True), (8, True), (16, False)])
def test_gpu_router_in_one_launch_gives_the_two_kernels_bytes_and_a_planted_fault_is_caught(M, norm):
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 2048, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(128, 2048, generator=g) * 0.02).to(torch.bfloat16).cuda()
    assert router_mismatches(x, w, 8, norm) == [0, 0, 0]
    assert sum(router_mismatches(x, w, 8, norm, fault=True)) > 0


@GPU
@pytest.mark.gpu
def test_gpu_router_rows_of_a_decode_launch_equal_a_prompt_calls_and_larger_calls_run_two_launches():
    from exactness.kernels import cuda, triton_router
    g = torch.Generator().manual_seed(7)
    x = torch.randn(600, 2048, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(128, 2048, generator=g) * 0.02).to(torch.bfloat16).cuda()
    assert triton_router.router(x[:17], w, 8, True) is None and triton_router.router(x, w, 8, True) is None
    full = cuda.router(x, w, 8, True)                                          # two launches
    for m in (0, 5, 299, 599):
        one = cuda.router(x[m:m + 1], w, 8, True)                              # one launch
        for a, b in zip(one, full):
            assert torch.equal(a.view(_INTS[a.dtype]), b[m:m + 1].view(_INTS[b.dtype]))
    bad = full[2][:1].clone()
    bad.view(torch.int16)[0, 0] += 1                                           # the comparison catches one ULP
    assert not torch.equal(bad.view(torch.int16), cuda.router(x[:1], w, 8, True)[2].view(torch.int16))


_INTERP = """
import torch
from test_router_launch import router_mismatches
from exactness.kernels import triton_gemm as tg, triton_router
tg.with_config("linear", 16, 64, torch.bfloat16, "interp", tg.GemmConfig(16, 16, 16, 1, 4, split_k=3, tma=False))
w = torch.randn(16, 64).to(torch.bfloat16)
for M in (1, 3, 20):                                  # 20 rows: two row tiles, each summed by its last split
    x = torch.randn(M, 64).to(torch.bfloat16)
    print("router", M, *router_mismatches(x, w, 4, True), sum(router_mismatches(x, w, 4, True, fault=True)))
tg.with_config("linear", 16, 64, torch.bfloat16, "interp", tg.GemmConfig(16, 8, 16, 1, 4, split_k=3, tma=False))
tg._PLANS.clear()
print("apart", int(triton_router.router(torch.randn(1, 64).to(torch.bfloat16), w, 4, True) is None))
"""


@NEEDS_TRITON
def test_interpreter_router_in_one_launch_gives_the_two_kernels_bytes_and_a_planted_fault_is_caught():
    """Under the interpreter: one launch's bytes at 1, 3 and 20 rows (two row tiles), a planted fault caught; logits
    over two column tiles are not served (the caller launches the two)."""
    rows = interpreted_rows(_INTERP)
    assert [r[:2] for r in rows] == [["router", "1"], ["router", "3"], ["router", "20"], ["apart", "1"]]
    assert all(r[2:5] == ["0", "0", "0"] and int(r[5]) > 0 for r in rows[:3])
