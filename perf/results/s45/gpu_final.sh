# Session 45: session 27's gpu-test with 12 workers by default: `make gpu-test` on the commit named by $1 (8 test workers, bench_memory left out) under a
# limit that leaves the device call room; gpu_rest.sh runs what the limit cut, on the same tree.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_vllm .whl_vllm/*.whl || exit
export PYTHONPATH=.sglang_min:.vllm_min:/tmp/site:/tmp/site_vllm VLLM_CONFIGURE_LOGGING=0 PYTHONUNBUFFERED=1 GPU_TEST_WORKERS=${GPU_TEST_WORKERS:-12} GPU_TEST_MEMORY=0
timeout ${LIMIT:-560} make gpu-test COMMIT=$1 GPU_LOG=$OUT/gpu-test.log
status=$?
# the failures as they happened (tests/conftest.py), so the call's output names them even when the limit cut the run
[ -s "$OUT/gpu-test-failures.txt" ] && { echo "== failures"; cut -c1-300 "$OUT/gpu-test-failures.txt" | tail -60; }
# the tests that finished (tests/conftest.py's done log): a cut run is completed by GPU_TEST_SKIP_DONE=<this file>
[ -s "$OUT/gpu-test-done.txt" ] && echo "== finished tests: $(wc -l < "$OUT/gpu-test-done.txt") ($(grep -c '^failed' "$OUT/gpu-test-done.txt") failed)"
exit $status
