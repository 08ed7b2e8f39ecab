# Session 31, call 4: the decode kernel's pre-RoPE key path with centroid values read as 16-byte quads, ids checked
# and folded once per page, scale/zero pairs in registers (16-byte loads): its tests on CUDA, then an A/B against
# the session's first kernel (perf/results/s31/mma_decode_base.cu), alternating over two rounds.
# (As run then. The kernel copies it names were replaced by git refs later in the session: mma_decode_base.cu is
# git:644be22, mma_decode_v2.cu git:bcf117e, mma_decode_v1.cu git:bcf117e with mma_decode_v1.patch; see ab_decode.py.)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 240 python3 -P -m pytest -q -n 8 tests/test_mma_decode.py tests/test_mma_recipe.py tests/test_kernel_known_limits.py tests/test_kernel_levers.py tests/test_psac.py 2>&1 | tail -8 | tee $OUT/tests.log
cd perf && timeout 280 python3 results/s31/ab_decode.py $OUT/ab_decode.json results/s31/mma_decode_base.cu 2 2>&1 | grep -v Warn | tee $OUT/ab.log
