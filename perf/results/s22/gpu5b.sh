# perf/results/s22/gather_fast.cu (not kept: the same as kernels/gather_dequant.cu plus a patch) is recreated first with
#   cp kernels/gather_dequant.cu perf/results/s22/gather_fast.cu && patch perf/results/s22/gather_fast.cu perf/results/s22/gather_fast.patch
# Session 22 device call 5 (the short form that fit the last 240 s of device time), kept as run: (1) the CUDA tests of
# this session's launcher fixes and the new lever cases at other head sizes; (2) the quick gather bench with the
# committed kernel, then with perf/results/s22/gather_fast.cu copied over it (device copy only), then that variant's
# exactness tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 KVB_BENCH_QUICK=1
timeout 60 python3 -m pytest -q -x -n 12 tests/test_gather_cuda.py tests/test_mma_decode.py 2>&1 | tail -2
timeout 25 python3 perf/bench_kernels.py --only ceiling,gather --out $OUT/gather_a.json 2>&1 | grep "^gather"
cp perf/results/s22/gather_fast.cu kernels/gather_dequant.cu
timeout 25 python3 perf/bench_kernels.py --only ceiling,gather --out $OUT/gather_b.json 2>&1 | grep "^gather"
timeout 40 python3 -m pytest -q -x -n 12 tests/test_gather_cuda.py -k "exactly or lever" 2>&1 | tail -2
