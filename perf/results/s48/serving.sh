# Session 48: the runner's decode steps with CUDA graphs (kvbackend/tools/step_graphs.py) tested on CUDA, then the
# serving bench's throughput section (BF16 pages, rtn-2, the recommended page codec at their limits and at B=9):
# eager steps, steps with CUDA graphs, and the summed kernel time of a step, side by side.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_llama_runner.py 2>&1 | tail -15 | tee $OUT/test_llama_runner.txt
timeout ${LIMIT:-420} python3 perf/bench_serving.py --batches 1 --steps 3 --workload 0 --ttft 0 --anchor 0 \
  --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -16
