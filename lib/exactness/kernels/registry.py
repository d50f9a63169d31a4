"""Kernel specs, kernel sets and lookup.

Every kernel belongs to a *kernel class* (a KernelClass record in KERNEL_CLASS_RECORDS: its row arguments, its
reduction, the contract's input builder and the FP64 evaluator; the engine's and analyses' per-class tables derive
from it) and has a role: ``decode`` (one row per stream per step; serial decode through these kernels is the
oracle) or ``prompt`` (many prompt rows at once). A prompt kernel declares the decode kernel it ``replaces``: it
claims to produce that kernel's bytes for every row, whatever the chunk or segment length. The contract checker
(analysis/contract/check.py) tests each claim. Adding a class: its kernel module, one ``register_class`` (or built-in
record), the kernels in the sets, and its call site in model.py.

A *kernel set* maps every class to one decode and one prompt kernel. Sets are registered by name and passed to the
paths as an argument; adding a set is one ``register_set`` call. A set defined outside the package is named by
reference, ``package.module:ATTR`` (imported.py: labelled with its name, validated, its provenance recorded).
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Callable

from ..lookup import lookup

_PACKAGE = __package__.rsplit(".", 1)[0]   # "exactness": record references are relative to it


@dataclass(frozen=True)
class KernelClass:
    """Everything the engine and the analyses key by kernel class, in one record.

    Attributes:
        name: class id (``"dense"``); doc: what the class computes, with shapes.
        row_args: indices of the call arguments that carry one entry per row (leading dim M); the other arguments
            are fixed for the call (weights, eps, the KV cache). attention: (0, 3, 4) = q, slots, positions.
        reduction: the reduction axis and its length (``"K: in features"``), for readers of the receipts.
        contract_inputs: the contract's random-input builder (analysis/contract/inputs.py documents its
            signature), or ``"module:attr"`` naming it under the package (imported on first use: kernels/ does
            not import analysis/); None = the contract cannot feed the class and reports it uncovered.
        fp64: the FP64 evaluator ``(samples, params, kv) -> fp64_ref.Eval`` or a ``"module:attr"`` naming it;
            None = no FP64 row.
        fp64_cert: how fp64/cert.py certifies its reference: ``"sum"`` (exact fp64 products, fsum) or
            ``"mpmath"`` (two precisions); None = not certified.
        deep_tiles: the deep plan calls it on fixed row tiles (model.Ops), so it has a ``deep`` synthetic path.
        args, outs: the names of the call's positional arguments and of its outputs, as a tensor dump names them
            (dumps/format.py); () = ``arg0``, ``arg1``, ...
        rows: how a call's rows map to the forward's rows, for the recorders of kernel calls (sites.py):
            ``forward`` (in order), ``tiles`` (consecutive calls of a site take consecutive tiles), ``routed`` (a
            routed expert's rows: those that picked it in the router call) or ``previous`` (the call before's).
        gemm: each output element is one dot product over the reduction: its FP64 bound is γ_K (the receipt's η
            against K).
        quantizable: a weights format (kernels/quant.WEIGHT_FORMATS) replaces its weights.
        offloadable: expert offload moves its weights (offload.py).
    """

    name: str
    doc: str
    row_args: tuple[int, ...] = (0,)
    reduction: str = ""
    contract_inputs: Callable | str | None = None
    fp64: Callable | str | None = None
    fp64_cert: str | None = None
    deep_tiles: bool = False
    args: tuple[str, ...] = ()
    outs: tuple[str, ...] = ("y",)
    rows: str = "forward"
    gemm: bool = False
    quantizable: bool = False
    offloadable: bool = False

    def arrange(self, rows: tuple, fixed: tuple) -> tuple:
        """The call's positional arguments from its per-row arguments (``row_args`` order) and the fixed ones."""
        rows, fixed, n = list(rows), list(fixed), len(self.row_args) + len(fixed)
        return tuple(rows.pop(0) if i in self.row_args else fixed.pop(0) for i in range(n))


def _class(name, doc, row_args=(0,), reduction="", fp64: str | None = None, **kw) -> KernelClass:
    """A built-in record: its contract builder is contract/inputs.<name>, its evaluator fp64/ref.<fp64>."""
    return KernelClass(name, doc, tuple(row_args), reduction, f"analysis.contract.inputs:{name}",
                       f"analysis.fp64.ref:{fp64}" if fp64 else None, **kw)


