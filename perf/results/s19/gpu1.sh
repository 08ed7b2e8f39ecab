# Session 19 device call, kept as run. The other source (--source) was kernels/mma_decode.cu at be1e13d:
#   git show be1e13d:kernels/mma_decode.cu > <path given to --source>
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -q -x tests/test_mma_decode.py tests/test_mma_recipe.py tests/test_kernel_levers.py 2>&1 | tail -4
timeout 300 python3 perf/experiments/mma_occupancy.py --out $OUT/mma_outlier_ab.json --min-blocks 2 --programs 0 --variants all --source before=perf/results/s19/mma_decode_before.cu 2>&1 | grep -v "^ *{" | tail -40
