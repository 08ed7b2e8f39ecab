# Session 48: `append_step` writes the step's rows with index_copy_ (int64 rows made once per step) instead of an
# index_put_ with int32 page ids and offsets: the CUDA tests of the manager, the step state and the runner, then the
# serving bench's throughput section.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_manager.py tests/test_step_moments.py tests/test_llama_runner.py 2>&1 | tail -6 | tee $OUT/tests.txt
timeout ${LIMIT:-120} python3 perf/bench_serving.py --batches 1 --steps 3 --workload 0 --ttft 0 --anchor 0 \
  --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -16
