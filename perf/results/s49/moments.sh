# Session 49: the step query statistics kernel (kernels/query_moments.py) and index_copy_ row writes: the CUDA tests
# of the kernel, the manager, the step state and the runner, then the serving bench's throughput section for the
# recipe with the kernel off (KVBACKEND_STEP_KERNEL=0: the torch path, index_copy_ rows) and on, BF16 and rtn-2 once.
source perf/results/s49/setup.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_query_moments_kernel.py tests/test_manager.py \
  tests/test_step_moments.py tests/test_llama_runner.py 2>&1 | tail -6 | tee $OUT/tests.txt
ARGS="--batches 1 --steps 3 --workload 0 --ttft 0 --anchor 0"
RECIPE=$(python3 -c "import sys; sys.path.insert(0, 'perf'); import bench_serving as b; print(b.CACHES[-1])")
KVBACKEND_STEP_KERNEL=0 timeout ${LIMIT:-150} python3 perf/bench_serving.py $ARGS --caches "identity|$RECIPE" \
  --out $OUT/torch_moments.json 2>&1 | grep -v Warning | tail -8
timeout ${LIMIT:-150} python3 perf/bench_serving.py $ARGS --out $OUT/kernel_moments.json --plot $OUT/bench_serving.png \
  2>&1 | grep -v Warning | tail -12
