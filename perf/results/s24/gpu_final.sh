# Session 24's last device call: `make gpu-test` on the commit named by $1 (8 test workers; bench_memory left out
# to fit one call), then the encode probe (`perf/experiments/encode_graph_probe.py`) with what time is left.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_vllm .whl_vllm/*.whl || exit
export PYTHONPATH=.sglang_min:.vllm_min:/tmp/site:/tmp/site_vllm VLLM_CONFIGURE_LOGGING=0 PYTHONUNBUFFERED=1 GPU_TEST_WORKERS=8 GPU_TEST_MEMORY=0
timeout 565 make gpu-test COMMIT=$1 GPU_LOG=$OUT/gpu-test.log
timeout 28 python3 perf/experiments/encode_graph_probe.py --out $OUT/encode_graph_probe3.json 2>&1 | grep -v Warning | tail -30
