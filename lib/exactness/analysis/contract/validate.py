"""A kernel set called once per kernel on tiny inputs before a run uses it: every class's decode and prompt kernel
on the contract's random row builders (cases.make_pool, preset ``tiny``, bfloat16, two rows; attention on a bf16 and
an fp8 KV cache, as the contract calls it), so a wrong signature or a kernel that raises is one line naming the set,
class and role, not a traceback at the first forward.

The layers that start runs call :func:`validate_sets` before anything runs: the preflight of the receipt runner and
of the command line (receipt/preflight.py) and each section's ``run_section``; params.py only imports a referenced
set and checks its tables (kernels.import_set)."""
from __future__ import annotations

import torch

from ...kernels import KERNEL_CLASSES, KernelSet, get_set
from ...kernels.imported import check_tables, one_line
from ...kernels.registry import KERNEL_CLASS_RECORDS, resolve
from ...params import ParamError
from .cases import make_pool

_VALIDATED: set[tuple[str, str]] = set()   # (set name, device) already called on tiny inputs in this process


def validate_set(ks: KernelSet, device: str | None = None, where: str = "") -> None:
    """Call every kernel of ``ks`` once on tiny inputs of its class's shapes on ``device`` (None: CUDA when present,
    else CPU); once per set and device in a process.

    Raises:
        ValueError: one line naming the set (and ``where``, its reference), the class and role, and the reason: a
            class without a decode or prompt kernel, a kernel that is not callable or whose call raises (a wrong
            signature included).
    """
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if (ks.name, dev) in _VALIDATED:
        return
    check_tables(ks, where)
    for cls in KERNEL_CLASSES:
        if resolve(KERNEL_CLASS_RECORDS[cls].contract_inputs) is None:
            continue
        kw = {"expert_id": 0} if ks.options.expert_id_aware and cls.startswith("expert_") else {}
        for site, kv in ((("bf16", "bf16"), ("fp8", "fp8_e4m3")) if cls == "attention" else (("", None),)):
            pool = make_pool(cls, "random", torch.bfloat16, dev, site=site, kv_dtype=kv)
            what = f", {kv} KV cache" if kv else ""
            for role in ("decode", "prompt"):
                try:
                    ks.fn(cls, role)(*pool.args(torch.arange(2, device=dev)), **kw)
                except Exception as e:  # noqa: BLE001  (the reason, in one line)
                    raise ValueError(f"kernel set {ks.name!r}" + (f" ({where})" if where else "") + f", class "
                                     f"{cls!r}, {role} kernel fails on tiny inputs (preset tiny, 2 rows{what}, "
                                     f"{dev}): {one_line(e)}") from None
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
