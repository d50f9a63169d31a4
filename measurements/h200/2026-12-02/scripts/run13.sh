export EXACTNESS_GIT_SHA=$(cat .before/sha) EXACTNESS_GIT_DIRTY=1
bash scripts/setup_python.sh python3 .whl .deps exactness > /dev/null 2>&1
export PYTHONPATH=$PWD/lib:$PWD/.deps PYTHONUNBUFFERED=1
A=$OUT/all.txt
s=$(date +%s)
timeout 150 python3 .before/split_loop.py > $OUT/split_loop.log 2>&1
echo "split_loop exit $? took $(( $(date +%s) - s )) s" >> $A
s=$(date +%s)
timeout 200 python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_kernels.py tests/test_offload.py tests/test_hash_graphs.py > $OUT/tests.log 2>&1
echo "tests exit $? took $(( $(date +%s) - s )) s" >> $A
s=$(date +%s)
timeout 200 python3 benchmarks/bench_gpu_kernels.py --sections drafted --out $OUT/drafted > $OUT/drafted.log 2>&1
echo "drafted exit $? took $(( $(date +%s) - s )) s" >> $A
cat $A; cat $OUT/split_loop.log | tail -25; tail -15 $OUT/tests.log; grep -v "^\s*$" $OUT/drafted.log | tail -16
