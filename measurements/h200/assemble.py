"""Assemble measurements/h200/sections/ (the five section JSONs of the GPU receipt) from the H200 outputs kept in
measurements/h200/.

    make setup && .venv/bin/python measurements/h200/assemble.py   # writes measurements/h200/sections/*.json
    .venv/bin/python -m exactness receipts --profile gpu --precomputed measurements/h200/sections --out /tmp/gpu-receipt
    cp /tmp/gpu-receipt/receipt.{md,json,html} measurements/h200/receipt/

Each section gets a ``provenance`` record (machine, commit, command, notes) that receipt.md shows in its "Where each
section was computed" table. Sources (all from one H200 on 2026-11-29; measurements/h200/README.md names the three
runs):

    device3/contract.json, device3/bench.json    the 0db0fbb run: one invocation per part (scripts/h200_receipt.sh
                                                 2, 3 fast, 3 invariant), the parts joined by ``python -m exactness
                                                 merge`` (device3/*/ holds each part, its env.json and its log);
                                                 their provenance is the one the ``sections`` command wrote on the
                                                 GPU machine
    device3/contract_offload/contract.json       a fourth invocation, at commit 3e8dd19: the expert classes with
                                                 offloaded weights (``offload_rows``); its resident expert rows
                                                 repeat device3/contract.json's and are checked equal, then dropped
    device/hashes.json                           the 9bbc9f3 run (tree of commit 9bbc9f3)
    fp64_small_2064tok.json,
    streams_small_2048tok.json                   the early run: an uncommitted tree between 5d1be2c and ee1bfa4
                                                 (not recorded exactly)

lib/exactness/kernels, model.py, paths.py and cache.py are identical at 5d1be2c, 9bbc9f3 and 0db0fbb, so every
section ran the same kernels. The environment record is the 0db0fbb run's first invocation (device3/env_call1.json);
its ``git`` comes from EXACTNESS_GIT_SHA (the tree reached the GPU machine with an older checkout's ``.git``, so git
there named fdab6c6, dirty, for a tree that was exactly 0db0fbb; the record keeps what git said).
Other outputs kept in measurements/h200 but not in the receipt: device/bench.json (the 9bbc9f3 run's bench at 64
generated tokens) and contract_cuda_tiny_shapes.json (the early run's quick sweep at the tiny preset's shapes, bf16).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "lib"))

H200 = "NVIDIA H200 (sm_90), torch 2.11.0+cu130, Triton 3.6.0"
COMMIT_9BBC9F3 = "9bbc9f3dedd88e5cd46174d8e4be949ca08b42ac"
EARLY_TREE = "uncommitted working tree between 5d1be2c and ee1bfa4 (not recorded exactly)"
PREFIX = "EXACTNESS_GIT_SHA=9bbc9f3… PYTHONPATH=/tmp/site:lib python3 -m exactness "   # the 9bbc9f3 run
PREFIX_EARLY = "PYTHONPATH=/tmp/site:lib python3 -m exactness "                      # the early run


def load(name: str) -> dict:
    return json.loads((HERE / name).read_text(encoding="utf-8"))


def with_provenance(section: dict, computed_on: str, commit: str, command: str, notes: str) -> dict:
    return {**section, "provenance": {"computed_on": computed_on, "commit": commit, "command": command,
                                      "notes": notes}}


def noted(section: dict, note: str) -> dict:
    """``section`` with ``note`` put before its provenance notes (the record ``sections`` wrote on the GPU machine)."""
    prov = dict(section["provenance"])
    prov["notes"] = f"{note}; {prov['notes']}"
    return {**section, "provenance": prov}


def contract_with_offload() -> dict:
    """device3/contract.json joined with the offload rows of the fourth invocation. Its resident rows (the same
    expert pairs, same sweep and inputs) must agree with device3/contract.json's in cases and mismatches."""
    from exactness.analysis.contract.check import merge_sections
    first, offload = load("device3/contract.json"), load("device3/contract_offload/contract.json")
    have = {(r["class"], r["set"], r["dtype"]): (r["cases"], r["mismatches"]) for r in first["rows"]}
    for r in offload["rows"]:
        again = (r["cases"], r["mismatches"])
        if have[(r["class"], r["set"], r["dtype"])] != again:
            raise SystemExit(f"the two contract runs disagree on {r['class']} {r['set']} {r['dtype']}: "
                             f"{have[(r['class'], r['set'], r['dtype'])]} vs {again}")
    return merge_sections([first, {**offload, "rows": []}])


def main() -> int:
    out = HERE / "sections"
    out.mkdir(exist_ok=True)
    env = load("device3/env_call1.json")
    sections = {
        "env": env,
        "hashes": with_provenance(
            load("device/hashes.json"), H200 + ", 2026-11-29T17:51Z", COMMIT_9BBC9F3,
            "scripts/h200_receipt.sh 1 (" + PREFIX + "sections --profile gpu --sections hashes,streams,fp64)",
            "full gpu-profile hash matrix: prompts cut to hash_max_tokens=2560, 64 generated tokens, offload on "
            "and off (batched/deep); 440.7 s. streams and fp64 of that invocation were cut by the script's 10-minute "
            "deadline. The 9bbc9f3 tree has no rerun control (hash_rerun): no rerun column"),
        "bench": noted(load("device3/bench.json"),
                       "scripts/h200_receipt.sh 3 fast, then 3 invariant (one invocation each, 192 generated "
                       "tokens), joined by python -m exactness merge; seconds per part"),
        "contract": noted(contract_with_offload(),
                          "scripts/h200_receipt.sh 2 (one process per kernel set in one invocation), then the "
                          "expert classes with offloaded weights (a fourth invocation, --param 'kernel_sets=[invariant,"
                          "fast]' --param 'contract_classes=[expert_gate_up,expert_down]'), joined by "
                          "measurements/h200/assemble.py with merge_sections; full sweep for invariant, quick for "
                          "the fast control; seconds per part"),
        "fp64": with_provenance(
            load("fp64_small_2064tok.json"), H200 + ", 2026-11-29 (early run)", EARLY_TREE,
            PREFIX_EARLY + "fp64 --profile gpu --param fp64_tokens=2064",
            "small preset, code prompt cut to 2064 tokens"),
        "streams": with_provenance(
            load("streams_small_2048tok.json"), H200 + ", 2026-11-29 (early run)", EARLY_TREE,
            PREFIX_EARLY + "streams --profile gpu --param prompt_max_tokens=2048 --param gen_tokens=32",
            "prompts cut to 2048 tokens, 32 generated, 256-token stream prompts (the data's settings; the "
            "command is what the early run recorded, whose gpu profile had 2048-token stream prompts)"),
    }
    for name, obj in sections.items():
        (out / f"{name}.json").write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {', '.join(sections)} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
