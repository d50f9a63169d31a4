"""A kernel set called once per kernel on tiny inputs before a run uses it: every class's decode and prompt kernel
on the contract's random row builders (cases.make_pool, preset ``tiny``, bfloat16, two rows; attention on a bf16 and
an fp8 KV cache, as the contract calls it), so a wrong signature, a kernel that raises or one returning other shapes
or dtypes than the class's is one line naming the set, class and role, not a traceback at the first forward.

The layers that start runs call :func:`validate_sets` before anything runs: the preflight of the receipt runner and
of the command line (receipt/preflight.py) and each section's ``run_section``; params.py only imports a referenced
set and checks its tables (kernels.import_set)."""
from __future__ import annotations

import torch

from ...kernels import KERNEL_CLASSES, KernelSet, get_set
from ...kernels.imported import check_tables, one_line
from ...kernels.registry import KERNEL_CLASS_RECORDS, resolve
from ...params_check import ParamError
from .cases import make_pool

_VALIDATED: set[tuple[str, str]] = set()   # (set name, device) already called on tiny inputs in this process


def _form(out) -> str:
    """A kernel output's shapes and dtypes, e.g. ``[2, 258] float32`` (a tuple's parts joined by ``, ``)."""
    parts = out if isinstance(out, (tuple, list)) else (out,)
    return ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" if torch.is_tensor(t)
                     else type(t).__name__ for t in parts)


def validate_set(ks: KernelSet, device: str | None = None, where: str = "") -> None:
    """Call every kernel of ``ks`` once on tiny inputs of its class's shapes on ``device`` (None: CUDA when present,
    else CPU) and compare each output's shapes and dtypes with the built-in ``invariant`` kernel's on the same
    inputs (a class it lacks: with the set's own decode kernel's); once per set and device in a process.

    Raises:
        ValueError: one line naming the set (and ``where``, its reference), the class and role, and the reason: a
            class without a decode or prompt kernel, a kernel that is not callable or whose call raises (a wrong
            signature included), or an output of other shapes or dtypes.
    """
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if (ks.name, dev) in _VALIDATED:
        return
    check_tables(ks, where)
    ref = get_set("invariant")
    for cls in KERNEL_CLASSES:
        if resolve(KERNEL_CLASS_RECORDS[cls].contract_inputs) is None:
            continue
        kw = {"expert_id": 0} if ks.options.expert_id_aware and cls.startswith("expert_") else {}
        for site, kv in ((("bf16", "bf16"), ("fp8", "fp8_e4m3")) if cls == "attention" else (("", None),)):
            args = make_pool(cls, "random", torch.bfloat16, dev, site=site, kv_dtype=kv).args(
                torch.arange(2, device=dev))
            want = _form(ref.fn(cls, "decode")(*args)) if cls in ref.decode else None
            for role in ("decode", "prompt"):
                def fail(why: str) -> ValueError:
                    return ValueError(f"kernel set {ks.name!r}" + (f" ({where})" if where else "") + f", class "
                                      f"{cls!r}, {role} kernel {why} on tiny inputs (preset tiny, 2 rows"
                                      f"{f', {kv} KV cache' if kv else ''}, {dev})")
                try:
                    got = _form(ks.fn(cls, role)(*args, **kw))
                except Exception as e:  # noqa: BLE001  (the reason, in one line)
                    raise ValueError(f"{fail('fails')}: {one_line(e)}") from None
                want = want or got
                if got != want:
                    raise ValueError(f"{fail(f'returns {got}')}; the class's kernels return {want}")
    _VALIDATED.add((ks.name, dev))


def validate_sets(params) -> None:
    """Every set of a run's ``kernel_sets`` resolved (kernels.get_set), and each one named by reference
    (``package.module:ATTR``) called on tiny inputs (:func:`validate_set`) on the run's ``device`` (``"cpu"``, else
    CUDA when present). ``params``: a section's typed parameters or a dict of them; no ``kernel_sets``: nothing.

    Raises:
        ParamError: ``parameter kernel_sets: 'REF' is not allowed: <validate_set's line>``.
        ValueError: an unknown set name (kernels.get_set).
    """
    get = params.get if isinstance(params, dict) else lambda k: getattr(params, k, None)
    device = "cpu" if get("device") == "cpu" else None   # validated where the run computes (None: CUDA if any)
    for ref in get("kernel_sets") or []:
        ks = get_set(ref)   # an unknown name: refused before any work
        if ":" not in ref:
            continue
        try:
            validate_set(ks, device, ref)
        except ValueError as e:
            raise ParamError(f"parameter kernel_sets: {ref!r} is not allowed: {e}") from None
