# Session 40's first device call (carry .whl .whl_vllm .sglang_min .vllm_min); $1: commit. `make gpu-test` under
# LIMIT (perf/results/s27/gpu_final.sh), then, while the call has time left (BUDGET: its seconds), the decode step of
# the recommended spec (4-bit keys and whole rows on by default now) against session 36's spec.
start=$(date +%s)
bash perf/results/s27/gpu_final.sh "$1"
status=$?
left=$(( ${BUDGET:-585} - ($(date +%s) - start) ))
echo "== $left s left for the decode-step rows"
if [ "$left" -gt 60 ]; then
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
  timeout $(( left - 10 )) python3 perf/results/s38/step_only.py $OUT/step_only.json \
    "$(cat perf/results/s40/session36.spec)" 2>&1 | grep -v Warn | tee $OUT/step.log
fi
exit $status
