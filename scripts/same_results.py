"""Do two sets of section JSONs hold the same results? (Timings, provenance and environment are left out.)

    python scripts/same_results.py BASE PR

BASE and PR are folders written by ``python -m exactness sections --out DIR`` or a receipt's ``sections/`` folder. Compared: every hash-matrix run's token hash and byte verdicts; every contract pair's case and mismatch
counts and first mismatch; every FP64 row's verdict, error figures and bitwise shares; every stream row's hashes
and equalities; the bench's token hashes. Prints each difference and exits 1 when there is one, 0 when none.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

# Per section: the rows to compare (a function of the section object), the fields naming a row, and the fields
# whose values must be equal. Everything else in a row (timings, seconds, rates) is not compared.
HASH_KEY = ("prompt", "kernels", "path", "step", "offload")
HASH_VALUES = ("prompt_tokens", "prompt_sha256", "hash", "equals_oracle", "first_divergence", "oracle_margin",
               "prompt_logits_equal", "prompt_rows_differing", "first_differing_prompt_row", "max_prompt_logit_diff",
               "kv_equal", "served", "rerun_equal")
CONTRACT_KEY = ("class", "set", "dtype", "weights")
CONTRACT_VALUES = ("prompt_kernel", "decode_kernel", "cases", "mismatches", "first_mismatch", "m_ranges", "kv_lengths")
FP64_KEY = ("class", "path", "set", "dtype", "input_set")
FP64_SKIP = {"seconds"}


def _rows(section: dict, name: str) -> list[dict]:
    if name == "streams":
        data = section.get("data") or {}
        return [{"table": t, "i": i, **r} for t in ("drafted", "resumed", "concurrent")
                for i, r in enumerate(data.get(t) or [])]
    if name == "bench":   # the token hash of every timed run; the timings themselves differ run to run
        data = section.get("data") or {}
        return [{"table": t, "i": i, "j": j, "hash": run.get("hash")} for t in ("plain", "drafted", "cold", "itl")
                for i, r in enumerate(data.get(t) or []) for j, run in enumerate(r.get("runs") or [])]
    return list(section.get("rows") or []) + [{"offload_row": True, **r} for r in section.get("offload_rows") or []]


def _key_values(name: str, row: dict) -> tuple[tuple, dict]:
    if name == "hashes":
        return tuple(row.get(k) for k in HASH_KEY), {k: row.get(k) for k in HASH_VALUES}
    if name == "contract":
        return (row.get("offload_row", False), *(row.get(k) for k in CONTRACT_KEY)), \
            {k: row.get(k) for k in CONTRACT_VALUES}
    if name == "fp64":
        return tuple(row.get(k) for k in FP64_KEY), {k: v for k, v in row.items() if k not in FP64_SKIP}
    if name == "streams":
        return (row["table"], row["i"]), {k: v for k, v in row.items() if "second" not in k and not k.endswith("_s")}
    return (row["table"], row["i"], row["j"]), {"hash": row["hash"]}


def _file(folder: Path, name: str) -> Path:
    """``<name>.json`` (the sections command) or ``<notebook>.json`` (a receipt's sections/ folder)."""
    from exactness.receipt.sections import SECTIONS

    plain = folder / f"{name}.json"
    return plain if plain.is_file() else folder / f"{SECTIONS[name].notebook}.json"


def differences(base: Path, pr: Path) -> list[str]:
    """One line per difference between the sections of folders ``base`` and ``pr``."""
    out = []
    for name in ("hashes", "contract", "fp64", "streams", "bench"):
        a, b = _file(base, name), _file(pr, name)
        if not (a.is_file() and b.is_file()):
            out.append(f"{name}: present in {'only one folder' if a.is_file() or b.is_file() else 'neither'}")
            continue
        ra = dict(_key_values(name, r) for r in _rows(json.loads(a.read_text()), name))
        rb = dict(_key_values(name, r) for r in _rows(json.loads(b.read_text()), name))
        here = [f"{name} {k}: only in {'BASE' if k in ra else 'PR'}" for k in ra.keys() ^ rb.keys()]
        for k in ra.keys() & rb.keys():
            here += [f"{name} {k} {f}: {ra[k].get(f)!r} -> {rb[k].get(f)!r}"
                     for f in sorted(ra[k].keys() | rb[k].keys()) if ra[k].get(f) != rb[k].get(f)]
        print(f"{name}: {len(ra)} rows in BASE, {len(rb)} in PR, {len(here)} differences")
        out += here
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    diffs = differences(Path(sys.argv[1]), Path(sys.argv[2]))
    print("\n".join(diffs) if diffs else "no difference")
    sys.exit(1 if diffs else 0)
