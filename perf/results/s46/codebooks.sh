# Session 46, device call 4: the codebook-slot table build, its tests on CUDA and the A/B against the kernel before;
# then the kernel benchmark's decode and levers sections on the new layout (a slot per 32-page chunk).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -q -x $(python3 -c "import xdist" 2>/dev/null && printf -- '-n 8') tests/test_mma_decode.py tests/test_mma_recipe.py tests/test_mma_whole.py tests/test_mma_k4.py tests/test_kernel_levers.py 2>&1 | tail -4
timeout 200 python3 perf/results/s46/ab_codebooks.py $OUT/ab_codebooks.json $1 8 46 2>&1 | grep -v Warning
KVB_BENCH_QUICK=1 timeout 120 python3 perf/bench_kernels.py --only ceiling,levers --out $OUT/levers.json 2>&1 | grep -v Warning | tail -12
