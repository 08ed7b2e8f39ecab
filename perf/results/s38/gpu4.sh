# Session 38's last device call (carry `.whl`); $1: commit. The tensor-core kernel's new 4-bit pre-RoPE key path and
# its whole-row path against the reference (call 1's two whole-row failures: an lse tolerance, fixed); then the
# decode step alone of the recommended spec beside p27l18k4b (4-bit keys in layer 18) with the 4-bit path off (that
# layer on the plain Triton kernel) and on (--k4); then the quality spec with whole rows on the tensor-core kernel.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
{ echo "commit $1"; timeout 100 python3 -P -m pytest -q -n 8 tests/test_mma_k4.py tests/test_mma_whole.py 2>&1 | tail -6; } \
  | tee $OUT/tests.log
timeout 150 python3 perf/results/s38/step_only.py $OUT/step_only.json --k4 "$(cat perf/results/s37/p27l18k4b.spec)" 2>&1 \
  | grep -v Warn | tee $OUT/step.log
KVBACKEND_CUDA_WHOLE=1 python3 perf/results/s38/step_only.py $OUT/step_quality.json \
  "$(python3 -c 'from kvbackend.spec import QUALITY_SPEC as q; print(q)')" 2>&1 | grep -v Warn | tee $OUT/step_quality.log
