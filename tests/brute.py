"""Independent re-derivations of the byte comparisons, for tests whose expected outcome depends on the CPU.

Whether the fast set's prompt rows differ from its decode rows depends on the instruction set torch's CPU kernels
use, so such a test measures first with these plain loops over Python ``bytes`` (no shared code with the checkers)
and then asserts that the checker under test agrees.
"""
import torch


def first_row(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First row index where rows of a [n, ...] and b [m, ...] differ as bytes; None when equal (min(n, m) when only
    the lengths differ)."""
    n = min(a.shape[0], b.shape[0])
    for i in range(n):
        if a[i].contiguous().numpy().tobytes() != b[i].contiguous().numpy().tobytes():
            return i
    return None if a.shape[0] == b.shape[0] else n


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def first_kv_position(a, b) -> int | None:
    """First position whose slot-0 keys or values differ as bytes in any layer of KV caches a, b (None if equal)."""
    n = a.lengths[0]
    assert n == b.lengths[0], "the caches hold different numbers of positions"
    for pos in range(n):
        if any(_raw(x[0, pos]) != _raw(y[0, pos]) for x, y in zip(a.k + a.v, b.k + b.v)):
            return pos
    return None
