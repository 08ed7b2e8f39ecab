# Session 31, call 5: R(p0) read as 16-byte loads in the pre-RoPE page pass: kernel tests on CUDA, an A/B against
# call 4's kernel (v1) and the session's first (base), then default_step.py (the recommended spec's decode step).
# (As run then. The kernel copies it names were replaced by git refs later in the session: mma_decode_base.cu is
# git:644be22, mma_decode_v2.cu git:bcf117e, mma_decode_v1.cu git:bcf117e with mma_decode_v1.patch; see ab_decode.py.)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 200 python3 -P -m pytest -q -n 8 tests/test_mma_decode.py tests/test_mma_recipe.py tests/test_kernel_known_limits.py tests/test_psac.py 2>&1 | tail -4 | tee $OUT/tests.log
(cd perf && timeout 200 python3 results/s31/ab_decode.py $OUT/ab_decode.json v1=results/s31/mma_decode_v1.cu base=results/s31/mma_decode_base.cu 2>&1 | grep -v Warn | tee $OUT/ab.log)
timeout 120 python3 perf/experiments/default_step.py $OUT/default_step.json 2>&1 | tee $OUT/default_step.log
