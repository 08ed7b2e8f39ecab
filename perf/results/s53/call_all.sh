# Session 53, one call for everything (carry .whl .whl_vllm .sglang_min .vllm_min): the fold's A/B at B=8 (about
# 100 s), then the gpu-test at commit $1 under what is left of the call (LIMIT, default 440 s), 13 workers, no benches.
source perf/results/s49/setup.sh
start=$(date +%s)
echo "== A/B"
timeout ${AB_LIMIT:-120} python3 perf/results/s53/ab_outfold.py $OUT/ab_outfold.json 8 2>&1 | grep "B=8"
left=$(( ${TOTAL:-575} - ($(date +%s) - start) ))
echo "== gpu-test, limit $left s"
GPU_TEST_WORKERS=13 GPU_TEST_BENCHES=0 \
  GPU_TEST_DESELECT=tests/test_alignpred_fuzz.py::test_a_stream_decodes_under_another_blas_configuration \
  LIMIT=$left bash perf/results/s45/gpu_final.sh $1
