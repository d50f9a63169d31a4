export EXACTNESS_GIT_SHA=$(cat .before/sha) EXACTNESS_GIT_DIRTY=1
bash scripts/setup_python.sh python3 .whl .deps exactness
export PYTHONPATH=$PWD/lib:$PWD/.deps
A=$OUT/all.txt
python3 -m pytest -q tests/test_cuda_kernels.py tests/test_cuda_graphs.py 2>&1 | tail -15 >> $A
timeout 150 python3 .before/oracle_prof.py >> $A 2>&1
for s in contract fp64 streams hashes; do
  python3 .before/prof.py ${SECS:-330} $OUT/prof_$s.txt $s --profile gpu --out /tmp/$s.json > /tmp/prof_$s.log 2>&1 &
done
wait
for s in contract fp64 streams hashes; do echo "=== $s"; tail -c 400 /tmp/prof_$s.log; echo; done >> $A
cat $A | tail -c 5000
