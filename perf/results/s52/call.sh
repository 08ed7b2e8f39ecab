# Session 52's one measuring call (carry .whl), run with perf/results/s51/aligned_splits.patch applied to the tree
# (not committed: no make gpu-test could run on it): session 51's next.sh (the split sweeps of the recipe at B=46, 24
# and 9 and of rtn-2 at B=46, then the serving bench's throughput rows), then the CUDA tests of the code this session
# changed (the split plan, the tensor-core decode of the recipe, the codecs' encode on the device).
bash perf/results/s51/next.sh
echo "== CUDA tests"
W=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 8")
PYTHONPATH=/tmp/site:$PYTHONPATH timeout ${TEST_LIMIT:-150} python3 -P -m pytest -q -x -p no:cacheprovider $W tests/test_batch_plan.py tests/test_mma_recipe.py \
  tests/test_quantwm.py tests/test_encode_units.py tests/test_device_codec.py 2>&1 | tail -6
