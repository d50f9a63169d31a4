export EXACTNESS_GIT_SHA=$(cat .before/sha) EXACTNESS_GIT_DIRTY=0
bash scripts/setup_python.sh python3 .whl .deps exactness > /dev/null 2>&1
export PYTHONPATH=$PWD/lib:$PWD/.deps PYTHONUNBUFFERED=1
A=$OUT/all.txt
s=$(date +%s)
timeout 170 python3 -m pytest -q tests/test_offload.py tests/test_cuda_graphs.py tests/test_cuda_kernels.py tests/test_hash_graphs.py 2>&1 | tail -25 >> $A
echo "tests took $(( $(date +%s) - s )) s" >> $A
s=$(date +%s)
timeout 60 python3 benchmarks/bench_offload.py --weights device --kernels invariant > $OUT/offload.log 2>&1
echo "offload exit $? took $(( $(date +%s) - s )) s" >> $A
cat $A; grep -v "^\s*$" $OUT/offload.log | tail -5
