#!/usr/bin/env bash
# Nsight Compute reports of the decode and gather kernels at B=8, L=32K (one device call).
#   bash perf/ncu_all.sh $OUT
set -u
out=${1:?output folder}
cd "$(dirname "$0")"
sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"
run() {  # name, kernel regex, extra ncu args, driver args...
    local name=$1 regex=$2 extra=$3; shift 3
    ncu --clock-control none --kernel-name "regex:$regex" --launch-skip 2 --launch-count 1 $sections $extra \
        python3 ncu_kernels.py "$@" > "$out/ncu_$name.txt" 2>&1
    echo "== $name: rc $?"; grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Issued Ipc|Block Limit Reg|One or More Eligible|Waves Per SM" "$out/ncu_$name.txt" | head -20
}
run decode_rtn folded "--section SourceCounters" decode "rtn:bits=2,group=64,scale=fp8"
run decode_qvg folded "" decode qvg
run decode_kivi folded "" decode "kivi:bits=2,group=64"
run decode_identity paged_decode_kernel "" decode identity
run gather_rtn gather "" gather "rtn:bits=2,group=64,scale=fp8"
