# Session 47: the serving decode step of the recipe's page codec at B=46 (and B=9), the code before this session's
# append_step changes (perf/results/s47/base_pkg: `git archive 2970362 kvbackend`, not committed) against the
# current one, alternated, then the serving bench's throughput section with the current code.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
SPEC=$(python3 -c "from kvbackend.spec import RECOMMENDED_PAGE_SPEC as s; print(s)")
for side in ${SIDES:-base new base new}; do
  n=$((${n:-0} + 1))
  if [ $side = base ]; then P=/tmp/site:perf/results/s47/base_pkg; else P=/tmp/site; fi
  echo "== $side ($n)"
  PYTHONPATH=$P timeout 150 python3 perf/experiments/serving_step_profile.py --out $OUT/step_${side}_$n.json \
    --caches "$SPEC:46" 2>&1 | grep '"batch"\|B=46:\|append_step\|add_step_moments\|kvbackend from' | head -12
done
export PYTHONPATH=/tmp/site
timeout ${SERVING_LIMIT:-200} python3 perf/bench_serving.py --batches 1 --steps 3 --workload 0 --ttft 0 --anchor 0 \
  --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | grep -v Warning | tail -8
