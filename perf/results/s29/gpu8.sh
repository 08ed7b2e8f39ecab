# Session 29, call 8: the engine adapters' tests on CUDA, then the SGLang set with the recipe's page codec encoded
# by the kernels against the torch reference (one device call).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_vllm .whl_vllm/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=.sglang_min:.vllm_min:/tmp/site:/tmp/site_vllm VLLM_CONFIGURE_LOGGING=0 PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -n 8 tests/test_sglang.py tests/test_vllm.py tests/test_unit_encoder.py -k "sglang or vllm or engine_adapters" 2>&1 | tail -6 | tee $OUT/tests.log
SPEC=$(python3 -c "from perf.bench_sglang_gpu import CODECS; print(CODECS[2])" 2>/dev/null || python3 -c "import sys; sys.path.insert(0,'perf'); from bench_sglang_gpu import CODECS; print(CODECS[2])")
i=0; for side in kernels reference; do i=$((i+1))
  timeout 90 python3 perf/experiments/adapter_encode_ab.py $side --out $OUT/sglang_${side}_$i.json --codecs "$SPEC" 2>&1 | grep -v Warning | tail -6 | tee -a $OUT/ab.log
done
