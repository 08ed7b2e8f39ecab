# Session 53's measuring call (carry .whl): the outliers folded into the centroid-value table (OUT_FOLD) and the
# chunk-aligned split grids (fa720f9), neither run on a GPU before.
# 1. CUDA tests of the fold (its decode against the score term and the reference, crafted outlier fields, stages).
# 2. A/B of the fold at B=8, L=32K (graphs): recipe, recipe without PSAC, the layout without levers.
# 3. Session 51's next.sh: split sweeps (recipe B=46/24/9, rtn-2 B=46) and the serving bench's throughput rows.
# 4. The CUDA tests of the rest of the changed code, as far as TEST_LIMIT allows.
source perf/results/s49/setup.sh
W=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 8")
echo "== fold tests"
timeout ${FOLD_LIMIT:-120} python3 -P -m pytest -q -x -p no:cacheprovider $W tests/test_mma_recipe.py \
  -k "fold or outlier or stage or pre_rope_keys_match or corrupted" 2>&1 | tail -4 | tee $OUT/fold_tests.txt
echo "== A/B"
timeout ${AB_LIMIT:-150} python3 perf/results/s53/ab_outfold.py $OUT/ab_outfold.json 8 2>&1 | grep "B=8"
echo "== next.sh"
bash perf/results/s51/next.sh
echo "== CUDA tests"
timeout ${TEST_LIMIT:-120} python3 -P -m pytest -q -x -p no:cacheprovider $W tests/test_batch_plan.py tests/test_mma_recipe.py \
  tests/test_mma_whole.py tests/test_mma_k4.py tests/test_kernel_known_limits.py tests/test_quantwm.py tests/test_encode_units.py \
  2>&1 | tail -6 | tee $OUT/tests.txt
