# Session 22 device call 1, kept as run: the CUDA gather kernel for plain layouts on CUDA (tests), then the gather
# section of bench_kernels (Triton against CUDA, plus launch shapes) beside the copy and write-only ceilings.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -x -n 8 tests/test_gather_cuda.py tests/test_gather_dequant.py tests/test_paged_decode.py 2>&1 | tail -6
KVB_GATHER_VARIANTS="128x4,128x8,256x2,256x8,512x2,512x4,1024x2" timeout 300 python3 perf/bench_kernels.py --only ceiling,gather --out $OUT/gather.json 2>&1 | grep -v "^ *{" | tail -40
