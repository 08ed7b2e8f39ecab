# Session 46, device call 2: the tensor-core decode's split-K grid (BatchPlan.wave_splits): its kernel tests on CUDA,
# the split sweep at serving batch sizes, then the serving step's profile and the serving bench's throughput section.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python3 -m pytest -q -x $(python3 -c "import xdist" 2>/dev/null && printf -- '-n 8') tests/test_batch_plan.py tests/test_mma_decode.py 2>&1 | tail -4
timeout 200 python3 perf/experiments/decode_splits.py --out $OUT/decode_splits.json 2>&1 | grep -v Warning
SPEC=$(python3 -c "from kvbackend.spec import RECOMMENDED_PAGE_SPEC as s; print(s)")
timeout 150 python3 perf/experiments/serving_step_profile.py --out $OUT/step_profile.json \
  --caches "rtn:bits=2,group=64:45|$SPEC:46" 2>&1 | grep -v Warning | grep "B=\|batch" | head -20
timeout 200 python3 perf/bench_serving.py --batches 1 --steps 3 --workload 0 --ttft 0 --anchor 0 \
  --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -12
