# Session 29, call 3: the graphed and mixed encoders' tests on CUDA, then the depth spec's chunk encode in one pass.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -n 8 tests/test_encode_graph.py tests/test_unit_encoder.py tests/test_encode_units.py \
  tests/test_kernel_levers.py tests/test_transformers_random.py tests/test_depth.py tests/test_manager.py 2>&1 | tail -25 | tee $OUT/tests.log
timeout 150 python3 perf/experiments/default_step.py $OUT/default_step.json 2>&1 | tee $OUT/default_step.log
