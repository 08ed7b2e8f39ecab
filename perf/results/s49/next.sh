# For the session after 49, on `next/merged` (main with next/overlap, next/plan-cache and next/cache-lock): the CUDA tests
# those branches touch (the manager's row writes, the batch plans, the runner), then the serving bench's throughput section with 8
# timed steps a row and the baseline's drift line (is the recipe's graph tokens/s at its limit >= 2x BF16 beyond the
# drift; do rtn-2's small-batch graph steps come back to session 48's 14-17 ms).
source perf/results/s49/setup.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_manager.py tests/test_batch_plan.py \
  tests/test_llama_runner.py tests/test_query_moments_kernel.py 2>&1 | tail -6 | tee $OUT/tests.txt
timeout ${LIMIT:-380} python3 perf/bench_serving.py --batches 1 --steps 8 --workload 0 --ttft 0 --anchor 0 \
  --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -22
