# Session 32, call 4: the SGLang get of the recipe's page codec, profiled (set again beside it).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=.sglang_min:/tmp/site PYTHONUNBUFFERED=1
timeout 150 python3 -P perf/experiments/sglang_set_profile.py $OUT 2>&1 | grep -E "^(set|get|encode_units)"
head -30 $OUT/sglang_get_ops.txt | cut -c1-250
sed -n '/Self CPU time total/,$p' $OUT/sglang_get_ops.txt | sed -n 3,28p | cut -c1-250
