# Session 23 first device call, kept as run: `make gpu-test` on the commit named by $1 (after session 22's
# gather variant was merged).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_vllm .whl_vllm/*.whl || exit
export PYTHONPATH=.sglang_min:.vllm_min:/tmp/site:/tmp/site_vllm VLLM_CONFIGURE_LOGGING=0 PYTHONUNBUFFERED=1
timeout 585 make gpu-test COMMIT=$1 GPU_LOG=$OUT/gpu-test.log
