# Session 26, call 1: the encoders' k-means without a CUDA graph, and the outliers' top-k through token segments,
# each against session 25's choice in the same call (fresh processes: a graph holds its pool for the process's life).
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
export PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x tests/test_unit_encoder.py tests/test_unit_encoder_attacks.py tests/test_encode_kernel.py tests/test_quantwm.py tests/test_codecs.py 2>&1 | tail -4
for mode in eager graphed eager_fulltopk eager; do
  timeout 90 python3 perf/results/s26/patched_bench.py $mode --only encode --out $OUT/encode_$mode.json 2>&1 | grep -v -i warn | grep -i "encode\|keeps\|GB/s" | tail -8
  echo "== $mode done"
done
