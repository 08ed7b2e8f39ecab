# Session 54's second call (carry .whl), on the machine the gpu-test warmed: the card's serving rows (the recipe, rtn-2
# and BF16 pages at the memory limit, with CUDA graphs) and the quick kernel benches (decode with levers and gather,
# SDPA BF16 beside them in the same run). About 330 s.
source perf/results/s49/setup.sh
echo "== serving"
timeout ${SERVING_LIMIT:-170} python3 perf/bench_serving.py --batches 1 --steps 8 --workload 0 --ttft 0 --anchor 0 \
  --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -22
echo "== kernels"
KVB_BENCH_QUICK=1 timeout ${KERNEL_LIMIT:-200} python3 perf/bench_kernels.py --only ${SECTIONS:-ceiling,decode,levers,gather} \
  --out $OUT/bench_kernels.json 2>&1 | tail -40
true
