# Session 60: the chw tensor-core decode's variants checked (tests/test_mma_chw.py; V_SUBN in
# tests/test_mma_decode.py) and timed at B=8, L=32K (perf/bench_chw_mma.py, every variant compiled first, at once).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
git rev-parse HEAD
PYTHONPATH=/tmp/site:. timeout ${BENCH_LIMIT:-300} python perf/bench_chw_mma.py $OUT/chw_mma.json 8,32768 2>&1 \
  | grep -v "^\s*$" | cut -c1-300 | tail -45
timeout ${TEST_LIMIT:-200} python -P -m pytest -q -ra -p no:cacheprovider -n 14 --dist loadfile tests/test_mma_chw.py \
  tests/test_mma_decode.py > $OUT/gpu-subset.log 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/gpu-subset.log | cut -c1-250 | tail -25
