export EXACTNESS_GIT_SHA=$(cat .before/sha) EXACTNESS_GIT_DIRTY=0
bash scripts/setup_python.sh python3 .whl .deps exactness > /dev/null 2>&1
export PYTHONPATH=$PWD/lib:$PWD/.deps
A=$OUT/all.txt
timeout 60 python3 .before/attn_mem.py >> $A 2>&1
timeout 60 python3 -m pytest -q tests/test_cuda_kernels.py -k "fast_prompt_attention" 2>&1 | tail -3 >> $A
s=$(date +%s)
for x in hashes contract fp64 streams; do
  timeout ${SECS:-340} python3 .before/mem.py $x --profile gpu --out /tmp/$x.json > /tmp/$x.log 2>&1 &
done
nvidia-smi --query-gpu=memory.used --format=csv -l 10 > /tmp/smi.txt 2>&1 &
wait %1 %2 %3 %4
echo "side by side: $(( $(date +%s) - s )) s" >> $A
for x in hashes contract fp64 streams; do echo "== $x"; tr '\r' '\n' < /tmp/$x.log | grep -v "^\(hash matrix\|contract\|fp64\|streams\):" | tail -4; tr '\r' '\n' < /tmp/$x.log | grep "^\(hash matrix\|contract\|fp64\|streams\):" | tail -1; done >> $A
sort -t, -k1 -n /tmp/smi.txt | tail -3 >> $A
kill %5 2>/dev/null
cat $A
