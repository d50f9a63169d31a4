export EXACTNESS_GIT_SHA=$(cat .before/sha) EXACTNESS_GIT_DIRTY=0
bash scripts/setup_python.sh python3 .whl .deps exactness
export PYTHONPATH=$PWD/lib:$PWD/.deps
python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_kernels.py tests/test_hash_graphs.py 2>&1 | tail -25 > $OUT/tests.log
timeout 100 python3 benchmarks/bench_gpu_kernels.py --sections oracle --oracle-tokens 1500 --out $OUT/oracle > $OUT/oracle.log 2>&1
tail -20 $OUT/tests.log; tail -20 $OUT/oracle.log
