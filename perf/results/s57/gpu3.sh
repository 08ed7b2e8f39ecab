# Session 57 (little device time left): the chw tests on CUDA and the chw gather/decode bench.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
git rev-parse HEAD 2>/dev/null
timeout 150 python -P -m pytest -q -x tests/test_chw_gather.py tests/test_chw.py tests/test_layer_plan.py 2>&1 | tail -5
PYTHONPATH=/tmp/site:. timeout 200 python perf/bench_chw_gather.py $OUT/chw_gather.json 2>&1 | grep -v "^\s*$" | tail -12
