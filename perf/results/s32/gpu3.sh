# Session 32, call 3: the SGLang set read straight from the page-locked pool, and fresh states without per-chunk
# copies: the adapter and unit tests on CUDA, the set profile, then the bench (three codecs) at 32 and 16 pages per batch.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=.sglang_min:/tmp/site PYTHONUNBUFFERED=1
timeout 150 python3 -P -m pytest -q -n 8 tests/test_sglang.py tests/test_encode_units.py tests/test_device_codec.py 2>&1 | tail -3 | tee $OUT/tests.log
timeout 120 python3 -P perf/experiments/sglang_set_profile.py $OUT 2>&1 | grep -v Warn | head -12
for b in 32 16; do
  timeout 150 python3 -P perf/bench_sglang_gpu.py --out $OUT/bench_sglang_gpu_b$b.json --batch-pages $b 2>&1 | grep -v Warn | grep -E "GB/s" | cut -c1-400
done
