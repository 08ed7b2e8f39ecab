# Session 38's last device call (carry `.whl`); $1: commit. The decode step alone of the recommended spec beside
# p27l18k4b (4-bit keys in layer 18, which the tensor-core kernel does not read), then the quality spec with whole
# rows on the tensor-core kernel (KVBACKEND_CUDA_WHOLE=1), then the whole-row tensor-core tests (call 1's two
# failures: an lse tolerance, fixed); in that order, since the session's device time may cut the call.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 perf/results/s38/step_only.py $OUT/step_only.json "$(cat perf/results/s37/p27l18k4b.spec)" 2>&1 \
  | grep -v Warn | tee $OUT/step.log
KVBACKEND_CUDA_WHOLE=1 python3 perf/results/s38/step_only.py $OUT/step_quality.json \
  "$(python3 -c 'from kvbackend.spec import QUALITY_SPEC as q; print(q)')" 2>&1 | grep -v Warn | tee $OUT/step_quality.log
{ echo "commit $1"; timeout 75 python3 -P -m pytest -q -n 8 tests/test_mma_whole.py 2>&1 | tail -4; } | tee $OUT/tests.log
