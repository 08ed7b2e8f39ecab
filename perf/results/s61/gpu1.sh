# Session 61, call 1: Nsight Compute on the chw tensor-core decode and KIVI-2 (perf/ncu_chw.sh), then the gpu-test on
# this commit (every test on CUDA, benches left out) under a limit; a cut run is completed from its done log.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
PYTHONPATH=/tmp/site:$PWD bash perf/ncu_chw.sh $OUT
for k in chw kivi; do PYTHONPATH=/tmp/site:. python3 perf/ncu_lines.py $OUT/${k}_source.csv.gz --top 25 \
    --source kernels/mma_decode.cu 2>&1 | cut -c1-220 | tail -30; done
GPU_TEST_WORKERS=13 GPU_TEST_BENCHES=0 \
  GPU_TEST_DESELECT=tests/test_alignpred_fuzz.py::test_a_stream_decodes_under_another_blas_configuration \
  LIMIT=${LIMIT:-400} bash perf/results/s45/gpu_final.sh ${COMMIT:?}
echo "gpu-test rc=$?"
