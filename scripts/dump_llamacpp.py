"""Write a dump set (docs/dumps.md) of llama.cpp (llama-cpp-python) on a local GGUF file, and optionally check it.

    python scripts/dump_llamacpp.py MODEL.gguf OUT_DIR [--ubatch 512] [--prompt code] [--tokens 48]
                                    [--layers 0,1] [--positions 0:48] [--gen 0] [--kv-type f16] [--weights] [--check]

The prompt's first TOKENS tokens as one llama_decode, split in micro-batches of UBATCH rows, are the prompt role;
the same tokens one per llama_decode from an empty cache (and GEN greedy steps) are the decode role; every computed
ggml node is a call (exactness.dumps.llamacpp). Token ids are this suite's byte tokenizer's (a GGUF written by
``python -m exactness tiny-model DIR --gguf FILE``). With ``--check`` the dump contract is printed as markdown.
"""
from __future__ import annotations

import argparse
import sys


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", help="local GGUF file (f32, f16 or bf16 tensors)")
    ap.add_argument("out", help="new or empty folder for the dump set")
    ap.add_argument("--ubatch", type=int, default=512, help="n_ubatch of the prompt role (default 512)")
    ap.add_argument("--prompt", default="code", help="prompt name (exactness.prompts), default code")
    ap.add_argument("--tokens", type=int, default=48, help="prompt tokens (default 48)")
    ap.add_argument("--layers", default=None, help="comma-separated layers to dump (default all)")
    ap.add_argument("--positions", default=None, help="START:STOP positions to dump (default all)")
    ap.add_argument("--gen", type=int, default=0, help="greedy decode steps after the prompt (decode role)")
    ap.add_argument("--kv-type", default="f16", help="KV cache type: f16 (default), bf16, f32")
    ap.add_argument("--weights", action="store_true", help="store the weights the calls use")
    ap.add_argument("--check", action="store_true", help="print the dump contract (markdown)")
    return ap.parse_args(argv)


def _ints(text: str | None, sep: str, what: str):
    try:
        return None if text is None else [int(v) for v in text.split(sep) if v.strip()]
    except ValueError:
        raise SystemExit(f"error: {what} {text!r} is not allowed; allowed: integers separated by {sep!r}") from None


def main(argv=None) -> int:
    """Write the dump set; returns 0 (1 with --check when rows differ, 2 on a bad argument)."""
    a = parse(argv)
    from exactness.analysis.contract.calls import contract_of_calls
    from exactness.analysis.contract.report import render_calls_md
    from exactness.dumps.llamacpp import dump_llamacpp
    from exactness.prompts import build_prompt

    span = _ints(a.positions, ":", "--positions")
    try:
        ids = build_prompt(a.prompt, max_tokens=a.tokens).ids
        dump_llamacpp(a.out, a.gguf, ids, a.ubatch, _ints(a.layers, ",", "--layers"), span and tuple(span),
                      a.weights, a.gen, kv_type=a.kv_type)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    if a.check:
        obj = contract_of_calls(a.out)
        print(render_calls_md(obj))
        return 1 if obj["totals"]["mismatches"] else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