# Registration order is the class order everywhere (pairs, contract rows and seeds, FP64 rows): keep it stable.
KERNEL_CLASS_RECORDS: dict[str, KernelClass] = {r.name: r for r in (
    _class("dense", "q/k/v/o projections and the shared expert: y[M,N] = x[M,K] @ w[N,K]^T",
           reduction="K: in features", fp64="eval_dense", fp64_cert="sum", deep_tiles=True, args=("x", "w"),
           rows="tiles", gemm=True, quantizable=True),
    _class("router", "router logits + softmax + top-k selection + renormalised weights", reduction="H: hidden",
           fp64="eval_router", fp64_cert="sum", args=("x", "w", "top_k", "norm"), outs=("weights", "idx", "logits"),
           gemm=True),
    _class("expert_gate_up", "SiLU(x @ w_gate^T) * (x @ w_up^T) for one expert's rows", reduction="H: hidden",
           fp64="eval_expert_gate_up", fp64_cert="mpmath", deep_tiles=True, args=("x", "w_gate", "w_up"),
           rows="routed", quantizable=True, offloadable=True),
    _class("expert_down", "h @ w_down^T for one expert's rows", reduction="I: expert intermediate",
           fp64="eval_expert_down", fp64_cert="sum", deep_tiles=True, args=("x", "w_down"),
           rows="previous", gemm=True, quantizable=True, offloadable=True),
    _class("moe_combine", "sum over the k selected experts (and the shared expert) with the routing weights",
           (0, 1, 2), "k + 1: routed slots and the shared expert", fp64="eval_moe_combine", fp64_cert="sum",
           args=("y", "g", "shared")),
    _class("attention", "scores and values: softmax(q k^T / sqrt(D)) v over the cached keys, causal by position",
           (0, 3, 4), "T: cached keys (and D in each score)", fp64="eval_attention", fp64_cert="mpmath",
           args=("q", "k_cache", "v_cache", "slots", "positions")),
    _class("rmsnorm", "RMSNorm (hidden and per-head q/k norms)", reduction="last dim: H or D",
           fp64="eval_rmsnorm", fp64_cert="mpmath", args=("x", "w", "eps")),
    _class("rope", "rotary position embedding", (0, 1), "none (2 products per element)", fp64="eval_rope",
           fp64_cert="mpmath", args=("x", "positions", "theta")),
    _class("residual", "residual add", (0, 1), "none (a + b)", fp64="eval_residual", fp64_cert="sum",
           args=("a", "b")),
    _class("lm_head", "final projection to vocabulary logits", reduction="H: hidden", fp64="eval_lm_head",
           fp64_cert="sum", args=("x", "w"), gemm=True),
    _class("argmax", "greedy sampling", reduction="V: vocabulary (first maximum)", args=("logits",)),
)}


