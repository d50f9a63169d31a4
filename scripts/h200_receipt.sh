#!/usr/bin/env bash
# The GPU receipt on a machine with one H200, in parts that each finish within 10 minutes (the whole receipt in one
# command is `make receipts PROFILE=gpu PY=python3 WHEELS=.whl`, which takes longer): every step gets the time
# left of DEADLINE (580 s by default) and is cut with `timeout`, so a part can run as one bounded job and a cut loses
# at most one step. Run from the repo root on the GPU machine with OUT set; results go to $OUT/gpu.
#
#   scripts/h200_receipt.sh 1        offload bench (proves the expert ring on CUDA first; if it fails, the hash
#                                    matrix runs without offload and says so), then the hashes section
#   scripts/h200_receipt.sh 2        the contract section once per kernel set (CONTRACT_SETS, default "invariant
#                                    fast"; each into $OUT/gpu/contract_SET/contract.json, so that the time limit
#                                    cuts off at most one set), then sections SECTIONS2 (default streams,fp64) with
#                                    the time left
#   scripts/h200_receipt.sh 3 SET    the bench section for one kernel set (fast or invariant) at the bench's
#                                    standard 192 generated tokens, into $OUT/gpu/bench_SET/bench.json
#   (PROFILE=ci etc. runs another profile, e.g. to try a part on the CPU)
#   scripts/h200_receipt.sh 4        the kernel bench's decode-step and end-to-end prefill ratios
#
# On an H200 the contract leaves part 2 too little time for streams and fp64: run them as a part of their own
# (CONTRACT_SETS= SECTIONS2=streams, then CONTRACT_SETS= SECTIONS2=fp64). measurements/h200/README.md lists how long each
# part took there.
#
# Each section JSON carries a provenance record (machine, commit, command, seconds) that receipt.md lists. Then
# here: put the JSONs in one folder (env.json: keep part 1's; the parts' env records differ only in time), join the
# per-set parts with
#   .venv/bin/python -m exactness merge --out <folder>/bench.json bench_fast/bench.json bench_invariant/bench.json
#   .venv/bin/python -m exactness merge --out <folder>/contract.json contract_invariant/contract.json \
#       contract_fast/contract.json
# and render with  .venv/bin/python -m exactness receipts --profile gpu --precomputed <folder> --out <run folder>
# The prompts need mpmath 1.3.0 there: scripts/gpu_wheels.sh fills .whl/ (mpmath and what the notebooks need), and
# copy .whl/ to the GPU machine with the tree (it is git-ignored, so a git-based copy leaves it out); the script
# installs it to /tmp/site (without it the prompt pins fail).
# Set EXACTNESS_GIT_SHA (and EXACTNESS_GIT_DIRTY=0/1) to the commit copied when the GPU machine's tree has no .git
# or an older one, so that the records name the commit that ran.
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
