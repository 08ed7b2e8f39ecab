# Session 40's third device call (carry .whl .whl_vllm .sglang_min .vllm_min); $1: commit. First the SGLang get of
# the recipe's page codec with the page check run a decode batch at a time (perf/experiments/sglang_get_split.py: the gather
# kernel's decode and the codec's side by side; then perf/bench_sglang_gpu.py for rtn-2 and the recipe's page codec);
# then `make gpu-test` in the time left of BUDGET seconds (perf/results/s27/gpu_final.sh).
start=$(date +%s)
export PYTHONPATH=.sglang_min:/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 perf/experiments/sglang_get_split.py $OUT/split64.json --pages 64 2>&1 | grep -v "stores 4.83"
recipe=$(python3 -c "import sys; sys.path.insert(0, 'perf'); from bench_sglang_gpu import CODECS; print(CODECS[-1])")
python3 perf/bench_sglang_gpu.py --out $OUT/bench_sglang_gpu.json --codecs "rtn:bits=2,group=64,scale=fp8|$recipe" 2>&1 \
  | grep -v "stores 4.83"
left=$(( ${BUDGET:-590} - ($(date +%s) - start) ))
echo "== $left s left for make gpu-test"
LIMIT=$(( left - 5 )) bash perf/results/s27/gpu_final.sh "$1"
