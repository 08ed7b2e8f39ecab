# Session 57, second device call: the chw tests on CUDA again (tile against direct within fp16 rounding there), the
# bench with both tile variants timed.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python -P -m pytest -q tests/test_chw_gather.py tests/test_chw.py 2>&1 | tail -4
PYTHONPATH=/tmp/site:. timeout 150 python perf/bench_chw_gather.py $OUT/chw_gather.json 2>&1 | grep -v "^\s*$" | tail -8
