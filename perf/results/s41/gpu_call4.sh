# Session 41's last device call (carry .whl .whl_vllm .sglang_min .vllm_min): the SGLang bench of the recipe's page
# codec with full-batch warm-up and five rounds, the get rounds again (the index check now read by numpy), then the
# test files of the SGLang and vLLM adapters and the page check on CUDA, each part under its own limit.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_vllm .whl_vllm/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=.:.sglang_min:.vllm_min:/tmp/site:/tmp/site_vllm VLLM_CONFIGURE_LOGGING=0 PYTHONUNBUFFERED=1
recipe=$(python3 -c "import sys; sys.path.insert(0, 'perf'); from bench_sglang_gpu import CODECS; print(CODECS[-1])")
timeout 75 python3 perf/bench_sglang_gpu.py --out $OUT/bench_sglang_gpu.json --codecs "$recipe" 2>&1 | grep -v 'stores 4.83'
timeout 45 python3 perf/experiments/sglang_get_rounds.py $OUT/rounds.json --gets 3 2>&1 | grep -v 'stores 4.83' | grep -v "^ \|^--\|^=\|Name\|Self" 
workers=(); python3 -c 'import xdist' 2>/dev/null && workers=(-n 8 --dist loadfile)
timeout 60 python3 -P -m pytest -q -p no:cacheprovider "${workers[@]}" tests/test_crafted_pages.py tests/test_sglang.py \
  tests/test_unit_gather.py tests/test_vllm.py 2>&1 | tail -4
