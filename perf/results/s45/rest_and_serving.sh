# Session 45, device call 2: the quick benches of `make gpu-test` that call 1's limit cut (its pytest part passed:
# 1705 passed, 68 skipped), then #20's serving bench after session 44's batched index-field check.
bash perf/results/s27/gpu_rest.sh $1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout ${LIMIT:-360} python3 perf/bench_serving.py --batches 1 --steps 3 --workload 0 --anchor 0 \
  --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -45
