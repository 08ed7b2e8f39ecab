# Session 20 device call 2, kept as run: the PSAC basis as fp16 pairs (one HFMA2 per rank) against 3406894's kernel.
#   the other source (--source) is kernels/mma_decode.cu at 3406894, recreated before the call with:
#   git show 3406894:kernels/mma_decode.cu > perf/results/s20/mma_decode_3406894.cu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python3 -m pytest -q -x -n 8 tests/test_mma_decode.py tests/test_mma_recipe.py tests/test_kernel_levers.py tests/test_psac.py 2>&1 | tail -4
timeout 300 python3 perf/experiments/mma_occupancy.py --out $OUT/psac_pairs_ab.json --min-blocks 2 --programs 0 --variants "recipe|recipe without PSAC" --source s20call1=perf/results/s20/mma_decode_3406894.cu 2>&1 | grep -v "^ *{" | tail -20
