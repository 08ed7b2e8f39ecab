# Session 41's third device call (carry .whl .whl_vllm .sglang_min .vllm_min); $1: commit. The SGLang get of the
# recipe's page codec first (the bench, which times the gets with the gather kernel and with the codec's decode, and
# the split of one get), then the quick benches of `make gpu-test` that call 1's limit cut (perf/results/s27/gpu_rest.sh).
export PYTHONPATH=.sglang_min:/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
recipe=$(python3 -c "import sys; sys.path.insert(0, 'perf'); from bench_sglang_gpu import CODECS; print(CODECS[-1])")
timeout ${SGLANG_LIMIT:-240} sh -c "python3 perf/bench_sglang_gpu.py --out $OUT/bench_sglang_gpu.json --codecs '$recipe' 2>&1 \
  | grep -v 'stores 4.83'; python3 perf/experiments/sglang_get_split.py $OUT/split64.json --pages 64 2>&1 \
  | grep -v 'stores 4.83'"
bash perf/results/s27/gpu_rest.sh "$1"
