# Session 38's second device call (carry `.whl`, `.whl_vllm`, `.sglang_min`, `.vllm_min`); $1: commit. The whole-row
# tensor-core tests (call 1's two failures: an lse tolerance), the decode step and chunk encode of the recommended and
# quality specs beside p27l18k4b, whole rows on the tensor-core kernel (KVBACKEND_CUDA_WHOLE=1: the quality spec's
# whole-row layers; the other specs have none), (the benches call 1 cut left out: device time).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_vllm .whl_vllm/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
{ echo "commit $1"; timeout 80 python3 -P -m pytest -q -n 8 tests/test_mma_whole.py 2>&1 | tail -4; } | tee $OUT/tests.log
SPEC=$(cat perf/results/s37/p27l18k4b.spec)
KVBACKEND_CUDA_WHOLE=1 timeout 160 python3 perf/experiments/default_step.py $OUT/default_step_whole.json "$SPEC" 2>&1 \
  | grep -v Warn | tee $OUT/step_whole.log
# SECTIONS=levers,gather timeout 120 bash perf/results/s27/gpu_rest.sh $1 | tail -30
