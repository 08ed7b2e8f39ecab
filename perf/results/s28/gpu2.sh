# Session 28, call 2: the CUDA tests of the 3-bit decode and encode paths, then the default-spec step probe.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 3
PYTHONSAFEPATH=1 timeout 280 python3 -m pytest -q -ra -p no:cacheprovider -n 8 --dist loadfile \
    tests/test_mma_recipe.py tests/test_mma_decode.py tests/test_unit_encoder.py tests/test_encode_kernel.py \
    tests/test_encode_units.py tests/test_depth.py tests/test_kernel_levers.py 2>&1 | tail -15
timeout 250 python3 perf/experiments/default_step.py $OUT/default_step.json 2>&1 | tail -30
