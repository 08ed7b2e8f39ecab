# Session 53's measuring call (carry .whl): the outliers folded into the centroid-value table (OUT_FOLD) and the
# chunk-aligned split grids (fa720f9), neither run on a GPU before. About 330 s; the gpu-test follows in its own call.
# 1. CUDA tests of the fold (its decode against the score term and the reference, crafted outlier fields, stages).
# 2. A/B of the fold at B=8, L=32K (graphs): recipe, recipe without PSAC, the layout without levers.
# 3. The split sweep of the recipe at B=46 and B=9 (its new default grid: splits aligned to the 32-page chunks).
# 4. With SERVING=1: the serving bench's throughput rows.
source perf/results/s49/setup.sh
W=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 8")
echo "== fold tests"
timeout ${FOLD_LIMIT:-120} python3 -P -m pytest -q -x -p no:cacheprovider $W tests/test_mma_recipe.py \
  -k "fold or outlier or stage or pre_rope_keys_match or corrupted" 2>&1 | tail -4 | tee $OUT/fold_tests.txt
echo "== A/B"
timeout ${AB_LIMIT:-150} python3 perf/results/s53/ab_outfold.py $OUT/ab_outfold.json 8 2>&1 | grep "B=8"
echo "== splits"
R=$(python3 -c "import sys; sys.path.insert(0, 'perf'); import bench_serving; print(bench_serving.RECOMMENDED_PAGE_SPEC)")
timeout ${SPLIT_LIMIT:-90} python3 perf/experiments/decode_splits.py --specs "$R" --out $OUT/splits_recipe.json \
  --batches 46,9 --splits 1,2,3,5,8,11,16 2>&1 | grep "splits"
[ "${SERVING:-0}" = 1 ] && timeout 150 python3 perf/bench_serving.py --batches 1 --steps 8 --workload 0 --ttft 0 \
  --anchor 0 --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -22
true
