#!/usr/bin/env bash
# JupyterLab on notebooks/ with the `exactness` kernel: what `make lab` runs (tests/test_lab.py starts the same).
#
#   usage: scripts/lab.sh [further jupyter lab options, e.g. --port=8890 or --ip=0.0.0.0]
#   env:   JUPYTER (default .venv/bin/jupyter)
#
# The server prints its URL with the access token in the terminal and opens no browser: the machines this runs on
# are often headless, and the URL works from a browser elsewhere through an SSH tunnel. Jupyter refuses to start as
# root unless told to, so --allow-root is passed only when the user is root (containers and CI run as root).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
allow_root=
if [ "$(id -u)" = 0 ]; then allow_root=--allow-root; fi
# exec: the server keeps this script's PID, so whoever started it can stop it by that PID.
exec "${JUPYTER:-$repo/.venv/bin/jupyter}" lab --no-browser --ServerApp.root_dir="$repo/notebooks" $allow_root "$@"
