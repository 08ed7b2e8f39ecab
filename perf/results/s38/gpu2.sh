# Session 38's second GPU call (carry `.whl`): session 35's whole-row CUDA tests, then the decode step and chunk
# encode of the recommended and quality specs beside session 37's candidate default (p27l18k4b: 4-bit keys in layer
# 18), with the tensor-core kernel's whole-row path off and on (KVBACKEND_CUDA_WHOLE=1).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 220 python3 -P -m pytest -q -n 8 tests/test_mma_whole.py tests/test_mma_recipe.py tests/test_kernel_levers.py \
  tests/test_gather_cuda.py tests/test_encode_graph.py tests/test_fastdecode.py 2>&1 | tail -5 | tee $OUT/tests.log
SPEC=$(cat perf/results/s37/p27l18k4b.spec)
timeout 170 python3 perf/experiments/default_step.py $OUT/default_step.json "$SPEC" 2>&1 | grep -v Warn | tee $OUT/step.log
KVBACKEND_CUDA_WHOLE=1 timeout 170 python3 perf/experiments/default_step.py $OUT/default_step_whole.json "$SPEC" 2>&1 \
  | grep -v Warn | tee $OUT/step_whole.log
