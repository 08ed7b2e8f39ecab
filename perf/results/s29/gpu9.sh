# Session 29, call 9: the mixed pass replayed from a CUDA graph (tests on CUDA, then default_step.py).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 50 python3 -m pytest -q -n 6 tests/test_encode_graph.py 2>&1 | tail -8 | tee $OUT/tests.log
timeout 80 python3 perf/experiments/default_step.py $OUT/default_step.json 2>&1 | tee $OUT/default_step.log
