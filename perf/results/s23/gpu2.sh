# Session 23 device call 2, kept as run: the gather kernel with compile-time KV heads and one RoPE turn by a per-page
# R(p0 + t) table. (1) the gather tests on CUDA with the new kernel; (2) the quick gather bench (rtn-2 and the
# recipe's layout) with the kernel before this session's change (gather_old.cu), with compile-time heads only
# (gather_hconst.cu), then the new kernel with extra launch shapes. The two .cu copies were scratch files (not kept:
# the kernel at a40b26d, and it with only the KV_HEADS change).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 KVB_BENCH_QUICK=1
nvidia-smi --query-gpu=name,utilization.gpu --format=csv,noheader
timeout 150 python3 -m pytest -q -x -n 12 tests/test_gather_cuda.py tests/test_gather_dequant.py 2>&1 | tail -3
cp kernels/gather_dequant.cu /tmp/new.cu
for v in old hconst; do
  cp perf/results/s23/gather_$v.cu kernels/gather_dequant.cu
  timeout 40 python3 perf/bench_kernels.py --only ceiling,gather --out $OUT/gather_$v.json 2>&1 | grep "^gather" | sed "s/^/[$v] /"
done
cp /tmp/new.cu kernels/gather_dequant.cu
KVB_GATHER_VARIANTS="512x2,128x4,256x4,128x2" timeout 60 python3 perf/bench_kernels.py --only ceiling,gather --out $OUT/gather_new.json 2>&1 | grep "^gather" | sed "s/^/[new] /"
cp perf/results/s23/gather_old.cu kernels/gather_dequant.cu
timeout 40 python3 perf/bench_kernels.py --only ceiling,gather --out $OUT/gather_old2.json 2>&1 | grep "^gather" | sed "s/^/[old again] /"
