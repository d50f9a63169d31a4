"""Quantized weights (int4_g128, nvfp4): dequantization against a decoder written here, the invariant set's prompt
rows against the decode oracle on quantized weights (with a planted fault), and where the fast set differs."""
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from exactness.config import get_preset
from exactness.exact import bytes_equal, differing_rows, first_differing_row, kv_first_difference
from exactness.kernels import KernelSet, get_set
from exactness.kernels import quant
from exactness.kernels.cuda import dense_invariant
from exactness.paths import Schedule, generate
from exactness.weights import synthetic_weights, weights_format

FORMATS = ("int4_g128", "nvfp4")


def _e2m1(code: torch.Tensor) -> torch.Tensor:
    """fp64 value of 4-bit e2m1 codes from their bits: sign(3), exponent(2..1, bias 1), mantissa(0)."""
    c = code.long()
    sign = 1.0 - 2.0 * ((c >> 3) & 1).double()
    e, m = ((c >> 1) & 3).double(), (c & 1).double()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1) * (1 + 0.5 * m))
    return sign * mag


def _e4m3(s: torch.Tensor) -> torch.Tensor:
    """fp64 value of float8 e4m3fn scales from their bits: sign(7), exponent(6..3, bias 7), mantissa(2..0)."""
    b = s.view(torch.uint8).long()
    sign = 1.0 - 2.0 * ((b >> 7) & 1).double()
    e, m = ((b >> 3) & 15).double(), (b & 7).double()
    return sign * torch.where(e == 0, m / 8 * 2.0 ** -6, torch.exp2(e - 7) * (1 + m / 8))


def reference_dequantize(qw: quant.QuantWeight) -> torch.Tensor:
    """The formats' definition (kernels/quant.py docstring), decoded bit by bit: fp32 [N, K]."""
    K = qw.codes.shape[-1]
    group = torch.arange(K) // quant.GROUP[qw.fmt]                       # [K] scale index of each column
    if qw.fmt == "int4_g128":
        return (qw.codes.double() * qw.scales.double()[:, group]).float()   # exact: 4 bits x 8 bits
    vs = (_e2m1(qw.codes) * _e4m3(qw.scales)[:, group]).float()           # exact: 2 bits x 4 bits
    return vs * qw.gscale.float()                                          # one fp32 rounding


