# Session 44, device call 2: where the recipe's file-tier time to first token goes (1.30 s in call 1, 0.22 s in
# session 17).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
timeout ${LIMIT:-300} python3 perf/results/s44/file_restore_profile.py $OUT 2>&1 | grep -v Warning
