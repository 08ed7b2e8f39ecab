#!/usr/bin/env bash
# One device call (session 12): the tensor-core kernel's occupancy probe on the recipe's layouts (min_blocks, program
# counts; at 7be736f also the outlier-terms source, since merged), Nsight Compute on the recommended spec and its lever-free base, then the serving
# benchmark with BF16 pages, the recommended spec (now on the tensor-core kernel) and rtn-2.
# Run from the repository root with .whl carried:  bash perf/gpu_occupancy_serving.sh   (writes under $OUT)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
REC=$(python3 -c "from kvbackend.spec import RECOMMENDED_PAGE_SPEC as s; print(s)")
BASE="quantwm:kchannel=64,keep=0.0625,centroids=32,clip=true,vcluster=false,cdtype=fp8,rank=0"
timeout 170 python3 perf/experiments/mma_occupancy.py --out $OUT/mma_occupancy.json \
    2>&1 | tee $OUT/occupancy.log
(cd perf && for v in recipe base; do
    spec=$REC; [ $v = base ] && spec=$BASE
    timeout 75 ncu --clock-control none --kernel-name regex:mma_decode --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section SourceCounters --section MemoryWorkloadAnalysis \
        python3 ncu_kernels.py decode "$spec" --mma --levers > $OUT/ncu_$v.txt 2>&1
    echo "== ncu $v: rc $?"; grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issued Ipc|Stall|One or More" $OUT/ncu_$v.txt | head -24
done)
timeout 270 python3 perf/bench_serving.py --caches "identity|$REC|rtn:bits=2,group=64" --batches 1 --steps 3 \
    --workload 3 --new-tokens 8 --out $OUT/bench_serving.json --plot $OUT/bench_serving.png 2>&1 | tee $OUT/bench_serving.log | tail -30
