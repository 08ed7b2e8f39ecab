# Session 28, call 1: 3-bit pre-RoPE keys in the tensor-core kernel. The kernel tests on CUDA (the new 3-bit cases
# against the torch reference), then the quick levers rows at B=8, L=32K (the recipe, its 3-bit-key layer, the bases).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 3
git rev-parse HEAD 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONSAFEPATH=1 timeout 300 python3 -m pytest -q -ra -p no:cacheprovider -n 8 --dist loadfile \
    tests/test_mma_recipe.py tests/test_mma_decode.py tests/test_kernel_levers.py tests/test_paged_decode.py \
    tests/test_depth.py 2>&1 | tail -25
KVB_BENCH_QUICK=1 timeout 240 python3 perf/bench_kernels.py --only ceiling,levers --out $OUT/levers.json 2>&1 | grep -v "^  " | tail -30