def _random_weight(fmt: str, n: int = 24, k: int = 200) -> tuple[torch.Tensor, quant.QuantWeight]:
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)).to(torch.bfloat16)
    w[3, :40] = 0                                                          # an all-zero block and group part
    return w, quant.quantize(w, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_reference_decoder(fmt):
    w, qw = _random_weight(fmt)
    assert qw.codes.dtype == torch.int8 and qw.codes.shape == w.shape
    lo, hi = (-8, 7) if fmt == "int4_g128" else (0, 15)
    assert int(qw.codes.min()) >= lo and int(qw.codes.max()) <= hi
    dq = qw.dequantize()
    assert bytes_equal(dq, reference_dequantize(qw))
    # negative control: one group's scale halved, decoded by the reference, must not match
    assert not bytes_equal(dq, reference_dequantize(quant.with_scale(qw, 0, 0, 0.5)))
    # quantization error against its bound: half the largest code step times the group's scale
    step = qw.scales.float() * (1.0 if fmt == "int4_g128" else qw.gscale)     # [N, groups]
    half_gap = 0.5 if fmt == "int4_g128" else 1.0                             # e2m1: widest gap 4 -> 6
    bound = half_gap * step[:, torch.arange(w.shape[1]) // quant.GROUP[fmt]] * 1.07  # e4m3 / bf16 scale rounding
    err = (dq - w.float()).abs()
    excess = err - bound
    print(f"{fmt}: max |w - dq| = {err.max():.4g} at {divmod(int(err.argmax()), w.shape[1])}, "
          f"over bound: {int((excess > 0).sum())}")
    assert float(excess.max()) <= 0


def test_quantize_is_deterministic_and_refuses_bad_settings():
    w, qw = _random_weight("nvfp4")
    again = quant.quantize(w.clone(), "nvfp4")
    assert bytes_equal(qw.codes, again.codes) and bytes_equal(qw.scales, again.scales)
    with pytest.raises(ValueError, match="int8"):
        quant.quantize(w, "int8")
    with pytest.raises(ValueError, match="allowed: bf16, int4_g128, nvfp4"):
        synthetic_weights(get_preset("tiny"), weights="int3")
    with pytest.raises(NotImplementedError, match="nvfp4"):
        qw.stride()                                   # a plain-tensor kernel given quantized weights fails clearly


@pytest.fixture(scope="module", params=FORMATS)
def qweights(request):
    return synthetic_weights(get_preset("tiny"), weights=request.param)


@pytest.fixture(scope="module")
def prompt(code_prompt):
    return code_prompt.ids[:40]


def _run(w, ids, ks, schedule):
    return generate(w, ids, 3, ks, schedule, keep_cache=True)


def test_invariant_prompt_rows_equal_decode(qweights, prompt):
    assert weights_format(qweights) in FORMATS
    oracle = _run(qweights, prompt, "invariant", Schedule("decode"))
    for sched in (Schedule("batched", 16), Schedule("batched"), Schedule("deep", 16, deep_threshold=8)):
        run = _run(qweights, prompt, "invariant", sched)
        assert first_differing_row(oracle.prompt_logits, run.prompt_logits) is None, sched
        assert kv_first_difference(oracle.cache, run.cache) is None, sched
        assert bytes_equal(oracle.gen_ids, run.gen_ids), sched
    assert run.served["deep"]["segments"] > 0


def _perturbed_prompt_dense() -> KernelSet:
    """The invariant set whose prompt dense kernel dequantizes one group (row 0, group 0) with its scale halved."""
    ks = get_set("invariant")

    def dense(x, w):
        return dense_invariant(x, quant.with_scale(w, 0, 0, 0.5) if isinstance(w, quant.QuantWeight) else w)
    prompt = {**ks.prompt, "dense": replace(ks.prompt["dense"], fn=dense)}
    return KernelSet("invariant+scale-fault", dict(ks.decode), prompt, False, "test-only perturbation")


def test_planted_scale_fault_is_caught(qweights, prompt):
    oracle = _run(qweights, prompt, "invariant", Schedule("decode"))
    run = _run(qweights, prompt, _perturbed_prompt_dense(), Schedule("batched", 16))
    assert first_differing_row(oracle.prompt_logits, run.prompt_logits) is not None
    assert kv_first_difference(oracle.cache, run.cache) is not None


def test_fast_set_differences_located(qweights, prompt):
    """The fast set's quantized dense: mat-vec (the decode kernel) below FAST_GEMM_ROWS rows, dequantize-to-bf16 +
    GEMM above. Where its prompt rows differ from decode rows is located and printed, not counted."""
    qw = qweights.layers[0].wq
    x = torch.randn(2 * quant.FAST_GEMM_ROWS, qw.shape[1], generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16)
    fast = get_set("fast").fn("dense", "prompt")
    decode = torch.cat([get_set("fast").fn("dense", "decode")(x[i:i + 1], qw) for i in range(x.shape[0])])
    small = quant.FAST_GEMM_ROWS - 1
    assert bytes_equal(fast(x[:small], qw), decode[:small])             # below the threshold: the decode kernel
    assert bytes_equal(fast(x, qw), F.linear(x, qw.dequantize().to(x.dtype)))   # above: the engines' recipe
    lossy = int((qw.dequantize().to(torch.bfloat16).float() != qw.dequantize()).sum())
    assert lossy > 0                                                      # the recipe's extra rounding of weights
    rows = differing_rows(fast(x, qw), decode).nonzero().flatten().tolist()
    path = _run(qweights, prompt, "fast", Schedule("batched", 16))
    first = first_differing_row(_run(qweights, prompt, "fast", Schedule("decode")).prompt_logits, path.prompt_logits)
    print(f"{weights_format(qweights)} fast: {lossy} weights change in bf16; dense rows differing from decode: "
          f"{rows}; first differing prompt row (batched 16 vs decode): {first}")
