export EXACTNESS_GIT_SHA=$(cat .before/sha) EXACTNESS_GIT_DIRTY=0
bash scripts/setup_python.sh python3 .whl .deps exactness > /dev/null 2>&1
export PYTHONPATH=$PWD/lib:$PWD/.deps
A=$OUT/all.txt
(nproc; free -g | head -2; lscpu | grep -i "model name\|numa") >> $A
timeout 120 python3 .before/h2d.py >> $A 2>&1
s=$(date +%s)
python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_kernels.py tests/test_hash_graphs.py 2>&1 | tail -15 >> $A
echo "tests took $(( $(date +%s) - s )) s" >> $A
s=$(date +%s)
timeout 330 python3 -m exactness bench --profile gpu --out $OUT/bench.json > /tmp/bench.log 2>&1
echo "bench exit $? took $(( $(date +%s) - s )) s" >> $A
tr '\r' '\n' < /tmp/bench.log | grep -v "^bench:" | tail -5 >> $A
tr '\r' '\n' < /tmp/bench.log | grep "^bench:" | tail -2 >> $A
cat $A
