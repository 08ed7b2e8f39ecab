#!/usr/bin/env bash
# One device call (session 13): `make gpu-test` with SGLang's storage interface importable (`.sglang_min`, so the
# SGLang adapter's CUDA tests run inside it), then the storage adapters at storage speed: the SGLang backend
# against HiCacheFile, vLLM's tier tests on CUDA (`.vllm_min`, vLLM's offloading interface) and its benchmark.
# Run from the repository root with .whl, .sglang_min and .vllm_min carried:
#   bash perf/gpu_test_adapters.sh COMMIT        (writes under $OUT)
set -u
commit=${1:?full commit id}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=.sglang_min:/tmp/site
t0=$SECONDS
timeout 480 make gpu-test COMMIT="$commit" GPU_LOG="$OUT/gpu-test.log" > /dev/null 2>&1
echo "== gpu-test rc $? after $((SECONDS - t0)) s: $(grep -E '^[0-9]+ (passed|failed)|passed|gpu-test exit' "$OUT/gpu-test.log" | tail -3 | tr '\n' ' ')"
left=$((560 - SECONDS + t0))
[ $left -gt 20 ] && timeout $((left < 70 ? left : 70)) python3 perf/bench_sglang_gpu.py --out "$OUT/bench_sglang_gpu.json" 2>&1 | tail -5
export PYTHONPATH=.vllm_min:/tmp/site VLLM_CONFIGURE_LOGGING=0  # (vLLM's platform probe is not in the subset)
left=$((575 - SECONDS + t0))
[ $left -gt 15 ] && timeout $((left < 40 ? left : 40)) python3 -m pytest -q -ra -p no:cacheprovider tests/test_vllm.py \
    > "$OUT/tests_vllm.log" 2>&1; echo "== vLLM tests: $(tail -1 "$OUT/tests_vllm.log")"
left=$((585 - SECONDS + t0))
[ $left -gt 15 ] && timeout $left python3 perf/bench_vllm_gpu.py --out "$OUT/bench_vllm_gpu.json" 2>&1 | tail -5
echo "== end $((SECONDS - t0)) s"
