"""Kernel sets defined outside the package, named by reference (``verdict_sets:ATTR``) in the tests of importable
kernel sets: an identical copy of ``invariant`` (a KernelSet object), a planted fault (a function returning a
KernelSet), and attributes that are not kernel sets."""
from dataclasses import replace

from exactness.exact import as_int
from exactness.kernels import KernelSet, get_set

_INV = get_set("invariant")

COPY = KernelSet("helper_copy", dict(_INV.decode), dict(_INV.prompt), True, "identical copy of invariant")
NOT_A_SET = 42


def dense_row0_fault() -> KernelSet:
    """``invariant`` with its prompt dense kernel one ULP off on element 0 of row 0 in calls of more than one
    row."""
    spec = _INV.prompt["dense"]

    def fn(x, w):
        out = spec.fn(x, w)
        if x.shape[0] > 1:
            out = out.clone()
            as_int(out)[0, 0] += 1
        return out
    return KernelSet("helper_dense_row0", dict(_INV.decode), {**_INV.prompt, "dense": replace(spec, fn=fn)}, True,
                     "planted fault")


def not_a_set():
    return "invariant"
