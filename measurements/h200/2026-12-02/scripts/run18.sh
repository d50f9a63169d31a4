export EXACTNESS_GIT_SHA=$(cat .before/sha) EXACTNESS_GIT_DIRTY=0
bash scripts/setup_python.sh python3 .whl .deps exactness > /dev/null 2>&1
export PYTHONPATH=$PWD/lib:$PWD/.deps PYTHONUNBUFFERED=1
A=$OUT/all.txt
s=$(date +%s)
timeout 200 python3 benchmarks/bench_gpu_goals.py --out $OUT/goals > $OUT/goals.log 2>&1
echo "goals exit $? took $(( $(date +%s) - s )) s" >> $A
s=$(date +%s)
timeout 200 python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_kernels.py tests/test_offload.py tests/test_hash_graphs.py > $OUT/tests.log 2>&1
echo "tests exit $? took $(( $(date +%s) - s )) s" >> $A
cat $A; tail -4 $OUT/tests.log; grep -A30 "^| measure" $OUT/goals.log | head -40
