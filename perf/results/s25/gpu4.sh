# Session 25, call 4: the unit encoder as in call 2 (the error tensor, outliers by torch.topk) with PSAC's products
# taken from the error without transposes; the unit-encoder tests on CUDA, then bench_kernels' encode section.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit
PYTHONSAFEPATH=1 timeout 200 python3 -m pytest -q -ra -p no:cacheprovider -n 4 tests/test_unit_encoder.py 2>&1 | tail -5
timeout 200 python3 perf/bench_kernels.py --only encode --out $OUT/encode4.json 2>&1 | grep -v -i warn | tail -25
