#!/usr/bin/env bash
# One device call: the storage adapters on CUDA at storage speed. The SGLang backend against HiCacheFile
# (`.sglang_min`: SGLang's storage interface), then vLLM's tier tests and its benchmark (`.vllm_min`: vLLM's
# offloading interface, whose third-party imports come from `.whl_vllm`: msgspec, psutil, regex, urllib3, pyzmq,
# PyYAML, installed apart from `.whl` so they shadow nothing the other steps use).
# `make gpu-test` needs a call of its own (about 500 s): session 13 ran it here under 480 s and lost bench_memory.
# Run from the repository root with .whl, .whl_vllm, .sglang_min and .vllm_min carried:
#   bash perf/gpu_adapters.sh        (writes under $OUT)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=.sglang_min:/tmp/site
t0=$SECONDS
timeout 120 python3 -m pytest -q -ra -p no:cacheprovider tests/test_sglang.py tests/test_device_codec.py > "$OUT/tests_sglang.log" 2>&1
echo "== SGLang tests: $(tail -1 "$OUT/tests_sglang.log")"
timeout 150 python3 perf/bench_sglang_gpu.py --out "$OUT/bench_sglang_gpu.json" 2>&1 | tail -5
if ls .whl_vllm/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_vllm .whl_vllm/*.whl
fi
export PYTHONPATH=.vllm_min:/tmp/site:/tmp/site_vllm VLLM_CONFIGURE_LOGGING=0  # (vLLM's platform probe is not in the subset)
timeout 120 python3 -m pytest -q -ra -p no:cacheprovider tests/test_vllm.py > "$OUT/tests_vllm.log" 2>&1
echo "== vLLM tests: $(tail -1 "$OUT/tests_vllm.log")"
left=$((570 - SECONDS + t0))
[ $left -gt 20 ] && timeout $left python3 perf/bench_vllm_gpu.py --out "$OUT/bench_vllm_gpu.json" 2>&1 | tail -6
echo "== end $((SECONDS - t0)) s"
