# Session 29, call 1: where a warm encode pass spends its time; the CUDA gather with one lever off at a time.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $OUT/gpu.txt
timeout 500 python3 perf/experiments/encode_pass_profile.py $OUT/encode_pass_profile.json 2>&1 | tee $OUT/encode_pass_profile.log
