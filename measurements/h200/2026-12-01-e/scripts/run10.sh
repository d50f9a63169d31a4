export EXACTNESS_GIT_SHA=$(cat .before/sha) EXACTNESS_GIT_DIRTY=0
bash scripts/setup_python.sh python3 .whl .deps exactness > /dev/null 2>&1
export PYTHONPATH=$PWD/lib:$PWD/.deps PYTHONUNBUFFERED=1
A=$OUT/all.txt
s=$(date +%s)
timeout 200 python3 -m pytest -q tests/test_offload.py tests/test_cuda_graphs.py tests/test_cuda_kernels.py tests/test_hash_graphs.py 2>&1 | tail -25 >> $A
echo "tests took $(( $(date +%s) - s )) s" >> $A
s=$(date +%s)
timeout 100 python3 benchmarks/bench_offload.py --weights device --json $OUT/offload.json > $OUT/offload.log 2>&1
echo "offload exit $? took $(( $(date +%s) - s )) s" >> $A
s=$(date +%s)
timeout 80 python3 benchmarks/bench_gpu_kernels.py --sections e2e --out $OUT > $OUT/kernels.log 2>&1
echo "kernels exit $? took $(( $(date +%s) - s )) s" >> $A
s=$(date +%s)
timeout 200 python3 -m exactness hashes --profile gpu --param 'prompts=[code]' --param 'kernel_sets=[invariant]' --out $OUT/hashes.json > /tmp/h.log 2>&1
echo "hashes exit $? took $(( $(date +%s) - s )) s" >> $A
tr '\r' '\n' < /tmp/h.log | grep -v "^hash matrix" | tail -20 > $OUT/hashes.log; tr '\r' '\n' < /tmp/h.log | grep "^hash matrix" | tail -1 >> $OUT/hashes.log
python3 - >> $A <<'PY'
import json, os
try:
    d = json.load(open(os.environ["OUT"] + "/hashes.json"))
    for r in d["rows"]:
        print(r["prompt"], r["kernels"], r["path"], r.get("step"), r.get("offload"), "eq", r.get("equals_oracle"), "logits", r.get("prompt_logits_equal"), "kv", r.get("kv_equal"), r.get("served"))
except Exception as e:
    print("hashes.json:", e)
PY
cat $A; grep -v "^\s*$" $OUT/offload.log | tail -8; grep "|" $OUT/kernels.log | tail -7
