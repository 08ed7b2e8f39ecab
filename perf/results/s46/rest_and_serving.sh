# Session 46, device call 7: the quick benches of make gpu-test (perf/results/s27/gpu_rest.sh) and the serving bench's
# throughput section, on the gpu-test's warm machine; $1: commit.
timeout 330 bash perf/results/s27/gpu_rest.sh $1 | grep -v Warning | grep "decode\|levers\|gather\|restore\|exit\|x raw\|faster" | head -40
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout 200 python3 perf/bench_serving.py --batches 1 --steps 3 --workload 0 --ttft 0 --anchor 0 \
  --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -5
