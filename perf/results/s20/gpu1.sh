# Session 20 device call, kept as run: the folded PSAC rows (PSAC_FOLD) against the per-key path, same source.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -q -x -n 8 tests/test_mma_decode.py tests/test_mma_recipe.py tests/test_kernel_levers.py 2>&1 | tail -4
timeout 300 python3 perf/experiments/mma_occupancy.py --out $OUT/psac_fold_ab.json --min-blocks 2 --programs 0 --fold 1,0 --variants "recipe|recipe without PSAC|recipe, no levers, no PSAC" 2>&1 | grep -v "^ *{" | tail -20
