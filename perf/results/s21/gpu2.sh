# Session 21 device call 2, kept as run: the outlier term's loads issued together, and page ids and chunk slots read
# one page ahead, against 72dbe51's kernel in the same run. The other source is recreated before the call with:
#   git show 72dbe51:kernels/mma_decode.cu > perf/results/s21/mma_decode_72dbe51.cu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -q -x -n 8 tests/test_mma_decode.py tests/test_mma_recipe.py tests/test_kernel_levers.py tests/test_psac.py tests/test_kernel_known_limits.py 2>&1 | tail -4
timeout 300 python3 perf/experiments/mma_occupancy.py --out $OUT/prefetch_ab.json --min-blocks 2 --programs 0 --variants "recipe|recipe without PSAC|recipe without PSAC, page-relative keys|recipe, no levers, no PSAC" --source s21base=perf/results/s21/mma_decode_72dbe51.cu 2>&1 | grep -v "^ *{" | tail -12
mkdir -p $OUT/recipe && bash perf/ncu_source.sh $OUT/recipe 2>&1 | tail -3
