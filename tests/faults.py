"""Planted faults shared by the negative-control tests."""
from dataclasses import replace

from exactness.kernels import KernelSet, get_set


def row0_perturbed(cls: str, change, roles=("decode", "prompt"), base: str = "invariant") -> KernelSet:
    """The ``base`` set with kernel class ``cls`` changed by ``change(out)`` on row 0 of every call of more than
    one row (a batch-composition-dependent kernel) in ``roles``; not registered."""
    ks = get_set(base)

    def wrap(fn):
        def f(x, *args):
            out = fn(x, *args)
            if x.shape[0] > 1:
                out = out.clone()
                out[0] = change(out[0])
            return out
        return f
    tab = {r: {c: (replace(s, fn=wrap(s.fn)) if c == cls and r in roles else s) for c, s in getattr(ks, r).items()}
           for r in ("decode", "prompt")}
    return KernelSet(f"{base}+row0-{cls}", tab["decode"], tab["prompt"], False, "test-only perturbation")


def row0_rmsnorm_perturbed() -> KernelSet:
    """RMSNorm changed by about one bf16 ulp (x (1 + 2^-7)) on row 0 of every call of more than one row."""
    return row0_perturbed("rmsnorm", lambda t: t * (1 + 2 ** -7))
