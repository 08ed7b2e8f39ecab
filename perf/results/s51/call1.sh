# Session 51, call 1 (carry .whl, out/mma_decode_base.cu; made here first by
# `git show 126dd00~1:kernels/mma_decode.cu > out/mma_decode_base.cu`).
# 1. This tree's tensor-core decode (fp8-pair set-up of pre-RoPE pages, contiguous page runs per warp; its tests run
#    in the gpu-test) against main's before both (recipe, and the recipe's layout without levers) at B=8 (graphs).
# 2. The split-K sweep of the recipe and rtn-2 at B=46.
# 3. The serving bench's throughput section (graphs; each cache at B=1 and at its memory limit).
source perf/results/s49/setup.sh
AB_VARIANTS="recipe|recipe, no levers, no PSAC" timeout 120 python3 perf/results/s46/ab_codebooks.py \
  $OUT/ab_base.json out/mma_decode_base.cu 8 2>&1 | grep "B=8"
timeout 100 python3 perf/experiments/decode_splits.py --out $OUT/decode_splits.json --batches 46 \
  --splits 1,2,3,5,8,16 2>&1 | grep "splits"
timeout 200 python3 perf/bench_serving.py --batches 1 --steps 8 --workload 0 --ttft 0 --anchor 0 \
  --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -22
