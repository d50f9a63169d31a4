#!/usr/bin/env bash
# Fill a folder with exactly the wheels of scripts/gpu_wheels.txt: what a receipt run needs that the GPU machine's
# Python lacks (papermill, nbconvert, ipykernel and their dependencies) and mpmath 1.3.0 (the prompts are pinned to
# its sources). The GPU machine is offline: run this where PyPI is reachable, copy the folder with the tree (.whl/ is
# git-ignored, so a git-based copy leaves it out), and run there  make receipts PROFILE=gpu PY=python3 WHEELS=.whl
#
#   usage: scripts/gpu_wheels.sh [DIR]        default .whl; the wheels are for CPython 3.12 on manylinux x86_64
#
# Wheels in DIR that the list does not name are removed, so that DIR holds one version of each package (the
# Makefile installs every wheel in it).
set -euo pipefail
dir=${1:-.whl}
list="$(dirname "$0")/gpu_wheels.txt"
mkdir -p "$dir"
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dir" -r "$list"
# A wheel's file name is NAME-VERSION-...whl, NAME with _ for - and .: keep those the list names.
for f in "$dir"/*.whl; do
  name=$(basename "$f" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
  if ! grep -qxF "$name==$(basename "$f" | cut -d- -f2)" "$list"; then echo "removed (not in $list): $f"; rm -f "$f"; fi
done
echo "$(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
