"""Write a dump set (docs/dumps.md) of a local transformers Qwen3-MoE checkpoint, and optionally check it.

    python scripts/dump_hf.py MODEL_DIR OUT_DIR [--prompt code] [--tokens 48] [--dtype bfloat16]
                              [--positions 0,5,47] [--no-weights] [--check]

One forward over the prompt's first TOKENS tokens is the prompt role; the same tokens one at a time through a
DynamicCache are the decode role (exactness.dumps.hf_hooks). With ``--check`` the dump contract is printed as
markdown. Nothing is downloaded: MODEL_DIR is a folder with config.json and safetensors (e.g. one written by
exactness.engines.tiny.save_tiny_qwen3_moe).
"""
from __future__ import annotations

import argparse
import sys

DTYPES = ("bfloat16", "float16", "float32")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="local checkpoint folder (config.json + safetensors)")
    ap.add_argument("out", help="new or empty folder for the dump set")
    ap.add_argument("--prompt", default="code", help="prompt name (exactness.prompts), default code")
    ap.add_argument("--tokens", type=int, default=48, help="prompt tokens (default 48)")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--positions", default=None, help="comma-separated positions to dump (default all)")
    ap.add_argument("--no-weights", action="store_true", help="do not store the weights in the dump set")
    ap.add_argument("--check", action="store_true", help="print the dump contract (markdown)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    """Write the dump set; returns 0 (1 with --check when rows differ)."""
    a = parse(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from exactness.analysis.contract.calls import contract_of_calls
    from exactness.analysis.contract.report import render_calls_md
    from exactness.dumps.hf_hooks import dump_hf_model
    from exactness.prompts import build_prompt

    positions = None if a.positions is None else [int(p) for p in a.positions.split(",") if p.strip()]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).eval()
    ids = build_prompt(a.prompt, max_tokens=a.tokens).ids
    dump_hf_model(a.out, model, ids, weights=not a.no_weights, positions=positions)
    print(f"wrote {a.out}")
    if a.check:
        obj = contract_of_calls(a.out)
        print(render_calls_md(obj))
        return 1 if obj["totals"]["mismatches"] else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
