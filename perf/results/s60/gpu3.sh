# Session 60: the gpu-test on this commit (every test on CUDA, benches left out), with the chw bench's probe variants
# compiled beside it, then the probes timed (perf/bench_chw_mma.py: default, key rows 5 r mod 64, key row 0).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export CHW_VARIANTS=${CHW_VARIANTS:-probe_rows_5r,probe_row_0}
PYTHONPATH=/tmp/site:. python perf/bench_chw_mma.py --precompile > $OUT/precompile.log 2>&1 &
GPU_TEST_WORKERS=13 GPU_TEST_BENCHES=0 \
  GPU_TEST_DESELECT=tests/test_alignpred_fuzz.py::test_a_stream_decodes_under_another_blas_configuration \
  LIMIT=${LIMIT:-480} bash perf/results/s45/gpu_final.sh ${COMMIT:-$(git rev-parse HEAD)}
echo "gpu-test rc=$?"
wait
tail -2 $OUT/precompile.log
PYTHONPATH=/tmp/site:. timeout ${BENCH_LIMIT:-90} python perf/bench_chw_mma.py $OUT/chw_probe.json 8,32768 2>&1 \
  | grep -v "^\s*$" | cut -c1-300 | grep -v '^{' | tail -20
