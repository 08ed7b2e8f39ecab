# Session 32, call 6: the CUDA gather with a per-row set of key outliers (each run tests its row's outliers, not
# all 16 of its head's): gather tests on CUDA, then an A/B against the source before (head: 0b598c6's kernel).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
[ -n "$SKIP_TESTS" ] || timeout 200 python3 -P -m pytest -q -n 8 tests/test_gather_cuda.py tests/test_gather_dequant.py tests/test_kernel_levers.py 2>&1 | tail -3 | tee $OUT/tests.log
# the base: this tree's kernel with gather_outlier_set.patch reverted (as run: a full copy of 0b598c6's)
mkdir -p /tmp/base && cp kernels/gather_dequant.cu /tmp/base/gather_dequant.cu && patch -s -R /tmp/base/gather_dequant.cu perf/results/s32/gather_outlier_set.patch
(cd perf && timeout 150 python3 results/s32/ab_gather.py $OUT/ab_gather.json head=/tmp/base/gather_dequant.cu 2>&1 | grep -v Warn | tee $OUT/ab.log)
