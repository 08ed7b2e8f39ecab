# Session 32, call 2: where the SGLang backend's set of the recipe's page-local codec goes on the H200 (#20's set
# >= 2 GB/s), then the bench with that codec beside HiCacheFile.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=.sglang_min:/tmp/site PYTHONUNBUFFERED=1
timeout 200 python3 -P perf/experiments/sglang_set_profile.py $OUT 2>&1 | grep -v Warn | head -120
timeout 150 python3 -P perf/bench_sglang_gpu.py --out $OUT/bench_sglang_gpu.json --codecs "$(python3 -c 'import sys; sys.path.insert(0, "perf"); from bench_sglang_gpu import CODECS; print(CODECS[-1])')" 2>&1 | grep -v Warn | tail -5
