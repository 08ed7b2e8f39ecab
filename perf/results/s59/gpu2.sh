# Session 59, second device call: the chw tensor-core tests (both folds), then the bench on four shapes.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -P -m pytest -q tests/test_mma_chw.py 2>&1 | tail -6
PYTHONPATH=/tmp/site:. timeout 330 python perf/bench_chw_mma.py $OUT/chw_mma.json 8,32768 1,32768 32,8192 8,131072 2>&1 \
  | grep -v "^\s*$" | tail -30
