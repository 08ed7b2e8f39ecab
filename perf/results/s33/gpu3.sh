# Session 33, call 3: the heavy-key lever's CUDA paths (unit encoder, graphs, manager), then the chunk encode of
# the recommended spec with `heavy=4` (P25) beside it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -P -m pytest -q -n 8 tests/test_unit_encoder.py tests/test_quantwm.py tests/test_encode_graph.py tests/test_manager.py tests/test_encode_units.py tests/test_mixed_encode_attacks.py 2>&1 | tail -15 | tee $OUT/tests.log
python3 perf/experiments/default_step.py $OUT/default_step.json "$(cat perf/results/s33/p25.spec)" 2>&1 | tail -25 | tee $OUT/default_step.log
