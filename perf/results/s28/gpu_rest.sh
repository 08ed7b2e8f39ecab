# The benches of `make gpu-test` (perf/gpu_test.sh) after its pytest part, for a call whose limit cut them; $1: commit.
export PYTHONPATH=.sglang_min:.vllm_min:/tmp/site:/tmp/site_vllm VLLM_CONFIGURE_LOGGING=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
status=0
{
  echo "gpu-test remainder, commit $1 $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  KVB_BENCH_QUICK=1 python3 perf/bench_kernels.py --only ${SECTIONS:-ceiling,decode,levers,gather} --out $OUT/gpu-test-bench_kernels.json || status=1
  KVB_BENCH_QUICK=1 python3 perf/bench_tiers.py --out $OUT/gpu-test-bench_tiers.json || status=1
  echo "gpu-test remainder exit $status"
} 2>&1 | tee $OUT/gpu-test-remainder.log
