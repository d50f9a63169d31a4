"""ULP distances (exact.py) and correct rounding (analysis/ulp.py) against exhaustive walks and independent
references."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from exactness.analysis import ulp
from exactness.exact import as_int, bytes_equal, ordered, ulp_distance


def _bf16_walk() -> torch.Tensor:
    """Every non-NaN bf16 value from -inf to +inf, by a nextafter chain (torch.nextafter on bf16)."""
    x = torch.tensor([-float("inf")], dtype=torch.bfloat16)
    up = torch.tensor([float("inf")], dtype=torch.bfloat16)
    out = [x]
    while not torch.isinf(x).logical_and(x > 0).item():
        x = torch.nextafter(x, up)
        out.append(x)
    return torch.cat(out)


@pytest.fixture(scope="module")
def bf16_walk():
    return _bf16_walk()


def test_bf16_walk_covers_all_patterns(bf16_walk):
    # all non-NaN patterns, counted directly, minus one: +0 and -0 are the same step of the walk
    allbits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    n_values = int((~torch.isnan(allbits)).sum()) - 1  # +0 and -0 are one step of the walk
    assert bf16_walk.numel() == n_values, (bf16_walk.numel(), n_values)


def test_bf16_ulp_distance_equals_walk_index(bf16_walk):
    walk_idx = torch.arange(bf16_walk.numel())
    o = ordered(bf16_walk)
    d = o - o[0]
    bad = (d != walk_idx).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, first at walk index {int(bad[0])}"
    # pairwise distances on a random sample of pairs
    g = torch.Generator().manual_seed(1)
    i, j = torch.randint(0, bf16_walk.numel(), (2, 20000), generator=g)
    assert torch.equal(ulp_distance(bf16_walk[i], bf16_walk[j]), (i - j).abs())


def test_bf16_distance_is_fp32_distance_shifted(bf16_walk):
    # a bf16 value is the top half of an fp32: bf16 distance = fp32 ordered distance of the widened values >> 16
    a, b = bf16_walk[:-1], bf16_walk[1:]
    d32 = ulp_distance(a.float(), b.float()) >> 16
    assert torch.equal(d32, ulp_distance(a, b))


def test_fp16_ulp_distance_equals_walk_index():
    x = np.float16(-np.inf)
    walk = [x]
    with np.errstate(over="ignore"):
        while not (np.isinf(x) and x > 0):
            x = np.nextafter(x, np.float16(np.inf))
            walk.append(x)
    t = torch.from_numpy(np.array(walk, dtype=np.float16))
    d = ordered(t) - ordered(t[:1])
    assert torch.equal(d, torch.arange(t.numel())), "fp16 ordered integers are not the nextafter walk index"


@pytest.mark.parametrize("dtype,npdt", [(torch.float32, np.float32), (torch.float64, np.float64)])
def test_wide_ulp_distance_equals_walk_windows(dtype, npdt):
    fi = np.finfo(npdt)
    starts = np.array([-fi.tiny * 4, -1.0, 1.0, 2.0 - fi.eps, fi.tiny - 200 * fi.smallest_subnormal, 1e30,
                       -fi.max, fi.max * 0.9999, 0.0, -0.0], dtype=npdt)
    cur = starts.copy()
    steps = 3000
    for k in range(1, steps + 1):
        with np.errstate(over="ignore"):
            cur = np.nextafter(cur, npdt(np.inf))
        d = ulp_distance(torch.from_numpy(starts.copy()), torch.from_numpy(cur.copy()))
        fin = np.isfinite(cur)
        assert (d.numpy()[fin] == k).all(), f"step {k}: distances {d.numpy()[fin]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 100])
def test_planted_error_of_n_ulps_is_reported_as_n(dtype, n):
    g = torch.Generator().manual_seed(n)
    y = torch.randn(5000, dtype=torch.float64, generator=g) * 3
    r = ulp.round_to(y, dtype)
    for sgn in (1, -1):
        planted = ulp.step(r, sgn * n)
        d = ulp_distance(planted, r)
        assert int(d.min()) == n and int(d.max()) == n, (int(d.min()), int(d.max()))


def _rn_by_table(y: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Independent RN-even: nearest of the two neighbours in the sorted table of all values; ties to even bits."""
    vals = table.double()
    hi = torch.searchsorted(vals, y).clamp(1, vals.numel() - 1)
    lo = hi - 1
    dlo, dhi = (y - vals[lo]).abs(), (vals[hi] - y).abs()
    even_hi = (as_int(table[hi]) & 1) == 0
    pick_hi = (dhi < dlo) | ((dhi == dlo) & even_hi)
    return torch.where(pick_hi, table[hi], table[lo])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_to_exhaustive_midpoints(dtype):
    allbits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    fin = allbits[torch.isfinite(allbits)]
    table = fin[torch.argsort(fin.double(), stable=True)]
    table = table[torch.cat([torch.tensor([True]), table[1:].double() != table[:-1].double()])]  # one zero
    v = table.double()
    mid = (v[1:] + v[:-1]) / 2                                                   # exact in fp64
    eps = torch.nextafter(mid, torch.full_like(mid, float("inf"))) - mid
    ys = torch.cat([v, mid, mid + eps, mid - eps, torch.randn(20000, dtype=torch.float64) * 100])
    got = ulp.round_to(ys, dtype)
    want = _rn_by_table(ys, table)
    bad = (got.double() != want.double()).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} wrong roundings, first y={ys[bad[0]].item()!r}"


