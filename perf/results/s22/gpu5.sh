# perf/results/s22/gather_fast.cu (not kept: the same as kernels/gather_dequant.cu plus a patch) is recreated first with
#   cp kernels/gather_dequant.cu perf/results/s22/gather_fast.cu && patch perf/results/s22/gather_fast.cu perf/results/s22/gather_fast.patch
# Session 22 device call 5, kept as run: (1) the CUDA tests of this session's launcher fixes (gather and decode kernels
# loaded inside the pages' device context, head_dim <= 128, fallback to Triton); (2) a variant of the gather kernel
# (perf/results/s22/gather_fast.cu: exact pairwise fp8 conversions, integer-free code conversion, corrupted centroid
# ids read nothing) copied over the kernel on the device only: its tests and the quick gather bench beside the
# committed kernel's; (3) Nsight Compute's source view of the committed kernel on the recipe's layout.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 KVB_BENCH_QUICK=1
timeout 120 python3 -m pytest -q -x -n 8 tests/test_gather_cuda.py tests/test_mma_decode.py tests/test_gather_dequant.py 2>&1 | tail -2
timeout 60 python3 perf/bench_kernels.py --only ceiling,gather --out $OUT/gather_a.json 2>&1 | grep "^gather"
mkdir -p /tmp/orig && cp kernels/gather_dequant.cu /tmp/orig/ && cp perf/results/s22/gather_fast.cu kernels/gather_dequant.cu
timeout 100 python3 -m pytest -q -x -n 8 tests/test_gather_cuda.py 2>&1 | tail -2
timeout 60 python3 perf/bench_kernels.py --only ceiling,gather --out $OUT/gather_b.json 2>&1 | grep "^gather"
cp /tmp/orig/gather_dequant.cu kernels/gather_dequant.cu
sed -i 's/"-O3", "-std=c++17", \*config.defines()/"-O3", "-std=c++17", "-lineinfo", *config.defines()/' kernels/gather_cuda.py
timeout 100 ncu --clock-control none --kernel-name regex:gather_dequant --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy --import-source yes -o $OUT/gather_src -f python3 perf/experiments/gather_profile.py > $OUT/ncu_run.txt 2>&1; echo "ncu rc $?"
ncu --import $OUT/gather_src.ncu-rep --page details --print-details all > $OUT/gather_details.txt 2>&1
grep -E "Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|DRAM Throughput|No Eligible|One or More" $OUT/gather_details.txt | head -12
ncu --import $OUT/gather_src.ncu-rep --page source --csv --print-source sass,cuda > $OUT/gather_source.csv 2>&1; gzip -f $OUT/gather_source.csv
