# Session 59, first device call: the chw tensor-core path's tests (and the chw kernels' with lane order) on CUDA,
# then its bench beside SDPA, KIVI-2 and the chw Triton kernel.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -P -m pytest -q -x tests/test_mma_chw.py 2>&1 | tail -15
PYTHONPATH=/tmp/site:. timeout 300 python perf/bench_chw_mma.py $OUT/chw_mma.json 8,32768 1,32768 32,8192 8,131072 2>&1 \
  | grep -v "^\s*$" | tail -30
timeout 80 python -P -m pytest -q tests/test_chw_gather.py tests/test_chw.py 2>&1 | tail -4
