# Session 46, device call 1: the serving step's heaviest kernels, BF16 pages at B=9 and the recipe's page codec at
# its limit (B=46), to attribute the recipe's device time per step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
SPEC=$(python3 -c "from kvbackend.spec import RECOMMENDED_PAGE_SPEC as s; print(s)")
timeout ${LIMIT:-400} python3 perf/experiments/serving_step_profile.py --out $OUT/step_profile.json \
  --caches "identity:9|$SPEC:46" 2>&1 | grep -v Warning | grep -v "^ \|^$\|ncalls\|Ordered\|List reduced\|function calls" \
  | head -120
