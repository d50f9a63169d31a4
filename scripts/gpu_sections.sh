#!/usr/bin/env bash
# Compute the sections of a profile as JSON on a machine without Jupyter (the GPU machine), for rendering
# elsewhere with:  python -m exactness receipts --profile gpu --precomputed <folder>
#
#   usage: scripts/gpu_sections.sh OUT_DIR [PROFILE] [--param key=value ...]
#   env:   SECTIONS (comma-separated, default hashes,contract,fp64,streams,bench), PYTHON (default python3)
#
# Runs from the repo root with PYTHONPATH=lib (no install needed); mpmath 1.3.0 must be importable (the prompts are
# pinned to its sources). One process computes every section (python -m exactness sections), so the synthetic
# weights are drawn once; a section that fails leaves <section>.error.txt instead of its JSON and the others still
# run, so rendering names what is missing. The log goes to OUT_DIR/sections.log.
set -uo pipefail
out=${1:?usage: scripts/gpu_sections.sh OUT_DIR [PROFILE] [--param key=value ...]}
profile=${2:-gpu}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}lib" PYTHONUNBUFFERED=1
"${PYTHON:-python3}" -m exactness sections --profile "$profile" --out "$out" \
  --sections "${SECTIONS:-hashes,contract,fp64,streams,bench}" "$@" 2>&1 | tee "$out/sections.log"
