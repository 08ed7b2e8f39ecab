# Session 21 device call 3, kept as run: the PSAC rows' per-page pass with eight lanes per row (the rows' chains side
# by side) against 26e3a32's kernel in the same run. The other source is recreated before the call with:
#   git show 26e3a32:kernels/mma_decode.cu > perf/results/s21/mma_decode_26e3a32.cu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -x -n 8 tests/test_mma_recipe.py tests/test_psac.py tests/test_kernel_levers.py 2>&1 | tail -2
timeout 300 python3 perf/experiments/mma_occupancy.py --out $OUT/psac_lanes_ab.json --min-blocks 2 --programs 0 --variants "recipe|recipe without PSAC|recipe, no levers, no PSAC" --source s21call2=perf/results/s21/mma_decode_26e3a32.cu 2>&1 | grep -v "^ *{" | tail -8
