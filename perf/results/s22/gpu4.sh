# Session 22 device call 4, kept as run: the CUDA gather with a per-row mask for PSAC rows and outliers, default launch shapes per layout (tests), then the
# gather section of bench_kernels (Triton against CUDA through gather_dequant, the recipe's layout included).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pytest -q -x -n 8 tests/test_gather_cuda.py tests/test_gather_dequant.py tests/test_kernel_levers.py 2>&1 | tail -15
KVB_GATHER_VARIANTS="512x4,256x4,256x2" timeout 200 python3 perf/bench_kernels.py --only ceiling,gather --out $OUT/gather.json 2>&1 | grep -v "^ *{" | tail -30
