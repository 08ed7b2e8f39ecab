# Session 32, call 1: kernel tests on CUDA (the fold rows' shared body; the new 16-row fold and corrupted-id cases),
# the encode-graph tests, an A/B of this tree's kernel against session 31's last (head) and against a timing-only
# probe whose page copies read a head-major code layout (hm: wrong values, right bytes), then the recommended step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 220 python3 -P -m pytest -q -n 8 tests/test_mma_decode.py tests/test_mma_recipe.py tests/test_kernel_known_limits.py tests/test_psac.py tests/test_encode_graph.py 2>&1 | tail -4 | tee $OUT/tests.log
# (as run, the probe was a full copy; it is kernels/mma_decode.cu at 1d05e61 with probe_headmajor.patch)
mkdir -p /tmp/hm && cp kernels/mma_decode.cu /tmp/hm/mma_decode.cu && patch -s /tmp/hm/mma_decode.cu perf/results/s32/probe_headmajor.patch
(cd perf && timeout 180 python3 results/s31/ab_decode.py $OUT/ab_decode.json head=git:9370fb9 hm=/tmp/hm/mma_decode.cu 2>&1 | grep -v Warn | tee $OUT/ab.log)
timeout 150 python3 perf/experiments/default_step.py $OUT/default_step.json 2>&1 | grep -v Warn | tail -8 | tee $OUT/default_step.log
