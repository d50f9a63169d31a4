"""The checks every section's parameters share: one ParamError line naming the bad value and what is allowed, for
the profile's fields (preset, device, dtype, weights, prompts, kernel sets, offload) and the small value checks
the section classes (params.py) build on. Model modules are imported when a check runs, so importing this module
stays cheap."""
from __future__ import annotations

import os
import re

class ParamError(ValueError):
    """A parameter value that no section can run with."""


def positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def at_least(name: str, v, minimum: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ParamError(f"{name} must be an int >= {minimum}, got {v!r}")


def check_bool(name: str, v) -> None:
    if not isinstance(v, bool):
        raise ParamError(f"{name} must be true or false, got {v!r}")


def offload_weights(name: str, offload: bool, weights: str) -> None:
    """Offloaded experts (offload.ExpertStore) are plain tensors: refuse them with quantized weights."""
    if offload and weights != "bf16":
        raise ParamError(f"{name} with weights={weights!r} is not allowed: offloaded experts hold plain tensors; "
                         f"allowed: weights='bf16' with {name}, or {name} off")


def check_common(values: dict) -> None:
    """Check the common fields present in ``values``: a known preset (unless a checkpoint is given), dtype, prompt
    and kernel set; a device cpu / cuda / cuda:N; steps a non-empty list of positive ints; gen_tokens and
    deep_threshold positive ints; prompt_max_tokens null or a positive int; prompts built-in names and prompt files
    (_check_prompts; relative file paths are made absolute in ``values``); weights one of
    kernels.quant.WEIGHT_FORMATS and kv_dtype one of cache.KV_DTYPES. Absent names are not checked (a caller may
    hold only some of them).

    Raises:
        ParamError: ``parameter <name>=<value> is not allowed; allowed: <what is>``.
    """
    from .cache import KV_DTYPES
    from .config import PRESETS
    from .kernels import KERNEL_SETS
    from .kernels.quant import WEIGHT_FORMATS
    from .prompts import PROMPTS

    def bad(key, allowed):
        raise ParamError(f"parameter {key}={values[key]!r} is not allowed; allowed: {allowed}")
    if values.get("preset") is not None and not values.get("checkpoint") and values["preset"] not in PRESETS:
        _check_user_preset(values["preset"], PRESETS, bad)
    if values.get("dtype") is not None and values["dtype"] not in ("bfloat16", "float32"):
        bad("dtype", "bfloat16, float32")
    if values.get("device") is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", str(values["device"])):
        bad("device", "cpu, cuda, cuda:N")
    if values.get("prompts") is not None:
        _check_prompts(values, PROMPTS, bad)
    _absolute_engines(values)
    _check_kernel_sets(values, KERNEL_SETS, bad)
    if values.get("steps") is not None and (not isinstance(values["steps"], (list, tuple)) or not values["steps"]
                                            or not all(positive_int(v) for v in values["steps"])):
        bad("steps", "a non-empty list of positive ints (tokens per prefill chunk)")
    for key in ("gen_tokens", "deep_threshold"):
        if values.get(key) is not None and not positive_int(values[key]):
            bad(key, "a positive int")
    if values.get("prompt_max_tokens") is not None and not positive_int(values["prompt_max_tokens"]):
        bad("prompt_max_tokens", "null (the full prompt) or a positive int (tokens)")
    if values.get("weights") is not None and values["weights"] not in WEIGHT_FORMATS:
        bad("weights", ", ".join(WEIGHT_FORMATS))
    if values.get("kv_dtype") is not None and values["kv_dtype"] not in KV_DTYPES:
        bad("kv_dtype", ", ".join(KV_DTYPES))


def _check_user_preset(ref, known, bad) -> None:
    """A preset that is not a built-in name: a ``package.module:ATTR`` reference that resolves (config.import_preset
    imports it and registers it under its name)."""
    from .config import PRESET_REFERENCE, import_preset

    if not isinstance(ref, str) or ":" not in ref:
        bad("preset", f"{', '.join(sorted(known))}, or {PRESET_REFERENCE}")
    try:
        import_preset(ref)
    except ValueError as e:
        raise ParamError(f"parameter preset={ref!r} is not allowed: {e}") from None


def _absolute_engines(values: dict) -> None:
    """Engine specs with a relative path (a YAML engine file, a model folder or GGUF target) made absolute in
    ``values``, from the caller's folder (notebooks run in their own folder)."""
    specs = values.get("engine")
    if not isinstance(specs, (list, tuple)):
        return
    out = []
    for spec in specs:
        kind, sep, target = spec.partition(":") if isinstance(spec, str) else ("", "", "")
        if isinstance(spec, str) and spec.endswith((".yaml", ".yml")) and os.path.isfile(spec):
            spec = os.path.abspath(spec)
        elif sep and kind in ("reference", "transformers", "llamacpp") and target and os.path.exists(target):
            spec = f"{kind}:{os.path.abspath(target)}"
        out.append(spec)
    if out != list(specs):
        values["engine"] = out


def _check_prompts(values: dict, known, bad) -> None:
    """prompts: a non-empty list of built-in names and .txt/.jsonl prompt files, every file readable and well formed
    and every name unique (prompt_files.resolve). File paths are made absolute in ``values`` (notebooks run in
    their own folder)."""
    from .prompt_files import PromptFileError, absolute_entries, resolve

    entries = values["prompts"]
    if not isinstance(entries, (list, tuple)) or not entries or not all(isinstance(v, str) for v in entries):
        bad("prompts", f"a non-empty list of built-in prompts ({', '.join(known)}) and .txt/.jsonl prompt files")
    try:
        resolve(entries)
    except PromptFileError as e:
        raise ParamError(f"parameter prompts: {e}") from None
    if any(e != a for e, a in zip(entries, absolute_entries(entries))):
        values["prompts"] = absolute_entries(entries)


def _check_kernel_sets(values: dict, known, bad) -> None:
    """kernel_sets: a non-empty list of registered set names or ``package.module:ATTR`` references that resolve
    (kernels.import_set imports them and checks their tables: a KernelSet or a function returning one, a decode and
    a prompt kernel per class), each set once. Calling each kernel on tiny inputs is the run's check, made where
    runs start (analysis.contract.validate.validate_sets)."""
    sets = values.get("kernel_sets")
    if sets is None:
        return
    allowed = (f"a non-empty list drawn from {', '.join(known)}, or package.module:ATTR references to a KernelSet "
               "or a function returning one")
    if not isinstance(sets, (list, tuple)) or not sets or not all(isinstance(v, str) for v in sets):
        bad("kernel_sets", allowed)
    from .kernels import import_set, set_names
    for v in (v for v in sets if ":" in v):
        try:
            import_set(v)
        except ValueError as e:
            raise ParamError(f"parameter kernel_sets: {v!r} is not allowed: {e}") from None
    if any(v not in known and ":" not in v for v in sets):
        bad("kernel_sets", allowed)
    try:
        set_names(sets)
    except ValueError as e:
        raise ParamError(f"parameter kernel_sets: {e}") from None
