# Session 26's last device call: `make gpu-test` on the commit named by $1 (8 test workers; bench_memory left out
# to fit one call), then bench_kernels' encode section with the time left.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_vllm .whl_vllm/*.whl || exit
export PYTHONPATH=.sglang_min:.vllm_min:/tmp/site:/tmp/site_vllm VLLM_CONFIGURE_LOGGING=0 PYTHONUNBUFFERED=1 GPU_TEST_WORKERS=8 GPU_TEST_MEMORY=0
timeout 545 make gpu-test COMMIT=$1 GPU_LOG=$OUT/gpu-test.log
timeout 60 python3 perf/bench_kernels.py --only encode --out $OUT/encode_final.json 2>&1 | grep -v -i warn | tail -12
