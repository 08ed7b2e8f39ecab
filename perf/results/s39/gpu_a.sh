# Session 39's first device call (carry .whl .whl_vllm .sglang_min .vllm_min); $1: commit. `make gpu-test` with 12
# test workers (16 cores on the device; session 38's 8 took 461 s of pytest), bench_memory left out, under LIMIT;
# then, while the call has time left (START: its start, BUDGET: its seconds), gpu_b.sh's 4-bit decode-step rows.
start=$(date +%s)
export GPU_TEST_WORKERS=${GPU_TEST_WORKERS:-12}
bash perf/results/s27/gpu_final.sh "$1"
status=$?
left=$(( ${BUDGET:-585} - ($(date +%s) - start) ))
echo "== $left s left for the 4-bit decode-step rows"
if [ "$left" -gt 60 ]; then
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
  timeout $(( left - 10 )) python3 perf/results/s38/step_only.py $OUT/step_only.json --k4 \
    "$(cat perf/results/s37/p27l18k4b.spec)" 2>&1 | grep -v Warn | tee $OUT/step.log
fi
exit $status
