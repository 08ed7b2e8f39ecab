# Session 25, call 3: as call 2, with QuantWM's outliers and PSAC products made inside the encode kernel
# (no error tensor), then bench_kernels' encode section (the recipe with the kernels and the reference).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_vllm .whl_vllm/*.whl || exit
export PYTHONPATH=.sglang_min:.vllm_min:/tmp/site:/tmp/site_vllm VLLM_CONFIGURE_LOGGING=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit
PYTHONSAFEPATH=1 timeout 330 python3 -m pytest -q -ra -p no:cacheprovider -n 8 --dist loadfile tests/test_unit_encoder.py tests/test_encode_kernel.py tests/test_encode_units.py tests/test_transformers_attacks.py tests/test_psac.py tests/test_quantwm.py 2>&1 | tail -30
timeout 200 python3 perf/bench_kernels.py --only encode --out $OUT/encode3.json 2>&1 | grep -v -i warn | tail -45
