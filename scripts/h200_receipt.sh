#!/usr/bin/env bash
# The GPU receipt in device-tool calls of under 10 minutes each (the tool's per-call limit). Run from the repo root
# on the GPU machine; results go to $OUT/gpu (the files the tool returns).
#
#   scripts/h200_receipt.sh 1        offload bench (proves the expert ring on CUDA first; if it fails, the hash
#                                    matrix runs without offload and says so), then the hashes section
#   scripts/h200_receipt.sh 2        the contract section once per kernel set (CONTRACT_SETS, default "invariant
#                                    fast"; each into $OUT/gpu/contract_SET/contract.json, so that the time limit
#                                    cuts off at most one set), then sections SECTIONS2 (default streams,fp64) with
#                                    the time left
#   scripts/h200_receipt.sh 3 SET    the bench section for one kernel set (fast or invariant) at the seed's 192
#                                    generated tokens, into $OUT/gpu/bench_SET/bench.json
#   (PROFILE=ci etc. runs another profile, e.g. to try a part on the CPU)
#   scripts/h200_receipt.sh 4        the kernel bench's decode-step and end-to-end prefill ratios
#
# Measured on the H200 (docs/gpu/README.md): hashes 441 s (before the rerun control added one batched run per set
# and prompt); part 2's contract 161 s (invariant) + 210 s (fast) before the offload rows were added (about 26 s +
# 12 s more), after which streams and fp64 did not finish in the 190 s left: run them in a call of their own
# (CONTRACT_SETS= SECTIONS2=streams, then SECTIONS2=fp64; session 1's fp64 took about 244 s); part 3 fast 327 s,
# invariant 284 s; part 4 about 45 s. Not measured: the offload bench alone.
#
# Each section JSON carries a provenance record (machine, commit, command, seconds) that receipt.md lists. Then
# here: put the JSONs in one folder (env.json: keep part 1's; the calls' env records differ only in time), join the
# per-set parts with
#   .venv/bin/python -m exactness merge --out <folder>/bench.json bench_fast/bench.json bench_invariant/bench.json
#   .venv/bin/python -m exactness merge --out <folder>/contract.json contract_invariant/contract.json \
#       contract_fast/contract.json
# and render with  .venv/bin/python -m exactness receipts --profile gpu --precomputed <folder> --out <run folder>
# The prompts need mpmath 1.3.0 there: here `pip download --no-deps mpmath==1.3.0 -d .whl` (.whl/ is git-ignored),
# name `.whl` in the device call's carry; the script installs it to /tmp/site (without it the prompt pins fail).
# Set EXACTNESS_GIT_SHA (and EXACTNESS_GIT_DIRTY=0/1) to the commit sent: the device tool's copy carries the
# session's first .git, so git there may name an older commit.
set -uo pipefail
part=${1:?usage: scripts/h200_receipt.sh 1|2|3 SET|4}
o="${OUT:?OUT must be set}/gpu"
deadline=${DEADLINE:-580}            # seconds from the start of this script; each step gets what is left
mkdir -p "$o"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}lib" PYTHONUNBUFFERED=1
left() { echo $(( deadline - SECONDS )); }
sections() {  # sections DIR LOG ARGS...: one process, the log kept and shown
  local dir=$1 log=$2; shift 2
  if (( $(left) < 30 )); then echo "[h200_receipt] skipped (under 30 s left): $*"; return; fi
  timeout "$(left)" python3 -m exactness sections --profile "${PROFILE:-gpu}" --out "$dir" "$@" > "$log" 2>&1
  grep -v "^\s*$" "$log" | tail -40
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case "$part" in
  1)
    extra=()
    if ! timeout "$(left)" python3 benchmarks/bench_offload.py --weights device --json "$o/offload.json" \
        > "$o/offload.log" 2>&1; then
      echo "offload bench failed: the hash matrix runs without offload"; extra=(--param "hash_offload=[false]")
    fi
    cat "$o/offload.log"
    sections "$o" "$o/sections1.log" --sections hashes "${extra[@]}" ;;
  2)
    for set_name in ${CONTRACT_SETS-invariant fast}; do
      mkdir -p "$o/contract_$set_name"
      sections "$o/contract_$set_name" "$o/contract_$set_name/sections.log" --sections contract \
        --param "kernel_sets=[$set_name]"
    done
    rest=${SECTIONS2-streams,fp64}
    if [ -n "$rest" ]; then sections "$o" "$o/sections2.log" --sections "$rest"; fi ;;
  3)
    set_name=${2:?usage: scripts/h200_receipt.sh 3 fast|invariant}
    mkdir -p "$o/bench_$set_name"
    sections "$o/bench_$set_name" "$o/bench_$set_name/sections.log" --sections bench \
      --param "kernel_sets=[$set_name]" ;;
  4)
    timeout "$(left)" python3 benchmarks/bench_gpu_kernels.py --sections decode_step,e2e --out "$o" \
      2>&1 | tee "$o/kernels.log" ;;
  *) echo "unknown part $part; use 1, 2, 3 SET or 4"; exit 2 ;;
esac
echo "[h200_receipt] part $part done in $SECONDS s"; ls -la "$o"
