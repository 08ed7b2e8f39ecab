# Session 48: where the host time of a decode step with CUDA graphs goes (B=9, the serving bench's three caches).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${LIMIT:-240} python3 perf/experiments/graph_step_host.py --batch ${BATCH:-9} --out $OUT/graph_step_host.txt 2>&1 | grep -v Warning | tail -8
