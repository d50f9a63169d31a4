export EXACTNESS_GIT_SHA=$(cat .before/sha) EXACTNESS_GIT_DIRTY=0
bash scripts/setup_python.sh python3 .whl .deps exactness > /dev/null 2>&1
export PYTHONPATH=$PWD/lib:$PWD/.deps PYTHONUNBUFFERED=1
A=$OUT/all.txt
s=$(date +%s)
python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_kernels.py tests/test_hash_graphs.py 2>&1 | tail -15 >> $A
echo "tests took $(( $(date +%s) - s )) s" >> $A
s=$(date +%s)
timeout 220 python3 benchmarks/bench_gpu_kernels.py --sections decode_step,gemm,moe,e2e --out $OUT > $OUT/kernels.log 2>&1
echo "kernels exit $? took $(( $(date +%s) - s )) s" >> $A
s=$(date +%s)
timeout 150 python3 benchmarks/bench_offload.py --weights device --json $OUT/offload.json > $OUT/offload.log 2>&1
echo "offload exit $? took $(( $(date +%s) - s )) s" >> $A
s=$(date +%s)
timeout 120 python3 .before/deep_prof.py > $OUT/deep_prof.log 2>&1
echo "deep_prof exit $? took $(( $(date +%s) - s )) s" >> $A
cat $A; tail -5 $OUT/offload.log
