# Session 46, device call 3: why the serving cache's decode layer is slower than the benchmark's layout at B=46.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 300 python3 perf/experiments/serving_decode_probe.py --out $OUT/probe46.json --batch 46 2>&1 | grep -v Warning
timeout 200 python3 perf/experiments/serving_decode_probe.py --out $OUT/probe8.json --batch 8 2>&1 | grep -v Warning
