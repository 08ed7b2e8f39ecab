# Session 45, device call 3: the serving decode step profiled per cache (perf/experiments/serving_step_profile.py),
# the recommended page codec with the batched query statistics and with the per-request ones, in one run.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout ${LIMIT:-400} python3 perf/experiments/serving_step_profile.py --out $OUT/step_profile.json 2>&1 | grep -v Warning
