# Session 57: the chw gather/decode bench (and the chw tests on CUDA), then `make gpu-test` under the time left in
# the call (completed by a later call from its done log where the limit cuts it).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=/tmp/site:. timeout 170 python perf/bench_chw_gather.py $OUT/chw_gather.json 2>&1 | grep -v "^\s*$" | tail -12
GPU_TEST_WORKERS=13 GPU_TEST_BENCHES=0 \
GPU_TEST_DESELECT=tests/test_alignpred_fuzz.py::test_a_stream_decodes_under_another_blas_configuration \
LIMIT=${LIMIT:-380} bash perf/results/s45/gpu_final.sh $1
