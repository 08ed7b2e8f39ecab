#!/usr/bin/env bash
# One device call (session 12): the tests of the paths a decode step's finite checks touch, on CUDA, then the
# transformers decode-step A/B (perf/experiments/decode_step_ab.py) with its one-step profile.
# Run from the repository root with .whl carried:  bash perf/gpu_host_check.sh   (writes under $OUT)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -ra -p no:cacheprovider -n 8 --dist loadfile tests/test_manager.py tests/test_transformers_random.py \
    tests/test_validation.py tests/test_llama_runner.py tests/test_device_codec.py tests/test_cache_integrity.py 2>&1 | tee $OUT/tests.log | tail -6
timeout 200 python3 perf/experiments/decode_step_ab.py --out $OUT/decode_step_ab.json 2>&1 | grep -v "^{" | cut -c1-200 | head -34
