"""Assemble docs/gpu/sections/ (the five section JSONs of the GPU receipt) from the H200 outputs kept in docs/gpu/.

    make setup && .venv/bin/python docs/gpu/assemble.py   # writes docs/gpu/sections/{env,hashes,...}.json
    .venv/bin/python -m exactness receipts --profile gpu --precomputed docs/gpu/sections --out /tmp/gpu-receipt
    cp /tmp/gpu-receipt/receipt.{md,json,html} docs/gpu/receipt/

Each section gets a ``provenance`` record (machine, commit, command, notes) that receipt.md shows in its "Where each
section was computed" table. Sources:

    device3/contract.json, device3/bench.json    session 3 (2026-11-29), commit 0db0fbb: one device call per part
                                                 (scripts/h200_receipt.sh 2, 3 fast, 3 invariant), the parts joined
                                                 here by ``python -m exactness merge`` (device3/*/ holds each part,
                                                 its env.json and its log); their provenance is the one the
                                                 ``sections`` command wrote on the device
    device3/contract_offload/contract.json       session 3, commit 3e8dd19, a fourth call: the expert classes with
                                                 offloaded weights (``offload_rows``); its resident expert rows
                                                 repeat device3/contract.json's and are checked equal, then dropped
    device/hashes.json                           session 2 (2026-11-29), tree of commit 9bbc9f3
    fp64_small_2064tok.json,
    streams_small_2048tok.json                   session 1 (2026-11-29), its working tree (not recorded exactly;
                                                 between 5d1be2c and ee1bfa4)

lib/exactness/kernels, model.py, paths.py and cache.py are identical at 5d1be2c, 9bbc9f3 and 0db0fbb, so every
section ran the same kernels. The environment record is session 3's first call (device3/env_call1.json); its ``git``
comes from EXACTNESS_GIT_SHA (the device tool sends the session's first ``.git``, so git there named fdab6c6, dirty,
for a tree that was exactly 0db0fbb; the record keeps what git said).
Earlier outputs kept for the record: device/bench.json (session 2's bench at 64 generated tokens) and
contract_cuda_tiny_shapes.json (session 1's quick sweep at the tiny preset's shapes, bf16).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "lib"))

H200 = "NVIDIA H200 (sm_90), torch 2.11.0+cu130, Triton 3.6.0, device tool"
SESSION2 = "9bbc9f3dedd88e5cd46174d8e4be949ca08b42ac"
SESSION1 = "session-1 working tree (between 5d1be2c and ee1bfa4; not recorded exactly)"
PREFIX = "EXACTNESS_GIT_SHA=9bbc9f3… PYTHONPATH=/tmp/site:lib python3 -m exactness "   # session 2 (this tree)
PREFIX1 = "PYTHONPATH=/tmp/site:lib python3 -m exactness "                           # session 1


def load(name: str) -> dict:
    return json.loads((HERE / name).read_text(encoding="utf-8"))


def with_provenance(section: dict, computed_on: str, commit: str, command: str, notes: str) -> dict:
    return {**section, "provenance": {"computed_on": computed_on, "commit": commit, "command": command,
                                      "notes": notes}}


def noted(section: dict, note: str) -> dict:
    """``section`` with ``note`` put before its provenance notes (the record the device's ``sections`` wrote)."""
    prov = dict(section["provenance"])
    prov["notes"] = f"{note}; {prov['notes']}"
    return {**section, "provenance": prov}


def contract_with_offload() -> dict:
    """device3/contract.json joined with the offload rows of the fourth call. That call's resident rows (the same
    expert pairs, same sweep and inputs) must agree with the earlier call's in cases and mismatches."""
    from exactness.analysis.contract import merge_sections
    first, offload = load("device3/contract.json"), load("device3/contract_offload/contract.json")
    have = {(r["class"], r["set"], r["dtype"]): (r["cases"], r["mismatches"]) for r in first["rows"]}
    for r in offload["rows"]:
        again = (r["cases"], r["mismatches"])
        if have[(r["class"], r["set"], r["dtype"])] != again:
            raise SystemExit(f"the two calls disagree on {r['class']} {r['set']} {r['dtype']}: "
                             f"{have[(r['class'], r['set'], r['dtype'])]} vs {again}")
    return merge_sections([first, {**offload, "rows": []}])


def main() -> int:
    out = HERE / "sections"
    out.mkdir(exist_ok=True)
    env = load("device3/env_call1.json")
    sections = {
        "env": env,
        "hashes": with_provenance(
            load("device/hashes.json"), H200 + ", 2026-11-29T17:51Z", SESSION2,
            "scripts/h200_receipt.sh 1 (" + PREFIX + "sections --profile gpu --sections hashes,streams,fp64)",
            "full gpu-profile hash matrix: prompts cut to hash_max_tokens=2560, 64 generated tokens, offload on "
            "and off (batched/deep); 440.7 s. streams and fp64 of that call were cut by its 10-minute limit. Computed "
            "before the rerun control (hash_rerun) existed: no rerun column"),
        "bench": noted(load("device3/bench.json"),
                       "scripts/h200_receipt.sh 3 fast, then 3 invariant (one device call each, 192 generated "
                       "tokens), joined by python -m exactness merge; seconds per part"),
        "contract": noted(contract_with_offload(),
                          "scripts/h200_receipt.sh 2 (one process per kernel set in one device call), then the "
                          "expert classes with offloaded weights (a fourth call, --param 'kernel_sets=[invariant,"
                          "fast]' --param 'contract_classes=[expert_gate_up,expert_down]'), joined by "
                          "docs/gpu/assemble.py with merge_sections; full sweep for invariant, quick for the fast "
                          "control; seconds per part"),
        "fp64": with_provenance(
            load("fp64_small_2064tok.json"), H200 + ", 2026-11-29 (session 1)", SESSION1,
            PREFIX1 + "fp64 --profile gpu --param fp64_tokens=2064", "small preset, code prompt cut to 2064 tokens"),
        "streams": with_provenance(
            load("streams_small_2048tok.json"), H200 + ", 2026-11-29 (session 1)", SESSION1,
            PREFIX1 + "streams --profile gpu --param prompt_max_tokens=2048 --param gen_tokens=32",
            "prompts cut to 2048 tokens, 32 generated, 256-token stream prompts (the data's settings; the "
            "command is what session 1 recorded, whose profile then had 2048-token stream prompts)"),
    }
    for name, obj in sections.items():
        (out / f"{name}.json").write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {', '.join(sections)} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
