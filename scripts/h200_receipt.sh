#!/usr/bin/env bash
# The GPU receipt in two device-tool calls of under 10 minutes each (the tool's per-call limit), as run for
# docs/gpu/receipt/. Run from the repo root on the GPU machine; results go to $OUT/gpu (the files the tool returns).
#
#   scripts/h200_receipt.sh 1   offload bench (proves the expert ring on CUDA first; if it fails, the hash matrix
#                               runs without offload and says so), then sections hashes, streams, fp64
#   scripts/h200_receipt.sh 2   sections contract, bench; then the kernel bench's decode-step and end-to-end prefill
#
# Then here: copy both calls' $OUT/gpu files into one folder and render with
#   .venv/bin/python -m exactness receipts --profile gpu --precomputed <folder> --out docs/gpu/receipt
# Needs mpmath 1.3.0 importable (the prompts are pinned to its sources): a wheel in .whl/ is installed to /tmp/site.
set -uo pipefail
part=${1:?usage: scripts/h200_receipt.sh 1|2}
o="${OUT:?OUT must be set}/gpu"
deadline=${DEADLINE:-580}            # seconds from the start of this script; each step gets what is left
mkdir -p "$o"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}lib" PYTHONUNBUFFERED=1
left() { echo $(( deadline - SECONDS )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "$part" = 1 ]; then
  extra=()
  if ! timeout "$(left)" python3 benchmarks/bench_offload.py --weights device --json "$o/offload.json" \
      > "$o/offload.log" 2>&1; then
    echo "offload bench failed: the hash matrix runs without offload"; tail -20 "$o/offload.log"
    extra=(--param "hash_offload=[false]")
  fi
  cat "$o/offload.log"
  timeout "$(left)" python3 -m exactness sections --profile gpu --out "$o" --sections hashes,streams,fp64 \
    "${extra[@]}" 2>&1 | grep -v "^\s*$" | tail -c 20000 | tee "$o/sections1.log"
elif [ "$part" = 2 ]; then
  timeout "$(( $(left) - 90 ))" python3 -m exactness sections --profile gpu --out "$o" \
    --sections "${SECTIONS2:-contract,bench}" 2>&1 | tail -c 20000 | tee "$o/sections2.log"
  timeout "$(left)" python3 benchmarks/bench_gpu_kernels.py --sections decode_step,e2e --out "$o" \
    2>&1 | tee "$o/kernels.log"
fi
echo "[h200_receipt] part $part done in $SECONDS s"; ls -la "$o"
