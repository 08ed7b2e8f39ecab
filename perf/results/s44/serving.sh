# Session 44, device call 1: the value-range tests on CUDA (the saturation read in each field's width, the in-pool
# read of encode_chunk), then #20's serving bench at the current code (last run: session 17).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider tests/test_value_range.py 2>&1 | tail -4
timeout ${LIMIT:-420} python3 perf/bench_serving.py --batches 1 --steps 3 --workload 0 --anchor 0 \
  --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -45
