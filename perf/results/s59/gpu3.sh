# Session 59, second device call (the budget left no room for the whole gpu-test): the tests of every GPU path this
# session changed (the tensor-core kernel's source and launcher, the chw kernels, the backends), then the chw
# tensor-core bench at B=8, L=32K with its variants.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
git rev-parse HEAD
timeout 120 python -P -m pytest -q -ra -p no:cacheprovider -n 14 --dist loadfile tests/test_mma_chw.py \
  tests/test_chw_gather.py tests/test_chw.py tests/test_mma*.py \
  > $OUT/gpu-subset.log 2>&1
echo "pytest rc=$?"; tail -25 $OUT/gpu-subset.log | cut -c1-250
PYTHONPATH=/tmp/site:. timeout 110 python perf/bench_chw_mma.py $OUT/chw_mma.json 8,32768 2>&1 | grep -v "^\s*$" | tail -12
