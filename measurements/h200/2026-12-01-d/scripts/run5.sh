export EXACTNESS_GIT_SHA=$(cat .before/sha) EXACTNESS_GIT_DIRTY=0
bash scripts/setup_python.sh python3 .whl .deps exactness > /dev/null 2>&1
export PYTHONPATH=$PWD/lib:$PWD/.deps
A=$OUT/all.txt
s=$(date +%s)
python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_kernels.py tests/test_hash_graphs.py 2>&1 | tail -15 >> $A
echo "tests took $(( $(date +%s) - s )) s" >> $A
python3 .before/prof.py ${SECS:-330} $OUT/prof_bench.txt bench --profile gpu --out /tmp/bench.json > /tmp/prof_bench.log 2>&1
tr '\r' '\n' < /tmp/prof_bench.log | tail -5 >> $A
cat $A
