# Session 45, device call 4: the serving-step profile after the query check follows check_finite, then the serving
# bench's capacity and throughput section.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 perf/experiments/serving_step_profile.py --out $OUT/step_profile.json 2>&1 | grep -v Warning | grep -v "^ \|^$\|ncalls\|Ordered\|List reduced\|function calls"
timeout ${LIMIT:-300} python3 perf/bench_serving.py --batches 1 --steps 3 --workload 0 --ttft 0 --anchor 0 \
  --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -12
