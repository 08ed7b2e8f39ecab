# Session 23's last device call, kept as run: `make gpu-test` on the commit named by $1 (after the gather changes,
# the crafted-page checks, the file tier's per-blob drop and the fused CPU decode), with 14 test workers and without
# bench_memory (the device time left was about 600 s including the machine's start).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_vllm .whl_vllm/*.whl || exit
export PYTHONPATH=.sglang_min:.vllm_min:/tmp/site:/tmp/site_vllm VLLM_CONFIGURE_LOGGING=0 PYTHONUNBUFFERED=1 GPU_TEST_WORKERS=14 GPU_TEST_MEMORY=0
timeout 470 make gpu-test COMMIT=$1 GPU_LOG=$OUT/gpu-test.log
