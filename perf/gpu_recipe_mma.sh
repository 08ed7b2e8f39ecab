#!/usr/bin/env bash
# One device call for the tensor-core kernel on the recipe's layout: its GPU tests (and the other decode-kernel
# tests, since `paged_decode` picks it for these layouts), then the kernel bench's decode and levers sections with
# pre-RoPE keys and PSAC rows read by the tensor-core kernel (its default since session 11).
# Run from the repository root with .whl carried:  bash perf/gpu_recipe_mma.sh   (writes under $OUT)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
timeout 280 python3 -m pytest -q -ra -p no:cacheprovider -n 4 --dist loadfile tests/test_mma_recipe.py tests/test_mma_decode.py \
    tests/test_kernel_levers.py tests/test_paged_decode.py tests/test_kernel_known_limits.py tests/test_transformers_random.py tests/test_llama_runner.py 2>&1 | tee $OUT/tests.log | tail -25
KVB_BENCH_QUICK=1 timeout 250 python3 perf/bench_kernels.py --only ceiling,decode,levers \
    --lever-shapes 8x32768 --out $OUT/bench_kernels_recipe_mma.json 2>&1 | tee $OUT/bench.log | grep -v "^  levers"
