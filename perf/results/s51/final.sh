# Session 51's one device call (carry .whl, .whl_vllm, .sglang_min, .vllm_min, out/mma_decode_base.cu): `make
# gpu-test` on the commit named by $1 (13 workers, benches apart, under LIMIT), then this tree's tensor-core decode
# against main's before the session's two kernel changes (out/mma_decode_base.cu = 126dd00~1's source), the recipe
# and the recipe's layout without levers at B=8 with graphs (max |diff| and us of each, sources alternating).
GPU_TEST_WORKERS=${GPU_TEST_WORKERS:-13} GPU_TEST_BENCHES=0 \
  GPU_TEST_DESELECT=tests/test_alignpred_fuzz.py::test_a_stream_decodes_under_another_blas_configuration \
  LIMIT=${LIMIT:-440} bash perf/results/s45/gpu_final.sh $1
echo "== A/B"
export PYTHONPATH=/tmp/site:$PYTHONPATH
AB_VARIANTS="recipe|recipe, no levers, no PSAC" timeout ${AB_LIMIT:-120} python3 perf/results/s46/ab_codebooks.py \
  $OUT/ab_base.json out/mma_decode_base.cu 8 2>&1 | grep "B=8"
