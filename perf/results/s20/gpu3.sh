# Session 20 device call 3, kept as run: the folded rows' tokens in registers (no token map), against 3406894's kernel.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -q -x -n 8 tests/test_mma_decode.py tests/test_mma_recipe.py 2>&1 | tail -4
timeout 300 python3 perf/experiments/mma_occupancy.py --out $OUT/psac_regmap_ab.json --min-blocks 2 --programs 0 --variants "recipe" --source s20call1=perf/results/s20/mma_decode_3406894.cu 2>&1 | grep -v "^ *{" | tail -20
