"""The byte primitives (exactness/exact.py), each on hand-made tensors whose answer is known: equal inputs, and for
every primitive the differences it must see (one ULP, +0 against -0, a NaN payload, a shape, dtype or length
mismatch), so that each check here can fail."""
from __future__ import annotations

import hashlib

import pytest
import torch

from exactness.cache import KVCache
from exactness.config import get_preset
from exactness.exact import (as_int, bytes_equal, differing_rows, first_differing_row, kv_first_difference, ordered,
                             token_hash, ulp_distance)

FLOATS = [(torch.bfloat16, torch.int16), (torch.float16, torch.int16), (torch.float32, torch.int32),
          (torch.float64, torch.int64)]


def up(t: torch.Tensor) -> torch.Tensor:
    """``t`` (positive, finite) one ULP up, made with nextafter (not with the code under test)."""
    return torch.nextafter(t, torch.full_like(t, float("inf")))


def zeros_pm(dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([0.0], dtype=dtype), torch.tensor([-0.0], dtype=dtype)


def nans(dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Two quiet NaNs of ``dtype`` that differ only in the lowest payload bit."""
    bits = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}[dtype]
    idt = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    t = torch.tensor([bits, bits + 1], dtype=idt).view(dtype)
    return t[:1], t[1:]


# ----------------------------------------------------------------------------------------------------- as_int

@pytest.mark.parametrize("dtype,idt", FLOATS)
def test_as_int_is_a_view_of_the_same_width(dtype, idt):
    x = torch.tensor([1.0, -2.5], dtype=dtype)
    i = as_int(x)
    assert i.dtype == idt and i.shape == x.shape and i.data_ptr() == x.data_ptr()
    assert int(as_int(up(x[:1]))[0]) - int(i[0]) == 1                       # one ULP is one integer step
    p, m = zeros_pm(dtype)
    assert int(as_int(p)) == 0 and int(as_int(m)) == torch.iinfo(idt).min  # -0 is the sign bit alone
    assert as_int(torch.tensor(3.0, dtype=dtype)).dim() == 0               # 0-dim stays 0-dim


def test_as_int_keeps_integers_and_bools_and_refuses_other_dtypes():
    for t in (torch.tensor([1, 2]), torch.tensor([1], dtype=torch.uint8), torch.tensor([True, False])):
        assert as_int(t) is t
    for dt in (torch.float8_e4m3fn, torch.complex64):
        with pytest.raises(ValueError, match=f"unsupported dtype {dt}"):
            as_int(torch.zeros(2, dtype=dt))


# ------------------------------------------------------------------------------------------------ bytes_equal

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bytes_equal_sees_every_bit(dtype):
    x = torch.linspace(1, 2, 12, dtype=dtype).reshape(3, 4)
    assert bytes_equal(x, x.clone())
    y = x.clone()
    y[2, 1] = up(y[2, 1])
    assert not bytes_equal(x, y)                                           # one ULP
    p, m = zeros_pm(dtype)
    assert torch.equal(p, m) and not bytes_equal(p, m)                      # values equal, bytes not
    a, b = nans(dtype)
    assert bytes_equal(a, a.clone()) and not torch.equal(a, a.clone())      # a NaN equals its own bytes
    assert not bytes_equal(a, b)                                            # another payload differs


def test_bytes_equal_shape_and_dtype_mismatch_is_false_not_an_error():
    x = torch.arange(6, dtype=torch.float32)
    assert not bytes_equal(x, x.reshape(2, 3))                              # same bytes, other shape
    assert not bytes_equal(x.view(torch.int32), x)                          # same bytes, other dtype
    assert bytes_equal(torch.tensor(1.5), torch.tensor(1.5)) and not bytes_equal(torch.tensor(1.5), torch.tensor(2.0))
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert bytes_equal(t.t(), t.t().contiguous())                           # layout does not matter, values do


# -------------------------------------------------------------------------------- differing_rows, first row

def test_differing_rows_marks_exactly_the_changed_rows():
    a = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(0)).bfloat16()
    b = a.clone()
    b[1, 1, 2] = up(b[1, 1, 2].abs()) * b[1, 1, 2].sign()
    b[3] = -b[3]
    assert differing_rows(a, b).tolist() == [False, True, False, True, False]
    assert differing_rows(a, a.clone()).tolist() == [False] * 5
    assert differing_rows(torch.tensor([1, 2, 3]), torch.tensor([1, 5, 3])).tolist() == [False, True, False]
    with pytest.raises(ValueError, match="one shape"):
        differing_rows(a, b[:4])
    with pytest.raises(ValueError, match="one dtype"):
        differing_rows(a, b.float())


def test_first_differing_row_of_rows():
    a = torch.linspace(-1, 1, 40, dtype=torch.float32).reshape(8, 5)
    b = a.clone()
    assert first_differing_row(a, b) is None
    b[6, 0] = up(b[6, 0])
    b[3, 4] = up(b[3, 4])
    assert first_differing_row(a, b) == 3                                   # the first of two, one ULP each
    z = torch.zeros(4, 2)
    zm = z.clone()
    zm[2, 1] = -0.0
    assert first_differing_row(z, zm) == 2                                  # +0 against -0
    n1, n2 = nans(torch.float32)
    c, d = torch.zeros(3, 1), torch.zeros(3, 1)
    c[1], d[1] = n1, n2
    assert first_differing_row(c, d) == 1                                   # another NaN payload
    c[1] = n2
    assert first_differing_row(c, d) is None                                # the same NaN


def test_first_differing_row_lengths_and_refusals():
    a = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    assert first_differing_row(a, a[:2]) == 2 and first_differing_row(a[:2], a) == 2  # only the lengths differ
    assert first_differing_row(a[:0], a[:0]) is None and first_differing_row(a[:0], a) == 0
    with pytest.raises(ValueError, match="one dtype"):
        first_differing_row(a, a.double())
    with pytest.raises(ValueError, match="one shape"):
        first_differing_row(a, a[:, :2])
    with pytest.raises(ValueError, match="at least one dimension"):
        first_differing_row(torch.tensor(1.0), torch.tensor(1.0))


def test_first_differing_row_of_token_sequences():
    a = torch.tensor([1, 2, 3, 4])
    assert first_differing_row(a, a.clone()) is None
    assert first_differing_row(a, torch.tensor([1, 2, 9, 4])) == 2
    assert first_differing_row(a, a[:3]) == 3


# ---------------------------------------------------------------------------------------- kv_first_difference

def _cache(n: int, seed: int = 0) -> KVCache:
    """A tiny-preset bf16 cache with ``n`` positions of slot 0 written with seeded values."""
    cfg = get_preset("tiny")
    c = KVCache(cfg, 16, 1, torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    for t in c.k + c.v:
        t[0, :n] = torch.randn(t[0, :n].shape, generator=g).bfloat16()
    c.lengths[0] = n
    return c


def test_kv_first_difference():
    a, b = _cache(10), _cache(10)
    assert kv_first_difference(a, b) is None
    b.v[1][0, 7, 1, 3] = -b.v[1][0, 7, 1, 3]                                 # a sign: layer 1, values, position 7
    b.k[0][0, 5, 0, 0] = up(b.k[0][0, 5, 0, 0].abs())                       # layer 0, keys, position 5
    assert kv_first_difference(a, b) == 5                                   # the earliest over layers, k and v
    c = _cache(10)
    c.k[1][0, 12, 0, 0] = 1.0                                               # past the written positions: not seen
    assert kv_first_difference(a, c) is None
    assert kv_first_difference(a, _cache(9)) == -1 and kv_first_difference(_cache(9), a) == -1
    assert kv_first_difference(a, _cache(10, seed=1)) == 0


# ------------------------------------------------------------------------------------------------- token_hash

def test_token_hash_is_sha256_of_little_endian_int32():
    ids = [1, 256, 65537]
    raw = b"".join(i.to_bytes(4, "little", signed=True) for i in ids)
    assert token_hash(torch.tensor(ids)) == hashlib.sha256(raw).hexdigest()[:12]
    assert token_hash(torch.tensor([1, 2])) != token_hash(torch.tensor([2, 1]))
    assert token_hash(torch.tensor(ids, dtype=torch.int32)) == token_hash(ids)  # the ids, not their dtype
    assert token_hash([1, 256]) != token_hash(ids)                          # a shorter sequence differs


# ------------------------------------------------------------------------------------- ordered, ulp_distance

@pytest.mark.parametrize("dtype,idt", FLOATS)
def test_ulp_distance_steps_zeros_and_infinity(dtype, idt):
    one = torch.tensor([1.0], dtype=dtype)
    assert int(ulp_distance(one, up(one))) == 1 and int(ulp_distance(up(one), one)) == 1
    p, m = zeros_pm(dtype)
    assert int(ulp_distance(p, m)) == 0 and int(ordered(m)) == 0
    tiny = torch.tensor([1], dtype=idt).view(dtype)                          # smallest subnormal
    assert int(ulp_distance(tiny, -tiny)) == 2
    big = torch.tensor([torch.finfo(dtype).max], dtype=dtype)
    assert int(ulp_distance(big, torch.tensor([float("inf")], dtype=dtype))) == 1
    assert bool((ordered(torch.tensor([-1.0, -0.5, 0.5, 1.0], dtype=dtype)).diff() > 0).all())  # monotone


def test_ulp_distance_in_bf16_counts_stored_fraction_bits():
    assert int(ulp_distance(torch.tensor(1.0).bfloat16(), torch.tensor(2.0).bfloat16())) == 128


def test_ulp_distance_refusals():
    with pytest.raises(ValueError, match="NaN"):
        ordered(torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="NaN at flat index 1"):
        ulp_distance(torch.zeros(2), torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="one dtype"):
        ulp_distance(torch.zeros(1), torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="unsupported dtype"):
        ordered(torch.zeros(1, dtype=torch.int32))


def test_bytes_equal_takes_strided_views():
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    y = x.clone()
    assert bytes_equal(x[:, 1], y[:, 1]) and bytes_equal(x.t(), y.t())
    y[2, 1] = -0.0 if float(y[2, 1]) == 0.0 else y[2, 1] * 2
    assert not bytes_equal(x[:, 1], y[:, 1])
