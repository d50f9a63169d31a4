#!/usr/bin/env bash
# Compute every section of a profile as JSON on a machine without Jupyter (the GPU machine), for rendering
# elsewhere with:  python -m exactness receipts --profile gpu --precomputed <folder>
#
#   usage: scripts/gpu_sections.sh OUT_DIR [PROFILE] [--param key=value ...]
#   env:   SECTION_TIMEOUT (seconds per section, default 1800), SECTIONS (default: all five), PYTHON (python3)
#
# Runs from the repo root with PYTHONPATH=lib (no install needed); mpmath 1.3.0 must be importable (the prompts are
# pinned to its sources). A section that fails or times out leaves no file, so rendering names what is missing.
set -uo pipefail
out=${1:?usage: scripts/gpu_sections.sh OUT_DIR [PROFILE] [--param key=value ...]}
profile=${2:-gpu}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}lib" PYTHONUNBUFFERED=1
"${PYTHON:-python3}" -m exactness env > "$out/env.json"
status=0
for section in ${SECTIONS:-hashes contract fp64 streams bench}; do
  start=$(date +%s)
  timeout "${SECTION_TIMEOUT:-1800}" "${PYTHON:-python3}" -m exactness "$section" --profile "$profile" "$@" \
    --out "$out/$section.json" > "$out/$section.log" 2>&1
  rc=$?
  echo "[gpu_sections] $section: rc=$rc, $(( $(date +%s) - start )) s"
  [ $rc -eq 0 ] || { status=1; tail -5 "$out/$section.log"; }
done
exit $status