class ClassNames(Sequence):
    """The names of the registered classes whose record passes ``keep`` (all when None), in registration order.

    A live view: it reads KERNEL_CLASS_RECORDS on every use, so tables derived from it (contract_cases.ADAPTED,
    fp64.CLASSES, ...) include a class registered later and lose it when it is removed.
    """

    def __init__(self, keep: Callable[[KernelClass], bool] | None = None):
        self._keep = keep

    def _names(self) -> list[str]:
        return [n for n, r in KERNEL_CLASS_RECORDS.items() if self._keep is None or self._keep(r)]

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self):
        return iter(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __repr__(self) -> str:
        return f"ClassNames({self._names()})"


KERNEL_CLASSES = ClassNames()
QUANT_CLASSES = ClassNames(lambda r: r.quantizable)   # the classes whose weights a weights format replaces


def register_class(record: KernelClass) -> KernelClass:
    """Add a kernel class (after the built-in ones). Sets registered before it have no kernel of it.

    Raises:
        ValueError: a class of that name is registered already.
    """
    if record.name in KERNEL_CLASS_RECORDS:
        raise ValueError(f"kernel class {record.name!r} is registered twice")
    KERNEL_CLASS_RECORDS[record.name] = record
    return record


def class_record(name: str) -> KernelClass:
    """The record of class ``name``.

    Raises:
        ValueError: unknown class; the message lists the known ones.
    """
    return lookup(KERNEL_CLASS_RECORDS, name, "kernel class", KERNEL_CLASSES)


def resolve(ref: Callable | str | None) -> Callable | None:
    """A record's builder or evaluator: a callable (or None) as is; ``"module:attr"`` imported from the package.

    Raises:
        ImportError, AttributeError: the reference names no module or attribute.
    """
    if ref is None or callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(f"{_PACKAGE}.{module}"), attr)


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
class KernelOptions(Mapping):
    """How the engine calls a set's kernels beyond one call per class and row block (model.py, graphs.py).

    Attributes:
        grouped_experts: None, or ``fn(h [M, H], idx [M, k] int64, w_gate [E, I, H], w_up [E, I, H],
            w_down [E, H, I]) -> y [M, k, H] | None`` computing every routed expert of a layer at once with the
            bytes of the set's own expert kernels (None from it: not served, the experts run one by one); an
            optional attribute ``serves(h, w_gate, w_up, w_down) -> bool`` is asked before an offloaded layer is
            staged whole for it. Dropped on import from a set whose expert kernels are not the ones it stands in
            for (imported.drop_bypassing_options).
        tiles_in_kernels: True, or a predicate of the call's rows ``x -> bool``: on the deep plan the dense and
            expert kernels get whole calls, no host row tiles (their tiles are fixed inside). False: host tiles.
        expert_id_aware: the expert kernels take ``expert_id=`` (-1: the shared expert); graphs do not serve it.
        qk_norm_rope: None, or ``fn(q [M, Hq, D], k [M, Hk, D], wq [D], wk [D], eps, positions [M], theta) ->
            (q, k) | None``: the per-head rmsnorm then rope of a layer's queries and keys with the bytes of the set's
            own kernels of those classes, in fewer launches (None from it: not served, the kernels run). One with the
            attribute ``stores_kv = True`` also takes ``store=(k_cache, v_cache, slots, v)`` and then writes the keys
            it returns and v to the layer's caches at (slots, positions) in the same launch, the bytes the engine's
            cache store writes (None from it: nothing written).
        dense_group: None, or ``fn(x [M, K], ws) -> tuple of [M, N_i] | None``: the set's dense kernel on each
            weight of one input, same bytes, in fewer launches (model.attention_block: keys and values, queries).
        residual_norm: None, or ``fn(a [..., H], b, w [H], eps) -> (a + b, rmsnorm(a + b, w, eps)) | None``: the
            set's residual then rmsnorm, same bytes, in fewer launches (each block's residual and the next norm).
        combine_residual_norm: None, or ``fn(y [M, k, H], weights [M, k], shared [M, H] | None, a [M, H], w [H], eps)
            -> (a + c, rmsnorm(a + c, w, eps)) | None``, c the set's moe_combine of y: the set's moe_combine, residual
            then rmsnorm, same bytes, in fewer launches (the MoE block's end).
        dense_residual_norm: None, or ``fn(x [M, K], w [N, K], a [M, N], wn [N], eps) -> (a + d, rmsnorm(a + d, wn,
            eps)) | None``, d the set's dense of x by w: the set's dense, residual then rmsnorm, same bytes, in fewer
            launches (the attention block's end).
        Each of the five above may name the kernels it stands in for in an attribute ``stands_for`` ((class,
        kernel callable) pairs): model.Ops then uses it only for a set whose kernels of those classes are those
        callables. "Same bytes" is the invariant set's property; a set that claims no bytes may fuse differently
        (the fast set's compiled options round a fused chain once), so a forward whose kernel calls are tapped,
        which runs each class's kernel, and a graph made while taps are on, which replays such forwards, run
        without the five (graphs.GraphForward). grouped_experts has no such check in the engine: a set imported by
        reference loses it (and the five) where its kernels of those classes are not the built-in set's
        (imported.drop_bypassing_options).

    A Mapping of the options that are set (not their defaults), so a set can be built from another's:
    ``KernelOptions.of({**base.options, "expert_id_aware": True})``.
    """

    grouped_experts: Callable | None = None
    tiles_in_kernels: bool | Callable = False
    expert_id_aware: bool = False
    qk_norm_rope: Callable | None = None
    dense_group: Callable | None = None
    residual_norm: Callable | None = None
    combine_residual_norm: Callable | None = None
    dense_residual_norm: Callable | None = None

    @classmethod
    def of(cls, options: "KernelOptions | Mapping | None") -> "KernelOptions":
        """KernelOptions from a mapping of option names (or None: the defaults; a KernelOptions passes through).

        Raises:
            ValueError: an unknown option name (the message lists the known ones).
        """
        if isinstance(options, KernelOptions):
            return options
        options = dict(options or {})
        known = [f.name for f in fields(cls)]
        bad = sorted(set(options) - set(known))
        if bad:
            raise ValueError(f"unknown kernel set options {bad}; known: {', '.join(known)}")
        return cls(**options)

    def without(self, *names: str) -> "KernelOptions":
        """These options back at their defaults."""
        return replace(self, **{n: next(f.default for f in fields(self) if f.name == n) for n in names})

    def _set(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not f.default]

    def __getitem__(self, name: str):
        if name not in self._set():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self):
        return iter(self._set())

    def __len__(self) -> int:
        return len(self._set())


