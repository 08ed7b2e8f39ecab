# Session 20's last device call, kept as run: the A/B of the folded rows' tokens in registers (against 3406894's
# kernel, recipe only), then `make gpu-test` on the commit named by $1.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_vllm .whl_vllm/*.whl || exit
export PYTHONPATH=.sglang_min:.vllm_min:/tmp/site:/tmp/site_vllm VLLM_CONFIGURE_LOGGING=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 70 python3 perf/experiments/mma_occupancy.py --out $OUT/psac_regmap_ab.json --min-blocks 2 --programs 0 --variants "recipe" --source s20call1=perf/results/s20/mma_decode_3406894.cu 2>&1 | grep -v "^ *{" | tail -5
timeout 515 make gpu-test COMMIT=$1 GPU_LOG=$OUT/gpu-test.log
