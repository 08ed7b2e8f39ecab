# Session 31, call 1: branch next/mixed-graph's code back on main (the mixed pass replayed from a CUDA graph):
# its tests on CUDA, then default_step.py (the recommended spec's decode step and chunk encode).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
git rev-parse HEAD >> $OUT/device.txt
timeout 150 python3 -m pytest -q -n 6 -P tests/test_encode_graph.py tests/test_mixed_encode_attacks.py tests/test_unit_encoder.py 2>&1 | tail -8 | tee $OUT/tests.log
timeout 150 python3 perf/experiments/default_step.py $OUT/default_step.json 2>&1 | tee $OUT/default_step.log