@dataclass(frozen=True)
class KernelSet:
    """A named pair of kernels (decode, prompt) per kernel class.

    Attributes:
        name: set name (``"fast"``, ``"invariant"``, ...).
        decode, prompt: class -> KernelSpec.
        claims_exact: True when every prompt kernel claims its decode kernel's bytes for every row (the invariant
            set); False for sets kept for comparison (the fast set), whose pairs are still checked and reported.
        description: one line for receipts.
        options: KernelOptions (a mapping of option names is converted; an unknown name is a ValueError).
    """

    name: str
    decode: dict[str, KernelSpec]
    prompt: dict[str, KernelSpec]
    claims_exact: bool
    description: str = ""
    options: KernelOptions = field(default_factory=KernelOptions)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", KernelOptions.of(self.options))

    def fn(self, cls: str, role: str) -> Callable:
        """The callable of class ``cls`` for ``role`` (``"decode"`` or ``"prompt"``)."""
        return (self.decode if role == "decode" else self.prompt)[cls].fn

    def pairs(self) -> list[tuple[KernelSpec, KernelSpec]]:
        """(prompt kernel, decode kernel it replaces) for every class of the set, in KERNEL_CLASSES order (a class
        registered after the set has no pair in it)."""
        return [(self.prompt[c], self.decode[c]) for c in KERNEL_CLASSES if c in self.prompt]


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
                 claims_exact: bool, description: str = "", options: KernelOptions | dict | None = None
                 ) -> KernelSet:
    """Register the kernels of one set and the set itself.

    Args:
        decode, prompt: class -> (fn, doc) for every class in KERNEL_CLASSES; kernels are named
            ``"<set>.<class>.<role>"`` and each prompt kernel replaces the set's decode kernel of its class.

    Raises:
        ValueError: a duplicate set name, a class missing from ``decode`` or ``prompt``, an unknown option.
    """
    if name in KERNEL_SETS:
        raise ValueError(f"kernel set {name!r} is registered twice")
    options = KernelOptions.of(options)
    for role, table in (("decode", decode), ("prompt", prompt)):
        missing = [c for c in KERNEL_CLASSES if c not in table]
        if missing:
            raise ValueError(f"kernel set {name!r} has no {role} kernel for classes {missing}")
    dec = {c: register_kernel(KernelSpec(c, f"{name}.{c}.decode", "decode", fn, None, doc))
           for c, (fn, doc) in decode.items()}
    pro = {c: register_kernel(KernelSpec(c, f"{name}.{c}.prompt", "prompt", fn, dec[c].name, doc))
           for c, (fn, doc) in prompt.items()}
    ks = KernelSet(name, dec, pro, claims_exact, description, options)
    KERNEL_SETS[name] = ks
    return ks


def get_set(name: str | KernelSet) -> KernelSet:
    """Return the kernel set called ``name`` (a KernelSet passes through).

    Raises:
        ValueError: unknown set; the message lists the known ones.
    """
    return name if isinstance(name, KernelSet) else lookup(KERNEL_SETS, name, "kernel set", known_as="known sets")
