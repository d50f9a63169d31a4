"""Assemble docs/gpu/sections/ (the five section JSONs of the GPU receipt) from the H200 outputs kept in docs/gpu/.

    make setup && .venv/bin/python docs/gpu/assemble.py   # writes docs/gpu/sections/{env,hashes,...}.json
    .venv/bin/python -m exactness receipts --profile gpu --precomputed docs/gpu/sections --out docs/gpu/receipt \\
        --param bench_gen_tokens=64

Each section gets a ``provenance`` record (machine, commit, command, notes) that receipt.md shows in its "Where each
section was computed" table. Sources:

    device/hashes.json, device/bench.json, device/env.json   session 2 (2026-11-29), tree of commit 9bbc9f3
                                                              (bench: call 3, device/sections3.log, env_call3.json)
    contract_cuda_tiny_shapes.json, fp64_small_2064tok.json,
    streams_small_2048tok.json                                session 1 (2026-11-29), its working tree (not
                                                              recorded exactly; between 5d1be2c and ee1bfa4)

The environment record is the H200's (device/env.json) except ``git``: the device tool sends the working tree with
the ``.git`` of the session's starting checkout (dd4bdeb), so git there reported ``dd4bdeb (dirty)`` although the
files were exactly commit 9bbc9f3 (committed, ``git status`` empty, just before the calls); the record says so.
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


def contract_section() -> dict:
    """Session 1's contract rows (a bare list) as a section object, with coverage for what they cover."""
    from exactness.analysis.contract import coverage
    rows = load("contract_cuda_tiny_shapes.json")
    sets = sorted({r["set"] for r in rows})
    cov, unc = coverage(rows, sets, "cuda", ["bfloat16"])
    # The rows do not record their sweep. Their case counts (63,760 per class, 76,764 for attention; 714,364 in
    # all) are exactly those of the quick sweep at the tiny preset (the ci profile's CPU receipt has the same),
    # while the full sweep has 2,446,626: this was a quick sweep, whatever session 1's notes said.
    return {"section": "contract", "sweep": "quick", "preset": "tiny", "rows": rows, "coverage": cov,
            "uncovered": unc}


def main() -> int:
    out = HERE / "sections"
    out.mkdir(exist_ok=True)
    env = load("device/env.json")
    env["git"] = {"sha": SESSION2, "short": SESSION2[:7], "dirty": False, "source": "stated (see docs/gpu/assemble.py)",
                  "device_git_said": env["git"]}
    sections = {
        "env": env,
        "hashes": with_provenance(
            load("device/hashes.json"), H200 + ", 2026-11-29T17:51Z", SESSION2,
            "scripts/h200_receipt.sh 1 (" + PREFIX + "sections --profile gpu --sections hashes,streams,fp64)",
            "full gpu-profile hash matrix: prompts cut to hash_max_tokens=2560, 64 generated tokens, offload on "
            "and off (batched/deep); 440.7 s. streams and fp64 of that call were cut by its 10-minute limit. Computed "
            "before the rerun control (hash_rerun) existed: no rerun column"),
        "bench": with_provenance(
            load("device/bench.json"), H200 + ", 2026-11-29T18:08Z", SESSION2,
            PREFIX + "sections --profile gpu --sections bench,contract --param bench_gen_tokens=64",
            "the seed's tables on the full prompts with 64 generated tokens instead of 192 (the run at 192 did "
            "not finish inside one 10-minute call); 374.1 s. The contract of that call was cut by the limit"),
        "contract": with_provenance(
            contract_section(), H200 + ", 2026-11-29 (session 1)", SESSION1,
            PREFIX1 + "contract --profile gpu --param preset=tiny --param 'contract_dtypes=[bfloat16]'",
            "quick sweep (its case counts are the quick sweep's; session 1's notes called it full) at the tiny "
            "preset's shapes, bf16 only; the full sweep at the small preset's shapes (bf16 + fp32) is still owed: "
            "its call was cut by the 10-minute call limit and no device time was left. The command is what "
            "session 1 recorded; the rows show a quick sweep, so the exact command is not known"),
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
