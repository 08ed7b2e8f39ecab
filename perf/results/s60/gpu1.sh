# Session 60, first device call: the owed gpu-test (every test on CUDA; benches left out to fit the call), then the
# chw tensor-core decode's variants at B=8, L=32K (perf/bench_chw_mma.py) when time is left.
GPU_TEST_WORKERS=13 GPU_TEST_BENCHES=0 \
  GPU_TEST_DESELECT=tests/test_alignpred_fuzz.py::test_a_stream_decodes_under_another_blas_configuration \
  LIMIT=${LIMIT:-470} bash perf/results/s45/gpu_final.sh $(git rev-parse HEAD)
echo "gpu-test rc=$?"
PYTHONPATH=/tmp/site:. timeout ${BENCH_LIMIT:-100} python perf/bench_chw_mma.py $OUT/chw_mma.json 8,32768 2>&1 \
  | grep -v "^\s*$" | cut -c1-400 | tail -40
