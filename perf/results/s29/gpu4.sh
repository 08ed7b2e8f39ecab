# Session 29, call 4: the depth spec's chunk encode in one mixed pass (default_step.py), twice.
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
for i in 1 2; do timeout 150 python3 perf/experiments/default_step.py $OUT/default_step_$i.json 2>&1 | tee $OUT/default_step_$i.log; done
