"""A run's parameters: ``key=value`` overrides parsed as YAML, the names each notebook declares, and the checks made
before anything runs (types against the profile's values, the common fields, each section's typed parameters,
preflight). The receipt runner (runner.py) and the command line (cli.py) use them."""
from __future__ import annotations

from pathlib import Path

import yaml

from ..params_check import ParamError, check_common
from .preflight import check_run
from .runfolder import ReceiptError
from .sections import SECTIONS, section_of

OUT_JSON = "out_json"  # the parameter through which the runner tells a notebook where to write its section
PARAMS = "params"      # a section notebook's one mapping of parameters (sections.notebook_params types it)
# Notebook parameters the runner sets itself (--profile, --precomputed, the section file), never a user's override.
RUNNER_SET = {OUT_JSON, "precomputed_json", "profile", PARAMS}


def parse_overrides(items: list[str] | None) -> dict:
    """Parse ``["key=value", ...]``; each value is read with ``yaml.safe_load`` (``steps=[64,100]`` is a list).

    Raises:
        ReceiptError: an item without ``=`` or whose key is not a Python identifier.
    """
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ReceiptError(f"bad parameter {item!r}: expected key=value with key a Python identifier")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ReceiptError(f"bad value in parameter {item!r}: not valid YAML ({first}); no spaces inside a value, "
                               "e.g. steps=[64,100], gen_tokens=32, prompts=[code]") from None
    return out


def declared_parameters(notebooks_dir: Path, notebooks: list[str]) -> dict[str, set[str]]:
    """Parameter names each notebook's ``parameters`` cell declares (via ``papermill.inspect_notebook``).

    Raises:
        ReceiptError: a notebook file is missing, cannot be inspected (no kernelspec metadata), does not
            declare ``out_json``, or is a section's notebook without its ``params`` mapping.
    """
    import papermill

    declared = {}
    for nb in notebooks:
        path = Path(notebooks_dir) / f"{nb}.ipynb"
        if not path.is_file():
            raise ReceiptError(f"notebook {nb!r} not found: {path} does not exist")
        try:
            declared[nb] = set(papermill.inspect_notebook(str(path)))
        except ValueError as e:  # e.g. no kernelspec in the notebook's metadata
            raise ReceiptError(f"notebook {nb!r} cannot be inspected: {e}") from None
        needed = (OUT_JSON, PARAMS) if section_of(nb) in SECTIONS else (OUT_JSON,)
        missing = [k for k in needed if k not in declared[nb]]
        if missing:
            raise ReceiptError(f"notebook {nb!r} has no {missing[0]!r} in its parameters cell; "
                               f"it declares: {', '.join(sorted(declared[nb])) or '(nothing)'}")
    return declared


def _kind(v) -> str | None:
    """Coarse type of a parameter value for the override check (None for null: anything may replace it)."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "number"
    return {str: "str", list: "list", tuple: "list", dict: "dict"}.get(type(v), type(v).__name__)


def check_override_types(base: dict, overrides: dict) -> None:
    """Refuse an override whose coarse type differs from the profile's value (an int for an int, a list for a
    list; a null profile value accepts anything).

    Raises:
        ReceiptError: naming the parameter, the value given and the type expected.
    """
    for key, value in overrides.items():
        want, got = _kind(base.get(key)), _kind(value)
        if want and got != want and not (want == "number" and got == "int"):
            raise ReceiptError(f"parameter {key}={value!r} is of type {got or 'null'}; the profile's value "
                               f"{base[key]!r} is of type {want}, so type {want} is expected")


def check_common_values(params: dict) -> None:
    """Refuse, before anything runs, the values every section would refuse later (params.check_common: an unknown
    preset unless a checkpoint is given, dtype, prompt or kernel set; a device other than cpu / cuda / cuda:N;
    steps, gen_tokens, deep_threshold, prompt_max_tokens that are not positive ints).

    Raises:
        ReceiptError: naming the parameter, the bad value and what is allowed.
    """
    try:
        check_common(params)
    except ParamError as e:
        raise ReceiptError(str(e)) from None


def check_section_values(params: dict, sections: list[str]) -> None:
    """Build each section's typed parameters (sections.Section.params_class) from ``params`` (the profile's and the
    overrides), so that a value a section refuses is refused before any section runs.

    Raises:
        ReceiptError: the section and the refusal (names the value and what is allowed).
    """
    for name in sections:
        cls = SECTIONS[name].params_class
        try:
            cls.from_dict({k: v for k, v in params.items() if k in cls.names()})
        except ValueError as e:
            raise ReceiptError(f"{name}: {e}") from None


def takes_mapping(nb: str, names: set[str]) -> bool:
    """Whether notebook ``nb`` (declaring ``names``) is a section's notebook taking one ``params`` mapping; a
    notebook outside the table (a test fixture) declares each parameter it reads."""
    return section_of(nb) in SECTIONS and PARAMS in names


def accepted_names(declared: dict[str, set[str]]) -> set[str]:
    """The override names a run of these notebooks accepts: each section's parameter names (its params class's
    fields) for a notebook taking ``params``, the declared names for any other."""
    out: set[str] = set()
    for nb, names in declared.items():
        out |= SECTIONS[section_of(nb)].params_class.names() if takes_mapping(nb, names) else names
    return out - RUNNER_SET


def plan_parameters(base: dict, overrides: dict, declared: dict[str, set[str]]) -> dict[str, dict]:
    """Papermill parameters per notebook: ``base`` (the profile's) updated by ``overrides``; a section's notebook
    gets them as its one ``params`` mapping, cut to its section's names (the notebook types them with
    sections.notebook_params, whose params class fills the defaults, as the command line does), any other
    notebook each name it declares.

    Raises:
        ReceiptError: an override names a parameter no notebook of the run takes (the message lists the allowed
            names), or one the runner sets.
    """
    allowed = accepted_names(declared)
    for key in overrides:
        if key in RUNNER_SET or key not in allowed:
            raise ReceiptError(f"unknown parameter {key!r} for notebooks {', '.join(declared)}; "
                               f"allowed: {', '.join(sorted(allowed))}")
    check_override_types(base, overrides)
    merged = {**base, **overrides}
    check_common_values(merged)
    check_section_values(merged, [section_of(nb) for nb in declared if section_of(nb) in SECTIONS])
    check_run(merged, [section_of(nb) for nb in declared])
    out = {}
    for nb, names in declared.items():
        if takes_mapping(nb, names):
            mine = SECTIONS[section_of(nb)].params_class.names()
            out[nb] = {PARAMS: {k: _literal(v) for k, v in merged.items() if k in mine}}
        else:
            out[nb] = {k: v for k, v in merged.items() if k in names}
    return out


def _literal(v):
    """A value as papermill passes it: tuples become lists."""
    return [_literal(x) for x in v] if isinstance(v, (list, tuple)) else v
