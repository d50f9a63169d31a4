#!/usr/bin/env bash
# `make setup` for an existing Python instead of the venv (make receipts PY=python3 WHEELS=.whl): nothing is
# installed into that Python and nothing is downloaded. The wheels in WHEELS (the packages that Python lacks;
# scripts/gpu_wheels.sh fills .whl/ for the GPU machine) go into DEPS offline and without dependency resolution; the
# Jupyter kernel the receipt runner uses is registered in DEPS/share/jupyter, beside the wheels' Jupyter data
# (nbconvert's templates). The Makefile puts lib and DEPS on PYTHONPATH and DEPS/share/jupyter on JUPYTER_PATH; the
# kernel process inherits both.
#
#   usage: scripts/setup_python.sh PYTHON WHEELS DEPS KERNEL_NAME       (WHEELS may be empty: nothing to install)
#
# Done again only when the Python, the wheels or this script change (DEPS/.setup-stamp) or the kernel is gone. A
# failure ends with one line on stderr naming it.
set -euo pipefail
py=$1 wheels=$2 deps=$3 kernel=$4
die() { echo "setup: $*" >&2; exit 1; }
exe=$("$py" -c 'import sys; print(sys.executable)' 2>/dev/null) || die "PY=$py does not run as a Python"
whl=()
if [ -n "$wheels" ]; then
  [ -d "$wheels" ] || die "WHEELS=$wheels is not a folder (scripts/gpu_wheels.sh fills one)"
  whl=("$wheels"/*.whl)
  [ -e "${whl[0]}" ] || die "WHEELS=$wheels holds no .whl file (scripts/gpu_wheels.sh fills it)"
fi
sig="$exe $(cksum < "$0") ${whl[*]:-}"
stamp=$deps/.setup-stamp spec=$deps/share/jupyter/kernels/$kernel/kernel.json
if [ -f "$spec" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$sig" ]; then exit 0; fi
rm -rf "$deps"     # wheels taken out of WHEELS must not stay installed
mkdir -p "$deps"
if [ ${#whl[@]} -gt 0 ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$deps" "${whl[@]}" \
    || die "pip could not install the wheels of WHEELS=$wheels into $deps with PY=$py (pip's message above)"
fi
# What a receipt run imports, and nbconvert's templates (Jupyter data files, found through JUPYTER_PATH), checked
# here so that what is missing is named before anything runs.
"$py" - <<'EOF' || exit 1
import importlib, sys
need = ["torch", "numpy", "pandas", "matplotlib", "tabulate", "tqdm", "yaml", "safetensors", "jinja2", "mpmath",
        "papermill", "nbformat", "nbclient", "nbconvert", "jupyter_client", "ipykernel", "IPython"]
missing = []
for name in need:
    try:
        importlib.import_module(name)
    except ImportError as e:
        missing.append(name if e.name in (None, name) else f"{name} (it needs {e.name})")
if missing:
    sys.exit(f"setup: {sys.executable} cannot import {', '.join(missing)}: put the wheels in WHEELS "
             f"(scripts/gpu_wheels.sh fills .whl/ for the GPU machine)")
import nbformat
from nbconvert import HTMLExporter
try:
    HTMLExporter().from_notebook_node(nbformat.v4.new_notebook())
except ValueError as e:   # nbconvert names the folders it searched
    sys.exit(f"setup: nbconvert finds no HTML template ({' '.join(str(e).split())}); is JUPYTER_PATH set?")
EOF
"$py" -m ipykernel install --prefix "$deps" --name "$kernel" --display-name "Python (exactness)" >/dev/null \
  || die "registering the Jupyter kernel $kernel in $deps/share/jupyter failed (ipykernel's message above)"
echo "$sig" > "$stamp"
echo "setup: $exe with $deps (${#whl[@]} wheels) and the Jupyter kernel $kernel in $deps/share/jupyter"
