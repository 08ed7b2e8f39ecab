# For the session after 51, with perf/results/s51/aligned_splits.patch applied and committed (`git apply` it): the
# split sweep of the recipe at B=9, 24 and 46 (its new default grid: splits aligned to the 32-page chunks, against
# fixed split counts) and of rtn-2 at B=46 (its grid unchanged), then the serving bench's throughput rows (graphs).
# Carry .whl. About 200 s; then `make gpu-test` at the same commit (perf/results/s51/final.sh without its A/B part).
source perf/results/s49/setup.sh
R=$(python3 -c "import sys; sys.path.insert(0, 'perf'); import bench_serving; print(bench_serving.RECOMMENDED_PAGE_SPEC)")
timeout 120 python3 perf/experiments/decode_splits.py --specs "$R" --out $OUT/splits_recipe.json --batches 46,24,9 \
  --splits 1,2,3,4,5,8,11,16 2>&1 | grep "splits"
timeout 40 python3 perf/experiments/decode_splits.py --specs "rtn:bits=2,group=64" --out $OUT/splits_rtn.json \
  --batches 46 --splits 1,2,3,5,8,16 2>&1 | grep "splits"
timeout 150 python3 perf/bench_serving.py --batches 1 --steps 8 --workload 0 --ttft 0 --anchor 0 \
  --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -22
