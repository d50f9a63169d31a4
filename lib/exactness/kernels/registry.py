"""Kernel specs, kernel sets and lookup.

Every kernel belongs to a *kernel class* (the list below) and has a role: ``decode``
(one row per stream per step; serial decode through these kernels is the oracle) or ``prompt`` (many prompt rows at
once). A prompt kernel declares the decode kernel it ``replaces``: it claims to produce that kernel's bytes for every
row, whatever the chunk or segment length. The contract checker (analysis/contract.py) tests each claim.

A *kernel set* maps every class to one decode and one prompt kernel. Sets are registered by name and passed to the
paths as an argument; adding a set is one ``register_set`` call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

KERNEL_CLASSES: tuple[str, ...] = (
    "dense",           # q/k/v/o projections and the shared expert: y[M,N] = x[M,K] @ w[N,K]^T
    "router",          # router logits + softmax + top-k selection + renormalised weights
    "expert_gate_up",  # SiLU(x @ w_gate^T) * (x @ w_up^T) for one expert's rows
    "expert_down",     # h @ w_down^T for one expert's rows
    "moe_combine",     # sum over the k selected experts (and the shared expert) with the routing weights
    "attention",       # scores and values: softmax(q k^T / sqrt(D)) v over the cached keys, causal by position
    "rmsnorm",         # RMSNorm (hidden and per-head q/k norms)
    "rope",            # rotary position embedding
    "residual",        # residual add
    "lm_head",         # final projection to vocabulary logits
    "argmax",          # greedy sampling
)
ROLES = ("decode", "prompt")


@dataclass(frozen=True)
class KernelSpec:
    """One registered kernel.

    Attributes:
        cls: kernel class (one of KERNEL_CLASSES).
        name: unique kernel id, e.g. ``"fast.dense.prompt"``.
        role: ``"decode"`` or ``"prompt"``.
        fn: the callable; its signature is the class's (kernels/__init__.py documents each).
        replaces: for a prompt kernel, the name of the decode kernel whose bytes it claims to reproduce.
        doc: one line on how it computes (accumulation order, tiles).
    """

    cls: str
    name: str
    role: str
    fn: Callable
    replaces: str | None = None
    doc: str = ""


@dataclass(frozen=True)
class KernelSet:
    """A named pair of kernels (decode, prompt) per kernel class.

    Attributes:
        name: set name (``"fast"``, ``"invariant"``, ...).
        decode, prompt: class -> KernelSpec.
        claims_exact: True when every prompt kernel claims its decode kernel's bytes for every row (the invariant
            set); False for sets kept for comparison (the fast set), whose pairs are still checked and reported.
        description: one line for receipts.
    """

    name: str
    decode: dict[str, KernelSpec]
    prompt: dict[str, KernelSpec]
    claims_exact: bool
    description: str = ""
    options: dict = field(default_factory=dict)

    def fn(self, cls: str, role: str) -> Callable:
        """The callable of class ``cls`` for ``role`` (``"decode"`` or ``"prompt"``)."""
        return (self.decode if role == "decode" else self.prompt)[cls].fn

    def pairs(self) -> list[tuple[KernelSpec, KernelSpec]]:
        """(prompt kernel, decode kernel it replaces) for every class, in KERNEL_CLASSES order."""
        return [(self.prompt[c], self.decode[c]) for c in KERNEL_CLASSES]


KERNELS: dict[str, KernelSpec] = {}
KERNEL_SETS: dict[str, KernelSet] = {}


def register_kernel(spec: KernelSpec) -> KernelSpec:
    """Add ``spec`` to the registry.

    Raises:
        ValueError: unknown class or role, a duplicate name, a prompt kernel without ``replaces``, or ``replaces``
            naming no registered decode kernel of the same class.
    """
    if spec.cls not in KERNEL_CLASSES:
        raise ValueError(f"kernel {spec.name!r}: unknown class {spec.cls!r}; known: {', '.join(KERNEL_CLASSES)}")
    if spec.role not in ROLES:
        raise ValueError(f"kernel {spec.name!r}: role must be one of {ROLES}, got {spec.role!r}")
    if spec.name in KERNELS:
        raise ValueError(f"kernel name {spec.name!r} is registered twice")
    if spec.role == "prompt":
        target = KERNELS.get(spec.replaces or "")
        if target is None or target.role != "decode" or target.cls != spec.cls:
            known = sorted(k.name for k in KERNELS.values() if k.role == "decode" and k.cls == spec.cls)
            raise ValueError(f"prompt kernel {spec.name!r} replaces {spec.replaces!r}, which is no registered "
                             f"decode kernel of class {spec.cls!r}; known: {known}")
    KERNELS[spec.name] = spec
    return spec


def register_set(name: str, decode: dict[str, tuple[Callable, str]], prompt: dict[str, tuple[Callable, str]],
                 claims_exact: bool, description: str = "", options: dict | None = None) -> KernelSet:
    """Register the kernels of one set and the set itself.

    Args:
        decode, prompt: class -> (fn, doc) for every class in KERNEL_CLASSES; kernels are named
            ``"<set>.<class>.<role>"`` and each prompt kernel replaces the set's decode kernel of its class.

    Raises:
        ValueError: a duplicate set name, or a class missing from ``decode`` or ``prompt``.
    """
    if name in KERNEL_SETS:
        raise ValueError(f"kernel set {name!r} is registered twice")
    for role, table in (("decode", decode), ("prompt", prompt)):
        missing = [c for c in KERNEL_CLASSES if c not in table]
        if missing:
            raise ValueError(f"kernel set {name!r} has no {role} kernel for classes {missing}")
    dec = {c: register_kernel(KernelSpec(c, f"{name}.{c}.decode", "decode", fn, None, doc))
           for c, (fn, doc) in decode.items()}
    pro = {c: register_kernel(KernelSpec(c, f"{name}.{c}.prompt", "prompt", fn, dec[c].name, doc))
           for c, (fn, doc) in prompt.items()}
    ks = KernelSet(name, dec, pro, claims_exact, description, dict(options or {}))
    KERNEL_SETS[name] = ks
    return ks


def get_set(name: str | KernelSet) -> KernelSet:
    """Return the kernel set called ``name`` (a KernelSet passes through).

    Raises:
        ValueError: unknown set; the message lists the known ones.
    """
    if isinstance(name, KernelSet):
        return name
    try:
        return KERNEL_SETS[name]
    except KeyError:
        raise ValueError(f"unknown kernel set {name!r}; known sets: {', '.join(sorted(KERNEL_SETS))}") from None
