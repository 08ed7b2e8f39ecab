# The next session's first device call (carry .whl .whl_vllm .sglang_min .vllm_min); $1: commit. `make gpu-test`
# under LIMIT first (session 40 changed integration/, tiers/ and kvbackend/unit_gather.py after the last full log),
# then in the time left of BUDGET seconds the SGLang get of the recipe's page codec: the split
# (perf/experiments/sglang_get_split.py) and the bench, whose gets of codebook codecs are now timed with the gather
# kernel and with the codec's decode in one run (session 40's open question: the split showed 42.9 against 86.8 ms,
# the bench no gain).
start=$(date +%s)
LIMIT=${LIMIT:-540} bash perf/results/s27/gpu_final.sh "$1"
status=$?
left=$(( ${BUDGET:-590} - ($(date +%s) - start) ))
echo "== $left s left for the SGLang get"
if [ "$left" -gt 60 ]; then
  export PYTHONPATH=.sglang_min:/tmp/site PYTHONUNBUFFERED=1
  recipe=$(python3 -c "import sys; sys.path.insert(0, 'perf'); from bench_sglang_gpu import CODECS; print(CODECS[-1])")
  timeout $(( left - 5 )) sh -c "python3 perf/bench_sglang_gpu.py --out $OUT/bench_sglang_gpu.json --codecs '$recipe' 2>&1 \
    | grep -v 'stores 4.83'; python3 perf/experiments/sglang_get_split.py $OUT/split64.json --pages 64 2>&1 \
    | grep -v 'stores 4.83'"
fi
exit $status