def test_round_to_fp32_matches_ieee_conversion():
    g = torch.Generator().manual_seed(3)
    y = torch.cat([torch.randn(50000, dtype=torch.float64, generator=g) * 10.0 ** torch.randint(-45, 39, (50000,),
                   generator=g), torch.tensor([1.5e-45, 7e-46, 3.4028235677973366e38, 3.402823669209385e38])])
    want = torch.from_numpy(y.numpy().astype(np.float32))                       # IEEE RN-even conversion
    got = ulp.round_to(y, torch.float32)
    assert bytes_equal(got, want)


def test_round_to_overflow_and_specials():
    big = torch.tensor([65519.99, 65520.0, -65520.0, float("inf"), float("nan"), -0.0, 1e-300], dtype=torch.float64)
    out = ulp.round_to(big, torch.float16)
    assert out[0].item() == 65504.0 and out[1].item() == float("inf") and out[2].item() == -float("inf")
    assert torch.isinf(out[3]) and torch.isnan(out[4])
    assert as_int(out[5]).item() == -32768 and out[6].item() == 0.0


def test_direct_rounding_avoids_double_rounding():
    # y lies just above a bf16 midpoint, within fp32's half-ulp of it: via fp32 the value lands on the midpoint,
    # which then ties to even (down); the correct rounding is up.
    one = 1.0
    mid = one + 2.0 ** -8                # halfway between bf16 1.0 and 1.0078125
    y = torch.tensor([mid + 2.0 ** -30], dtype=torch.float64)
    via32 = y.float().bfloat16()
    direct = ulp.round_to(y, torch.bfloat16)
    assert direct.item() == 1.0078125 and via32.item() == 1.0
    assert int(ulp_distance(direct, via32)) == 1


def test_rounding_interval_distance():
    y = torch.tensor([1.0, 1.0 + 2.0 ** -9, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], dtype=torch.float64)
    yhat = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.bfloat16)
    d = ulp.distance_to_rounding_interval(y, yhat)
    assert d.tolist() == [0.0, 0.0, 0.0, 2 * 2.0 ** -8]


def test_bad_input_errors():  # (those of ordered and ulp_distance: tests/test_exact.py)
    with pytest.raises(ValueError, match="float64"):
        ulp.round_to(torch.zeros(1), torch.bfloat16)
