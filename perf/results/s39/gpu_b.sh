# Session 39's second device call (carry .whl); $1: commit. The decode step alone of the recommended spec beside
# p27l18k4b (4-bit keys in layer 18) with the tensor-core kernel's 4-bit path off and on (--k4), then the quality
# spec with whole rows on the tensor-core kernel (session 38's gpu4.sh without its tests, which `make gpu-test` ran).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
echo "commit $1" | tee $OUT/step.log
timeout 200 python3 perf/results/s38/step_only.py $OUT/step_only.json --k4 "$(cat perf/results/s37/p27l18k4b.spec)" 2>&1 \
  | grep -v Warn | tee -a $OUT/step.log
KVBACKEND_CUDA_WHOLE=1 timeout 200 python3 perf/results/s38/step_only.py $OUT/step_quality.json \
  "$(python3 -c 'from kvbackend.spec import QUALITY_SPEC as q; print(q)')" 2>&1 | grep -v Warn | tee $OUT/step_quality.log
