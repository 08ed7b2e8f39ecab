# Session 22 device call 5, kept as run: where the recipe's CUDA gather spends its time (Nsight Compute source view of
# the committed kernel, compiled with -lineinfo on the device copy only), then a variant with exact pairwise fp8
# conversions and integer-free code conversion (perf/results/s22/gather_fast.cu, copied over the kernel on the
# device only): its tests and the quick gather bench beside the committed kernel's.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1 KVB_BENCH_QUICK=1
timeout 60 python3 perf/bench_kernels.py --only ceiling,gather --out $OUT/gather_a.json 2>&1 | grep "^gather"
sed -i 's/"-O3", "-std=c++17", \*config.defines()/"-O3", "-std=c++17", "-lineinfo", *config.defines()/' kernels/gather_cuda.py
timeout 120 ncu --clock-control none --kernel-name regex:gather_dequant --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy --import-source yes -o $OUT/gather_src -f python3 perf/experiments/gather_profile.py > $OUT/ncu_run.txt 2>&1; echo "ncu rc $?"
ncu --import $OUT/gather_src.ncu-rep --page source --csv --print-source sass,cuda > $OUT/gather_source.csv 2>&1; gzip -f $OUT/gather_source.csv
ncu --import $OUT/gather_src.ncu-rep --page details --print-details all > $OUT/gather_details.txt 2>&1
grep -E "Duration|Registers|Achieved Occupancy|Issue Slots Busy|Executed Ipc|DRAM Throughput|No Eligible" $OUT/gather_details.txt | head -12
cp perf/results/s22/gather_fast.cu kernels/gather_dequant.cu
timeout 150 python3 -m pytest -q -x -n 8 tests/test_gather_cuda.py 2>&1 | tail -2
timeout 60 python3 perf/bench_kernels.py --only ceiling,gather --out $OUT/gather_b.json 2>&1 | grep "^gather"
