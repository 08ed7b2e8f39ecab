# Session 46, device call 9: the split search after the review (distinct grids, a 65535 cap) and the tensor-core
# kernel's tests on CUDA, then the A/B of the two variants whose spills the review saw grow (bf16 centroids, 3-bit keys);
# the base source as in ab.sh (git show 86130d7:kernels/mma_decode.cu > perf/results/s46/mma_decode_base.cu).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -x $(python3 -c "import xdist" 2>/dev/null && printf -- '-n 8') tests/test_batch_plan.py tests/test_mma_decode.py tests/test_mma_recipe.py tests/test_paged_decode.py 2>&1 | tail -3
AB_VARIANTS="previous recipe (bf16 centroids, no outliers)|recipe, 3-bit keys" timeout 90 python3 perf/results/s46/ab_codebooks.py $OUT/ab_spills.json perf/results/s46/mma_decode_base.cu 8 2>&1 | grep -v Warning
