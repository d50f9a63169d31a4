set -x
export EXACTNESS_GIT_SHA=$(cat .before/sha) EXACTNESS_GIT_DIRTY=0
bash scripts/setup_python.sh python3 .whl .deps exactness
export PYTHONPATH=$PWD/lib:$PWD/.deps
python3 -m pytest -q -x tests/test_cuda_kernels.py tests/test_cuda_graphs.py 2>&1 | tail -15 | tee $OUT/tests.log
timeout 120 python3 .before/oracle_prof_run1.py 2>&1 | tee $OUT/oracle_prof.txt
for s in contract fp64 streams hashes; do
  python3 .before/prof.py 170 $OUT/prof_$s.txt $s --profile gpu --out $OUT/$s.json > $OUT/prof_$s.log 2>&1 &
done
nvidia-smi dmon -c 30 -d 5 > $OUT/dmon.txt 2>&1 &
wait
tail -c 600 $OUT/prof_*.log
