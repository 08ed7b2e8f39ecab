#!/usr/bin/env bash
# One device call for the tensor-core decode kernel: its GPU tests, the probe against the Triton kernels and SDPA,
# an Nsight Compute report and the SASS of every compiled variant. Run from the repository root with .whl carried:
#   bash perf/gpu_probe_mma.sh            (writes under $OUT)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x tests/test_mma_decode.py 2>&1 | tail -3
timeout 300 python3 perf/probe_mma.py --out $OUT/probe_mma.json 2>&1 | grep -v "^    {"
cd perf && timeout 100 ncu --clock-control none --kernel-name regex:mma_decode --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats python3 ncu_kernels.py decode rtn:bits=2,group=64,scale=fp8 --mma --stages 2 > $OUT/ncu_mma.txt 2>&1; echo ncu rc $?
grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|One or More Eligible|Executed Instructions " $OUT/ncu_mma.txt | head -12
