# Session 35's first GPU call, for the next session with a device (none was lent in session 35). Carry `.whl`
# (crc32c and constriction wheels for the device's Python). Whole key rows on CUDA: the tensor-core kernel's whole-row
# path against the reference and the plain Triton kernel, the CUDA encode-graph whole cases, then the decode step of
# the quality spec (10 of 32 layers with whole rows) beside the recommended spec's, with the whole-row path off
# (those layers on the plain Triton kernel) and on (KVBACKEND_CUDA_WHOLE=1).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 260 python3 -P -m pytest -q -n 8 tests/test_mma_whole.py tests/test_mma_recipe.py tests/test_kernel_levers.py \
  tests/test_gather_cuda.py tests/test_encode_graph.py tests/test_fastdecode.py 2>&1 | tail -5 | tee $OUT/tests.log
timeout 150 python3 perf/experiments/default_step.py $OUT/default_step.json 2>&1 | grep -v Warn | tee $OUT/step.log
KVBACKEND_CUDA_WHOLE=1 timeout 150 python3 perf/experiments/default_step.py $OUT/default_step_whole.json 2>&1 \
  | grep -v Warn | tee $OUT/step_whole.log
