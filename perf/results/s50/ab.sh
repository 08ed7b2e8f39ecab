# Session 50: where the recipe's small-batch graph steps went (30.4 ms at B=1 in call 1 against 20.3 in s49): the
# graph-step host profile at B=1 and B=46, main before the merge (5ed5364, made by make_base.sh under the ignored
# out/s50base) against HEAD, interleaved, and at HEAD the in-place statistics switched off and on.
source perf/results/s49/setup.sh
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_query_moments_kernel.py 2>&1 | tail -3 | tee $OUT/tests.txt
RECIPE=$(python3 -c "import sys; sys.path.insert(0, 'perf'); import bench_serving; print(bench_serving.RECOMMENDED_PAGE_SPEC)")
PYTHONPATH=out/s50base:/tmp/site python3 -c "import kvbackend; print(\"base:\", kvbackend.__file__)"
for B in ${BATCHES:-1 46}; do
  PYTHONPATH=out/s50base:/tmp/site timeout 150 python3 perf/experiments/graph_step_host.py --caches "$RECIPE" \
    --batch $B --out $OUT/base_B$B.txt 2>&1 | grep -v Warning | grep "graph step"
  timeout 150 python3 perf/experiments/graph_step_host.py --caches "$RECIPE" --batch $B --switch KVBACKEND_STEP_PARTS \
    --out $OUT/head_B$B.txt 2>&1 | grep -v Warning | grep "graph step\|KVBACKEND"
done
# the split-K grid at the serving batches after session 46's centroid loads (is the default still the best grid?)
timeout 200 python3 perf/experiments/decode_splits.py --out $OUT/decode_splits.json --batches ${SPLIT_BATCHES:-24,46} \
  --splits 1,2,3,4,5,8,16 2>&1 | grep "splits"
