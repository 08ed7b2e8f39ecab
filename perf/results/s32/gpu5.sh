# Session 32, call 5: the CUDA gather of the recipe's layout (814 us, 35.7% of the copy ceiling in session 31):
# launch shapes timed side by side, then Nsight Compute (speed of light, stalls, source lines).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
KVB_BENCH_QUICK=1 KVB_GATHER_VARIANTS="256x4,256x8,512x2,512x8,1024x4,128x8" timeout 200 python3 perf/bench_kernels.py --only gather --out $OUT/gather.json 2>&1 | grep -E "^gather" | tee $OUT/gather.log
cd perf
spec=$(python3 -c "from kvbackend.spec import RECOMMENDED_PAGE_SPEC as s; print(s)")
timeout 150 ncu --clock-control none --kernel-name regex:gather_dequant --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section SourceCounters --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
    --section Occupancy --section LaunchStats \
    --import-source yes -o $OUT/gather_source -f python3 ncu_kernels.py gather "$spec" --levers --lineinfo > $OUT/ncu_run.txt 2>&1
echo "== profile rc $?"
ncu --import $OUT/gather_source.ncu-rep --page source --csv --print-source sass,cuda > $OUT/gather_source.csv 2>&1
ncu --import $OUT/gather_source.ncu-rep --page details --print-details all > $OUT/gather_details.txt 2>&1
grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Issue Slots|Executed Ipc|L1/TEX Hit|Bank" $OUT/gather_details.txt | head -30
python3 ncu_lines.py $OUT/gather_source.csv --top 40 --source ../kernels/gather_dequant.cu > $OUT/lines.txt 2>&1
head -45 $OUT/lines.txt | cut -c1-230
gzip -f $OUT/gather_source.csv
